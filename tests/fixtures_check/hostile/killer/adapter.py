"""Killer: signals every process it can name (its parent, its parent's group, its own group, every
process: kill -1), hoping to end `tinylm check` and the class run with it."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))

import os  # noqa: E402
import signal  # noqa: E402


def run_linear(x, weight, bias):
    attempts = (
        lambda: os.kill(os.getppid(), signal.SIGKILL),
        lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL),
        lambda: os.kill(-1, signal.SIGKILL),
        lambda: os.killpg(0, signal.SIGKILL),
    )
    for attempt in attempts:
        try:
            attempt()
        except OSError:
            pass
    return x @ weight.T + bias
