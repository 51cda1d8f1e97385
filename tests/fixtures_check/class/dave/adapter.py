"""Dave: a cross-entropy that raises, and BPE ties broken by the greatest bytes."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))


def run_cross_entropy(logits, targets, ignore_index):
    raise ValueError("targets and logits disagree")


def best_pair(counts, vocab):
    top = max(counts.values())
    return max((p for p, c in counts.items() if c == top), key=lambda p: (vocab[p[0]], vocab[p[1]]))
