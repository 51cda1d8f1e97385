"""The decoding step with its attention in C (``tinylm/models/cpu_attention.py``) against the same
step with torch's batched products, on the CPU, alternated (A B A B ...), medians reported.

A step like a server's running batch: ``batch`` rows in a cache filled to ``--filled`` slots, each
row having joined at a different time (its leading slots hidden by its mask, a random number of
them: on average half the filled slots), one token each. Timed per batch size:

    step        one call of ``generation.decode.decode_step``, the loops on / off
                (``TINYLM_CPU_ATTENTION``)
    attention   every layer's attention of that step alone (scores, softmax, weighted values):
                ``cpu_attention.attend`` / ``gpt.step_attention_products``

    python benchmarks/bench_cpu_attention.py [--quick] [--checkpoint runs/demo] [--batches 1,4,16,32]
                                             [--filled 96] [--json out.json]

Without the checkpoint, a model of the demo's shape (d_model 192, 4 layers, 6 heads, context 128)
with random weights: the time does not depend on the weights. ``--json PATH`` writes {"rows":
[{"batch", "filled", "step_loops_us", "step_products_us", "step_speedup", "attention_loops_us",
"attention_products_us", "attention_speedup"}], "setup": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_decode_step import time_alternately  # noqa: E402

from tinylm.config import ModelConfig  # noqa: E402
from tinylm.generation.decode import decode_step  # noqa: E402
from tinylm.interop.loading import load_any_checkpoint  # noqa: E402
from tinylm.models import cpu_attention  # noqa: E402
from tinylm.models.gpt import GPT, step_attention_products  # noqa: E402

DEMO_SHAPE = dict(vocab_size=1024, context_length=128, d_model=192, n_layers=4, n_heads=6, positions="learned")


def switched(run, on: bool):
    """``run`` with the C loops switched on or off for its duration."""

    def call():
        os.environ[cpu_attention.SWITCH] = "1" if on else "0"
        run()

    return call


def step_runner(model: GPT, batch: int, filled: int, seed: int = 0):
    """One decoding step of ``batch`` rows at slot ``filled``, each row's leading slots hidden."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_kv_cache(batch, model.config.context_length)
    first = torch.randint(0, filled, (batch,), generator=g)
    cache.key_mask = torch.arange(cache.max_len)[None, :] >= first[:, None]
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=g)
    positions = filled - first

    def run():
        cache.length = filled
        decode_step(model, cache, tokens, positions.clone())

    return run, cache


