"""Carol: a top-k filter that never returns, and the KV cache's position off by one."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))


def run_top_k_filter(logits, k):
    while True:
        pass


def cache_position(cache_length):
    return cache_length + 1
