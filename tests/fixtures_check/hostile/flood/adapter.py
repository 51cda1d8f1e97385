"""Flood: answers with 80 MiB (the right answer and 20 tensors of 4 MiB), over what a reply may hold."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))


def run_linear(x, weight, bias):
    y = x @ weight.T + bias
    return [y] + [torch.zeros(2**20) for _ in range(20)]
