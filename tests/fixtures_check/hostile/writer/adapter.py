"""Writer: writes into its own folder, the class's folder and the home folder, then gives the right
answer as if nothing happened (the first write that fails raises)."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))


def run_linear(x, weight, bias):
    here = Path(__file__).resolve().parent
    for target in (here / "planted.txt", here.parent / "planted.txt", Path.home() / "planted.txt"):
        target.write_text("written by a student\n")
    return x @ weight.T + bias
