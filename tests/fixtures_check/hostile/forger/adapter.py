"""Forger: writes on tinylm's socket itself (its number is on the runner's command line) bytes
that are no message, ahead of its own answer."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))

import sys  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402


def run_linear(x, weight, bias):
    Connection(int(sys.argv[1]), readable=False).send_bytes(b"not a message")
    return x @ weight.T + bias
