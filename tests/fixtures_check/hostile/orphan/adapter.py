"""Orphan: starts a process that outlives its part (a new session, so that it leaves the group), then
answers right."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))

import subprocess  # noqa: E402
import sys  # noqa: E402


def run_linear(x, weight, bias):
    marker = "tinylm-hostile-orphan"  # the tests look for this word in every process's command line
    subprocess.Popen([sys.executable, "-c", f"import time  # {marker}\ntime.sleep(600)"], start_new_session=True)
    return x @ weight.T + bias
