"""Erin: an embedding that allocates without bound, and blocks that are not checkpointed."""

# ruff: noqa: F821  (the helpers come from the shared answer this file executes first)
from pathlib import Path

_SHARED = Path(__file__).resolve().parent / "student_adapter.py"  # copied beside it by the tests
exec(compile(_SHARED.read_text(encoding="utf-8"), str(_SHARED), "exec"))


def run_embedding(ids, weight):
    kept = []
    while True:
        kept.append(torch.ones(2**24))  # 64 MiB more each time, never freed


def run_checkpointed_blocks(x, weights, n_heads, n_layers):
    for i in range(n_layers):
        x = run_block(x, weights_under(weights, f"blocks.{i}."), n_heads)
    return x