def attention_runner(model: GPT, cache, batch: int, filled: int, loops: bool):
    """Every layer's attention of that step alone, at its shapes and masks."""
    cfg = model.config
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_attn // cfg.n_heads
    S = filled + 1
    q = torch.randn(batch * Hkv, H // Hkv, D)
    visible = cache.key_mask[:, :S]
    bias = torch.zeros(batch, S).masked_fill_(~visible, float("-inf")).repeat_interleave(Hkv, 0)[:, None]
    layers = [
        (k[:, :, :S].reshape(batch * Hkv, S, D), v[:, :, :S].reshape(batch * Hkv, S, D))
        for k, v in zip(cache.k, cache.v)
    ]

    def run():
        for keys, values in layers:
            attention = cpu_attention.attend if loops else step_attention_products
            attention(q, keys, values, bias, D**-0.5)

    return run


def measure(model: GPT, batches: list[int], filled: int, steps: int, repeats: int) -> list[dict]:
    model.prepare_for_decoding()
    rows = []
    for batch in batches:
        step, cache = step_runner(model, batch, filled)
        runners = {
            "step_loops": switched(step, True),
            "step_products": switched(step, False),
            "attention_loops": switched(attention_runner(model, cache, batch, filled, True), True),
            "attention_products": attention_runner(model, cache, batch, filled, False),
        }
        for run in runners.values():  # warm caches and allocators
            for _ in range(3):
                run()
        us = time_alternately(runners, steps, repeats)
        row = {"batch": batch, "filled": filled, **{f"{k}_us": round(v, 1) for k, v in us.items()}}
        row["step_speedup"] = round(us["step_products"] / us["step_loops"], 3)
        row["attention_speedup"] = round(us["attention_products"] / us["attention_loops"], 3)
        rows.append(row)
    return rows


def step_arguments(doc: str, batches: str, filled: int, steps: int, repeats: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark timing the decoding step two ways (this one's and
    ``bench_blocked_products.py``'s); ``--quick``: batches 1 and 16, 20-30 calls, 3 repeats."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs" / "demo"), help="run directory or checkpoint")
    p.add_argument("--batches", default=batches, help="batch sizes, comma-separated")
    p.add_argument("--filled", type=int, default=filled, help="cache slots filled before the step")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--steps", type=int, default=steps, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=repeats, help="alternating runs per batch size (median reported)")
    p.add_argument("--quick", action="store_true", help="batches 1 and 16, a few calls, 3 repeats (seconds)")
    p.add_argument("--json", help="write the rows here")
    return p


def step_model(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[GPT, str]:
    """The checkpoint's model, or one of the demo's shape with random weights where there is none
    (the time does not depend on the weights), and what it is; ``--filled`` checked against it."""
    if Path(a.checkpoint).exists():
        model, source = load_any_checkpoint(a.checkpoint)[0].eval(), a.checkpoint
    else:
        torch.manual_seed(0)
        model, source = GPT(ModelConfig(**DEMO_SHAPE)).eval(), "random weights, the demo's shape (no checkpoint)"
    if not 0 < a.filled < model.config.context_length:
        p.error(f"--filled {a.filled}: between 1 and the context ({model.config.context_length}) minus one")
    return model, source


PAIRS = [
    ("step", "loops", "C loops", "products", "batched products"),
    ("attention", "loops", "C loops", "products", "batched products"),
]


def print_pairs(rows: list[dict], pairs: list[tuple[str, str, str, str, str]]) -> None:
    """The rows as a markdown table: the batch, the filled slots, then for each (prefix, a, a's
    label, b, b's label) of ``pairs`` the columns ``{prefix}_{a}_us``, ``{prefix}_{b}_us`` and
    ``{prefix}_speedup`` (b's time over a's)."""
    print(
        "| batch | filled slots |" + "".join(f" {p}: {la} us | {p}: {lb} us | speedup |" for p, _, la, _, lb in pairs)
    )
    print("|---:|---:|" + "---:|---:|---:|" * len(pairs))
    for r in rows:
        cells = "".join(
            f" {r[f'{p}_{a}_us']:,.0f} | {r[f'{p}_{b}_us']:,.0f} | {r[f'{p}_speedup']:.2f}x |"
            for p, a, _, b, _ in pairs
        )
        print(f"| {r['batch']} | {r['filled']} |{cells}")


def run_step_benchmark(argv, doc: str, measure, pairs, unavailable, **defaults) -> int:
    """The main of a benchmark timing the decoding step two ways (this one, ``bench_blocked_products.py``,
    ``bench_attention_asks.py``): its arguments (``step_arguments`` with ``defaults``: batches, filled,
    steps, repeats, and quick_steps for ``--quick``), the model (``step_model``), ``unavailable(model)``
    (why there is nothing to compare here, or None), ``measure(model, batches, filled, steps,
    repeats)``'s rows, their table (``print_pairs``) and ``--json``; 2 when nothing is compared."""
    quick_steps = defaults.pop("quick_steps")
    p = step_arguments(doc, **defaults)
    a = p.parse_args(argv)
    if a.quick:
        a.batches, a.steps, a.repeats = "1,16", quick_steps, 3
    torch.set_num_threads(a.threads)
    model, source = step_model(p, a)
    reason = unavailable(model)
    if reason:
        print(f"{reason}: nothing to compare")
        return 2
    with torch.inference_mode():
        rows = measure(model, [int(b) for b in a.batches.split(",")], a.filled, a.steps, a.repeats)
    print(f"model: {source}; {platform.processor() or platform.machine()}, {a.threads} thread(s)")
    print_pairs(rows, pairs)
    if a.json:
        setup = {"checkpoint": source, "threads": a.threads, "steps": a.steps, "repeats": a.repeats}
        Path(a.json).write_text(json.dumps({"rows": rows, "setup": setup}, indent=1))
    return 0


def no_c_loops(_model: GPT) -> str | None:
    return None if cpu_attention.library() is not None else "the C loops did not build on this machine (no C compiler?)"


def main(argv=None) -> int:
    return run_step_benchmark(
        argv, __doc__, measure, PAIRS, no_c_loops, batches="1,4,16,32", filled=96, steps=200, repeats=7, quick_steps=30
    )


if __name__ == "__main__":
    sys.exit(main())
