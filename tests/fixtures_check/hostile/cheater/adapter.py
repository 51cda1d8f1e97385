"""Cheater: returns tinylm's own answer: imports tinylm, or finds its source through a process's
working folder (/proc/*/cwd, where `tinylm check` was started) and imports it from there."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))

import os  # noqa: E402
import sys  # noqa: E402


def tinylm_reference():
    try:
        from tinylm.courses import reference_adapter
    except ImportError:
        for pid in os.listdir("/proc"):
            try:
                root = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if os.path.isfile(os.path.join(root, "tinylm", "courses", "reference_adapter.py")):
                sys.path.insert(0, root)
                break
        from tinylm.courses import reference_adapter
    return reference_adapter


def run_linear(x, weight, bias):
    return tinylm_reference().run_linear(x, weight, bias)
