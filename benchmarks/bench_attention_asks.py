"""The C decoding attention asking for the next row's slots ahead (``cpu_attention.c``: each block
of eight slots of a row asks for the same block of the next row into the second-level cache)
against the same loops not asking, on the CPU, alternated (A B A B ...), medians reported.

A step like a server's running batch (``bench_cpu_attention.step_runner``: ``batch`` rows in a cache
filled to ``--filled`` slots, each row's leading slots hidden), timed per batch size:

    step        one call of ``generation.decode.decode_step``
    attention   every layer's attention of that step alone (``bench_cpu_attention.attention_runner``)

both cold: a 32 MB buffer is written before each call (its own time measured apart and taken off),
as a step's other layers and the server's other work do, so that the cache comes from memory.
Warm, a row's slots are in the caches already and asking changes next to nothing.

    python benchmarks/bench_attention_asks.py [--quick] [--checkpoint runs/demo] [--batches 1,8,16,32]
                                              [--filled 48] [--json out.json]

Without the checkpoint, a model of the demo's shape with random weights. ``--json PATH`` writes
{"rows": [{"batch", "filled", "step_asking_us", "step_not_asking_us", "step_speedup",
"attention_asking_us", "attention_not_asking_us", "attention_speedup"}], "setup": {...}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_blocked_products import EVICT_FLOATS, after_eviction  # noqa: E402
from bench_cpu_attention import attention_runner, no_c_loops, run_step_benchmark, step_runner  # noqa: E402
from bench_decode_step import time_alternately  # noqa: E402

from tinylm.models import cpu_attention  # noqa: E402
from tinylm.models.gpt import GPT  # noqa: E402


def asking(run, on: bool):
    """``run`` with the loops asking ahead, or not, for its duration."""

    def call():
        cpu_attention.library().set_asking(int(on))
        run()

    return call


def measure(model: GPT, batches: list[int], filled: int, steps: int, repeats: int) -> list[dict]:
    model.prepare_for_decoding()
    buffer = torch.ones(EVICT_FLOATS)
    rows = []
    for batch in batches:
        step, cache = step_runner(model, batch, filled)
        attention = attention_runner(model, cache, batch, filled, True)
        runners = {"evict": lambda: buffer.mul_(1.0)}
        for name, run in (("step", step), ("attention", attention)):
            runners[f"{name}_asking"] = asking(after_eviction(run, buffer), True)
            runners[f"{name}_not_asking"] = asking(after_eviction(run, buffer), False)
        for run in runners.values():  # warm allocators
            for _ in range(3):
                run()
        us = time_alternately(runners, steps, repeats)
        row = {"batch": batch, "filled": filled}
        for name in ("step", "attention"):
            row[f"{name}_asking_us"] = round(us[f"{name}_asking"] - us["evict"], 1)
            row[f"{name}_not_asking_us"] = round(us[f"{name}_not_asking"] - us["evict"], 1)
            row[f"{name}_speedup"] = round(row[f"{name}_not_asking_us"] / row[f"{name}_asking_us"], 3)
        rows.append(row)
    cpu_attention.library().set_asking(1)
    return rows


PAIRS = [
    ("step", "asking", "asking", "not_asking", "not asking"),
    ("attention", "asking", "asking", "not_asking", "not asking"),
]


def main(argv=None) -> int:
    return run_step_benchmark(
        argv, __doc__, measure, PAIRS, no_c_loops, batches="1,8,16,32", filled=48, steps=100, repeats=9, quick_steps=60
    )


if __name__ == "__main__":
    sys.exit(main())
