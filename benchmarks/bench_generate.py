"""Generation speed: tinylm vs Hugging Face transformers on the same weights, in the same run.

The reference is a randomly initialised ``GPT2LMHeadModel`` (4 layers, d_model 256, 8 heads,
vocab 4096, context 512: the 4.3M-parameter model of the project's anchors) and tinylm runs the
same weights through ``tinylm.interop.gpt2.from_hf_gpt2``. Each (mode, batch) cell runs the two
systems alternately (A B A B ...), reports the median tokens/s and the ratio, and checks that
tinylm produced exactly the reference's tokens.

    modes   greedy_cache, greedy_nocache, sample_cache (top-k 50, T 0.8, same seed), beam5, beam10
    rows    batch 1 and 16, 256 new tokens after a 16-token prompt (no stop token: full length)

Then a KV-cache speed-up table (tinylm greedy, batch 1, with / without cache at total lengths
64, 256, 512), and stories260K: tinylm greedy on the llama2.c checkpoint (read from
../shared/anchors/llama2c relative to the repository, or --llama2c-dir), beside llama2.c's
``run`` binary when ``--llama2c PATH_TO_RUN`` is given (same checkpoint, same step count;
identical text required).

    python benchmarks/bench_generate.py [--quick] [--threads 1] [--json out.json] [--llama2c ./run]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tinylm.generation import GenerationConfig, generate_many  # noqa: E402
from tinylm.interop.gpt2 import from_hf_gpt2  # noqa: E402

SHARED_LLAMA2C = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "llama2c"
MODES = {
    "greedy_cache": dict(temperature=0, use_cache=True),
    "greedy_nocache": dict(temperature=0, use_cache=False),
    "sample_cache": dict(temperature=0.8, top_k=50, use_cache=True),
    "beam5": dict(temperature=0, beam_width=5, use_cache=True),
    "beam10": dict(temperature=0, beam_width=10, use_cache=True),
}
SEED = 1234


def build_models(vocab: int, ctx: int, d_model: int, layers: int, heads: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=d_model, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(cfg).eval()
    hf.generation_config.eos_token_id = None  # never stop early: every row makes exactly new_tokens
    hf.generation_config.pad_token_id = 0
    return hf, from_hf_gpt2(hf)


def run_tinylm(model, prompts, mode, new_tokens):
    cfg = GenerationConfig(max_new_tokens=new_tokens, seed=SEED, **MODES[mode])
    t0 = time.perf_counter()
    out = generate_many(model, prompts, cfg)
    return time.perf_counter() - t0, [r.tokens for r in out]


def run_hf(hf, prompts, mode, new_tokens):
    m = MODES[mode]
    x = torch.tensor(prompts)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              use_cache=m["use_cache"], num_beams=m.get("beam_width", 1), eos_token_id=None, pad_token_id=0)
    if m["temperature"] > 0:
        kw.update(do_sample=True, temperature=m["temperature"], top_k=m["top_k"])
        torch.manual_seed(SEED)  # HF samples from the global generator; tinylm from one seeded alike
    else:
        kw.update(do_sample=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, **kw)
    return time.perf_counter() - t0, [row[x.shape[1]:].tolist() for row in out]


def generation_table(hf, model, args) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(7)
    for batch in args.batches:
        prompts = torch.randint(4, hf.config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        for mode in args.modes:
            run_tinylm(model, prompts, mode, 4)  # warm-up (allocator, first-call paths)
            run_hf(hf, prompts, mode, 4)
            repeats = 1 if (mode == "greedy_nocache" and batch > 1) else args.repeats
            times = {"tinylm": [], "hf_transformers": []}
            outputs = {}
            for _ in range(repeats):  # alternate: A B A B
                dt, outputs["tinylm"] = run_tinylm(model, prompts, mode, args.new_tokens)
                times["tinylm"].append(dt)
                dt, outputs["hf_transformers"] = run_hf(hf, prompts, mode, args.new_tokens)
                times["hf_transformers"].append(dt)
            same = outputs["tinylm"] == outputs["hf_transformers"]
            for system in ("tinylm", "hf_transformers"):
                produced = sum(len(t) for t in outputs[system])
                rows.append({"table": "generate", "system": system, "mode": mode, "batch": batch,
                             "new_tokens": args.new_tokens, "tokens_per_s": round(produced / statistics.median(times[system]), 1),
                             "same_tokens_as_reference": same if system == "tinylm" else None, "repeats": repeats})
            print(f"  {mode:15s} batch {batch:3d}: tinylm {rows[-2]['tokens_per_s']:9.1f} tok/s, "
                  f"HF {rows[-1]['tokens_per_s']:9.1f} tok/s, same tokens: {same}", flush=True)
    return rows


def cache_speedup_table(model, args) -> list[dict]:
    rows = []
    prompt = torch.randint(4, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(3)).tolist()
    for total in args.totals:
        new = total - args.prompt_len
        speeds = {}
        for mode in ("greedy_cache", "greedy_nocache"):
            reps = args.repeats if mode == "greedy_cache" else 1
            speeds[mode] = new / statistics.median(run_tinylm(model, prompt, mode, new)[0] for _ in range(reps))
        row = {"table": "kv_cache_speedup", "system": "tinylm", "total_length": total, "new_tokens": new,
               "cache_tokens_per_s": round(speeds["greedy_cache"], 1),
               "nocache_tokens_per_s": round(speeds["greedy_nocache"], 1),
               "speedup": round(speeds["greedy_cache"] / speeds["greedy_nocache"], 2)}
        rows.append(row)
        print(f"  total {total:4d}: cache {row['cache_tokens_per_s']:8.1f} tok/s, no cache "
              f"{row['nocache_tokens_per_s']:8.1f} tok/s, speed-up {row['speedup']:.2f}x", flush=True)
    return rows


def llama2c_rows(args) -> list[dict]:
    from tinylm.interop import load_any_checkpoint

    ckpt, tok_path = args.llama2c_dir / "stories260K.bin", args.llama2c_dir / "tok512.bin"
    if not ckpt.is_file() or not tok_path.is_file():
        print(f"  (skipped: {ckpt} or {tok_path} not found; pass --llama2c-dir)")
        return []
    model, tok, _ = load_any_checkpoint(ckpt, tok_path)
    prompt = "Once upon a time"
    ids = [1] + tok.encode(prompt)
    steps = 256  # run.c's -n counts every position, prompt included
    new = steps - len(ids)
    cfg = GenerationConfig(max_new_tokens=new, temperature=0, stop_ids=tuple(tok.stop_ids))
    generate_many(model, [ids], GenerationConfig(max_new_tokens=8, temperature=0))  # warm-up
    times, text = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = generate_many(model, [ids], cfg)[0]
        times.append(time.perf_counter() - t0)
        text = tok.decode(ids + res.tokens)
    ours = len(res.tokens) / statistics.median(times)
    rows = [{"table": "llama2c", "system": "tinylm", "mode": "greedy_cache", "batch": 1, "new_tokens": len(res.tokens),
             "tokens_per_s": round(ours, 1), "same_tokens_as_reference": None}]
    expected_start = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    print(f"  tinylm on stories260K: {ours:.1f} tok/s; text starts as llama2.c's README says: "
          f"{text.startswith(expected_start)}")
    if args.llama2c:
        speeds, ref_text = [], None
        for _ in range(args.repeats):
            proc = subprocess.run([str(args.llama2c), str(ckpt), "-z", str(tok_path), "-t", "0", "-n", str(steps),
                                   "-i", prompt], capture_output=True, text=True, check=True)
            ref_text = proc.stdout.rstrip("\n")
            m = re.search(r"achieved tok/s:\s*([0-9.]+)", proc.stderr)
            if m:
                speeds.append(float(m.group(1)))
        run_c = statistics.median(speeds) if speeds else float("nan")
        same = ref_text == text
        rows[0]["same_tokens_as_reference"] = same
        rows.append({"table": "llama2c", "system": "llama2c_run", "mode": "greedy_cache", "batch": 1,
                     "new_tokens": len(res.tokens), "tokens_per_s": round(run_c, 1), "same_tokens_as_reference": None})
        print(f"  llama2.c run: {run_c:.1f} tok/s; tinylm / run.c = {ours / run_c:.2f}x; identical text: {same}")
    else:
        print("  (no --llama2c binary given: run.c not timed)")
    return rows


def print_table(rows: list[dict]) -> None:
    gen = [r for r in rows if r["table"] == "generate"]
    if gen:
        print("\n| mode | batch | new tokens | tinylm tok/s | HF tok/s | tinylm / HF | same tokens |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for t, h in zip(gen[0::2], gen[1::2]):
            print(f"| {t['mode']} | {t['batch']} | {t['new_tokens']} | {t['tokens_per_s']:.1f} | {h['tokens_per_s']:.1f} | "
                  f"{t['tokens_per_s'] / h['tokens_per_s']:.2f}x | {t['same_tokens_as_reference']} |")
    kv = [r for r in rows if r["table"] == "kv_cache_speedup"]
    if kv:
        print("\n| total length | cache tok/s | no cache tok/s | speed-up |")
        print("|---:|---:|---:|---:|")
        for r in kv:
            print(f"| {r['total_length']} | {r['cache_tokens_per_s']:.1f} | {r['nocache_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    ll = [r for r in rows if r["table"] == "llama2c"]
    if ll:
        print("\n| system (stories260K) | new tokens | tok/s | same text |")
        print("|---|---:|---:|---|")
        for r in ll:
            print(f"| {r['system']} | {r['new_tokens']} | {r['tokens_per_s']:.1f} | {r['same_tokens_as_reference']} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small version (under 60 s): 32 new tokens, batch 1 and 4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="write all rows as a JSON list")
    p.add_argument("--repeats", type=int, default=None, help="alternating runs per cell (median reported)")
    p.add_argument("--llama2c", type=Path, help="a compiled llama2.c `run` binary to time beside tinylm")
    p.add_argument("--llama2c-dir", type=Path, default=SHARED_LLAMA2C, help="folder with stories260K.bin and tok512.bin")
    p.add_argument("--skip-llama2c", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.prompt_len = 16
    if args.quick:
        args.new_tokens, args.batches, args.totals = 32, [1, 4], [64, 128]
        args.modes = list(MODES)
        args.repeats = args.repeats or 1
        dims = dict(vocab=1024, ctx=256, d_model=128, layers=2, heads=4)
    else:
        args.new_tokens, args.batches, args.totals = 256, [1, 16], [64, 256, 512]
        args.modes = list(MODES)
        args.repeats = args.repeats or 3
        dims = dict(vocab=4096, ctx=512, d_model=256, layers=4, heads=8)
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
          f"model {dims}, repeats {args.repeats}", flush=True)
    t0 = time.perf_counter()
    hf, model = build_models(**dims)
    print(f"parameters: {model.num_parameters():,}")
    rows = generation_table(hf, model, args)
    print("KV-cache speed-up (tinylm, greedy, batch 1):")
    rows += cache_speedup_table(model, args)
    if not args.skip_llama2c:
        print("stories260K (llama2.c checkpoint):")
        rows += llama2c_rows(args)
    print_table(rows)
    print(f"\nbenchmark took {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
