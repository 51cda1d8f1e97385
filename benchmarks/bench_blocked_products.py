"""The decoding step with oneDNN's blocked products (``gpt.DecodeLayout.blocked``) against the same
step with MKL's products alone, on the CPU, alternated (A B A B ...), medians reported.

A step like a server's running batch (``bench_cpu_attention.step_runner``: ``batch`` rows in a cache
filled to ``--filled`` slots, each row's leading slots hidden), timed two ways per batch size:

    warm    the step again and again: the weights stay in the caches between steps
    cold    a 32 MB buffer is written before each step (its own time measured apart and taken
            off), as the server's other work does between steps: the weights come from memory

Steps of fewer than ``gpt.BLOCKED_MIN_ROWS`` rows run MKL's products both ways (the two columns
then time the same code).

    python benchmarks/bench_blocked_products.py [--quick] [--checkpoint runs/demo] [--batches 1,8,16,32]
                                                [--filled 64] [--json out.json]

Without the checkpoint, a model of the demo's shape with random weights. ``--json PATH`` writes
{"rows": [{"batch", "filled", "warm_blocked_us", "warm_mkl_us", "warm_speedup", "cold_blocked_us",
"cold_mkl_us", "cold_speedup"}], "setup": {...}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_cpu_attention import run_step_benchmark, step_runner  # noqa: E402
from bench_decode_step import time_alternately  # noqa: E402

from tinylm.models.gpt import GPT, Linear  # noqa: E402

EVICT_FLOATS = 8 * 1024 * 1024  # 32 MB: the L3 cache of the machines this was measured on


def with_layouts(run, layers: list[Linear], layouts: list):
    """``run`` with ``layouts`` given to ``layers`` first (the blocked ones, or MKL's alone)."""

    def call():
        for layer, layout in zip(layers, layouts):
            layer.decode_layout = layout
        run()

    return call


def after_eviction(run, buffer: torch.Tensor):
    def call():
        buffer.mul_(1.0)
        run()

    return call


def measure(model: GPT, batches: list[int], filled: int, steps: int, repeats: int) -> list[dict]:
    model.prepare_for_decoding()
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.decode_layout is not None]
    blocked = [m.decode_layout for m in layers]
    mkl = [layout._replace(blocked=None) for layout in blocked]
    buffer = torch.ones(EVICT_FLOATS)
    rows = []
    for batch in batches:
        step, _ = step_runner(model, batch, filled)
        runners = {
            "warm_blocked": with_layouts(step, layers, blocked),
            "warm_mkl": with_layouts(step, layers, mkl),
            "evict": lambda: buffer.mul_(1.0),
            "cold_blocked": with_layouts(after_eviction(step, buffer), layers, blocked),
            "cold_mkl": with_layouts(after_eviction(step, buffer), layers, mkl),
        }
        for run in runners.values():  # warm allocators and oneDNN's kernels for this shape
            for _ in range(3):
                run()
        us = time_alternately(runners, steps, repeats)
        row = {"batch": batch, "filled": filled}
        for way in ("warm", "cold"):
            less = us["evict"] if way == "cold" else 0.0
            row[f"{way}_blocked_us"] = round(us[f"{way}_blocked"] - less, 1)
            row[f"{way}_mkl_us"] = round(us[f"{way}_mkl"] - less, 1)
            row[f"{way}_speedup"] = round(row[f"{way}_mkl_us"] / row[f"{way}_blocked_us"], 3)
        rows.append(row)
    for layer, layout in zip(layers, blocked):
        layer.decode_layout = layout
    return rows


PAIRS = [("warm", "blocked", "blocked", "mkl", "MKL"), ("cold", "blocked", "blocked", "mkl", "MKL")]


def no_blocked_weights(model: GPT) -> str | None:
    model.prepare_for_decoding()
    if model.blocks[0].ffn.down.decode_layout.blocked is None:
        return "no blocked weights here (torch without oneDNN, or a model not in float32)"
    return None


def main(argv=None) -> int:
    return run_step_benchmark(
        argv,
        __doc__,
        measure,
        PAIRS,
        no_blocked_weights,
        batches="1,8,16,32",
        filled=64,
        steps=100,
        repeats=9,
        quick_steps=20,
    )


if __name__ == "__main__":
    sys.exit(main())
