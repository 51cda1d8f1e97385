"""The decoding step alone: eager against compiled, beside the floor that compiling cannot move.

One call of ``tinylm.generation.decode.decode_step`` (the step `tinylm generate` and `tinylm serve`
run) on a checkpoint, for each batch size, with a cache of ``--slots`` slots (default: the model's
context, the one slot bucket `tinylm serve --compile` uses for contexts up to 256) filled to the
middle. Three things are timed alternately (A B C A B C ...) and their medians reported:

    eager       the step as `tinylm generate` runs it
    compiled    the same step under torch.compile (`--compile`); compiled once per batch first
    products    the step's matrix products alone (every layer's qkv, out, ffn_in, ffn_down and
                the head), with the step's own weights and shapes, through the same BLAS both
                modes call
    attention   the step's attention alone (scores, softmax, weighted values over every slot of
                every layer's cache, eagerly): reading the cache, which is memory-bound

Compiling removes per-op Python and dispatch, and fuses the elementwise work between these.
The products and the cache reads stay: ``bound = eager / (products + attention)`` is the most a
compiled step could gain if everything else became free; ``compiled vs eager`` is what it gains.

    python benchmarks/bench_decode_step.py [--quick] [--checkpoint runs/demo] [--batches 1,4,16,32]
                                           [--threads 1] [--json out.json]

``--json PATH`` writes {"rows": [{"batch", "slots", "eager_us", "compiled_us", "products_us",
"attention_us", "compiled_vs_eager", "floor_share", "bound", "compile_s"}], "setup": {...}}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tinylm.generation.decode import decode_step  # noqa: E402
from tinylm.interop.loading import load_any_checkpoint  # noqa: E402
from tinylm.models.gpt import GPT  # noqa: E402


def step_runner(model: GPT, batch: int, slots: int, compile: bool):
    """One decoding step of ``batch`` rows at the middle of a ``slots``-slot cache, repeatable."""
    cache = model.new_kv_cache(batch, slots)
    cache.key_mask = torch.ones(batch, slots, dtype=torch.bool)  # the server's bucketed cache has one
    tokens = torch.randint(0, model.config.vocab_size, (batch,))
    positions = torch.full((batch,), slots // 2, dtype=torch.long)

    def run():
        cache.length = slots // 2
        decode_step(model, cache, tokens, positions, compile)

    return run


def products_runner(model: GPT, batch: int):
    """The step's matrix products alone (every projection and the head, in their decoding layout),
    on inputs of the step's shapes, through the layers' own forward."""
    layers = [
        m
        for block in model.blocks
        for m in (block.attn.qkv, block.attn.out_proj, *block.ffn.children())
        if hasattr(m, "in_features")
    ] + [model.lm_head]
    inputs = [torch.randn(batch, layer.in_features) for layer in layers]

    def run():
        for x, layer in zip(inputs, layers):
            layer(x)  # a (rows, in) input: the decoding layout's product

    return run


def attention_runner(model: GPT, batch: int, slots: int):
    """The step's attention ops alone, at its shapes: one query per head against every cached slot."""
    cfg = model.config
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_attn // cfg.n_heads
    caches = [(torch.randn(batch * Hkv, slots, D), torch.randn(batch * Hkv, slots, D)) for _ in model.blocks]
    q, bias = torch.randn(batch * Hkv, H // Hkv, D), torch.zeros(batch * Hkv, 1, slots)

    def run():
        for k, v in caches:
            torch.bmm(torch.softmax(torch.baddbmm(bias, q, k.transpose(1, 2)), dim=-1), v)

    return run


def time_alternately(runners: dict, steps: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each runner, the runners taking turns ``repeats`` times."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            times[name].append((time.perf_counter() - t0) / steps * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(model, batches: list[int], slots: int, steps: int, repeats: int) -> list[dict]:
    model.prepare_for_decoding()
    rows = []
    for batch in batches:
        runners = {
            "eager": step_runner(model, batch, slots, False),
            "compiled": step_runner(model, batch, slots, True),
            "products": products_runner(model, batch),
            "attention": attention_runner(model, batch, slots),
        }
        t0 = time.perf_counter()
        runners["compiled"]()  # compiles this batch size
        compile_s = time.perf_counter() - t0
        for run in runners.values():  # warm caches and allocators
            for _ in range(3):
                run()
        us = time_alternately(runners, steps, repeats)
        floor = us["products"] + us["attention"]
        rows.append(
            {
                "batch": batch,
                "slots": slots,
                "eager_us": round(us["eager"], 1),
                "compiled_us": round(us["compiled"], 1),
                "products_us": round(us["products"], 1),
                "attention_us": round(us["attention"], 1),
                "compiled_vs_eager": round(us["eager"] / us["compiled"], 3),
                "floor_share": round(floor / us["eager"], 3),
                "bound": round(us["eager"] / floor, 3),
                "compile_s": round(compile_s, 1),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "| batch | slots | eager us | compiled us | compiled vs eager | products us | attention us "
        "| (products + attention) / eager | bound |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['slots']} | {r['eager_us']:,.0f} | {r['compiled_us']:,.0f} | "
            f"{r['compiled_vs_eager']:.2f}x | {r['products_us']:,.0f} | {r['attention_us']:,.0f} | "
            f"{r['floor_share']:.2f} | {r['bound']:.2f}x |"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs" / "demo"), help="run directory or checkpoint")
    p.add_argument("--batches", default="1,4,16,32", help="batch sizes, comma-separated")
    p.add_argument("--slots", type=int, help="cache slots (default: the model's context)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--steps", type=int, default=200, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=5, help="alternating runs per batch size (median reported)")
    p.add_argument("--quick", action="store_true", help="batches 1 and 16, 30 calls, 3 repeats (under 60 s)")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    if not Path(a.checkpoint).exists():
        raise SystemExit(f"no checkpoint at {a.checkpoint}: run `make demo` first, or give --checkpoint")
    torch.set_num_threads(a.threads)
    batches = [1, 16] if a.quick else [int(b) for b in a.batches.split(",")]
    steps, repeats = (30, 3) if a.quick else (a.steps, a.repeats)
    model, _, _ = load_any_checkpoint(a.checkpoint)
    model.eval()
    slots = a.slots or model.config.context_length
    with torch.inference_mode():
        rows = measure(model, batches, slots, steps, repeats)
    setup = {
        "checkpoint": Path(a.checkpoint).name,
        "parameters": model.num_parameters(),
        "threads": a.threads,
        "steps": steps,
        "repeats": repeats,
        "torch": torch.__version__,
        "cpu": platform.processor(),
    }
    print(
        f"decoding step of {setup['checkpoint']} ({setup['parameters']:,} parameters), {a.threads} torch "
        f"thread(s), median of {repeats} alternating runs of {steps} calls"
    )
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "setup": setup}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
