"""Generation speed: tinylm vs Hugging Face transformers on the same weights, in the same run.

The reference is a randomly initialised ``GPT2LMHeadModel`` (4 layers, d_model 256, 8 heads,
vocab 4096, context 512: the 4.3M-parameter model of the project's anchors) and tinylm runs the
same weights through ``tinylm.interop.gpt2.from_hf_gpt2``. Each (mode, batch) cell runs the
systems alternately (A B A B ...), reports the median tokens/s and the ratios, and checks that
tinylm produced exactly the reference's tokens.

    modes    greedy_cache, greedy_nocache, sample_cache (top-k 50, T 0.8, same seed), beam5, beam10
    rows     batch 1 and 16, 256 new tokens after a 16-token prompt (no stop token: full length)
    systems  tinylm (eager), hf_transformers (eager); with --compiled (the default without --quick)
             also tinylm_compiled (its decoding step under torch.compile) for greedy, sampling and
             beam 5, and hf_static_compiled (HF's static cache with its forward under torch.compile,
             the help HF gives itself) for greedy. Compiled systems are warmed up with one full-length
             run first, whose time is reported as compile_s.

Then a KV-cache speed-up table (tinylm greedy, batch 1, with / without cache at total lengths
64, 256, 512), and stories260K: tinylm greedy on the llama2.c checkpoint (read from
../shared/anchors/llama2c relative to the repository, or --llama2c-dir), beside llama2.c's
``run`` binary when ``--llama2c PATH_TO_RUN`` is given (same checkpoint, same step count;
identical text required); then stories260K's bits per byte on valid.txt in float32 and in
bfloat16 (``tinylm generate --dtype bfloat16``) with its greedy speed in each. Last, int8 weights
(``--dtype int8``: W8A8 with per-token activation scales, and weight-only int8;
``tinylm.models.quantize``; CPU only, ``--skip-int8`` leaves them out): the bench model's greedy
tokens/s in float32 and each int8 kind at each batch size, run alternately, eager and with
--compiled compiled; and bits per byte on valid.txt in float32 and int8 for trained models
(stories260K, and ``--int8-checkpoint RUN`` such as ../runs/tinystories-cpu-25m), with their greedy
speed at batch 1.

    python benchmarks/bench_generate.py [--quick] [--compiled] [--threads 1] [--json out.json] [--llama2c ./run]
                                        [--int8-checkpoint ../runs/tinystories-cpu-25m] [--skip-int8]
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinylm.generation import GenerationConfig, generate_many
from tinylm.interop.gpt2 import from_hf_gpt2
from tinylm.models.quantize import quantize_gpt

SHARED_LLAMA2C = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "llama2c"
SHARED_VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories" / "valid.txt"
MODES = {
    "greedy_cache": dict(temperature=0, use_cache=True),
    "greedy_nocache": dict(temperature=0, use_cache=False),
    "sample_cache": dict(temperature=0.8, top_k=50, use_cache=True),
    "beam5": dict(temperature=0, beam_width=5, use_cache=True),
    "beam10": dict(temperature=0, beam_width=10, use_cache=True),
}
SEED = 1234
COMPILED_MODES = ("greedy_cache", "sample_cache", "beam5")
HF_COMPILED_MODES = ("greedy_cache",)


def build_models(vocab: int, ctx: int, d_model: int, layers: int, heads: int, device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=ctx,
        n_embd=d_model,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    hf.generation_config.eos_token_id = None  # never stop early: every row makes exactly new_tokens
    hf.generation_config.pad_token_id = 0
    return hf.to(device), from_hf_gpt2(hf).to(device)


def run_tinylm(model, prompts, mode, new_tokens, compile=False):
    cfg = GenerationConfig(max_new_tokens=new_tokens, seed=SEED, compile=compile, **MODES[mode])
    t0 = time.perf_counter()
    out = generate_many(model, prompts, cfg)
    return time.perf_counter() - t0, [r.tokens for r in out]


def run_hf(hf, prompts, mode, new_tokens, compile=False):
    m = MODES[mode]
    x = torch.tensor(prompts, device=hf.device)
    kw = dict(
        attention_mask=torch.ones_like(x),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        use_cache=m["use_cache"],
        num_beams=m.get("beam_width", 1),
        eos_token_id=None,
        pad_token_id=0,
    )
    if compile:  # HF compiles its forward itself for a static cache; on CPU it has to be told to
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, mode="default")
        config._compile_all_devices = True
        kw.update(cache_implementation="static", compile_config=config)
    if m["temperature"] > 0:
        kw.update(do_sample=True, temperature=m["temperature"], top_k=m["top_k"])
        torch.manual_seed(SEED)  # HF samples from the global generator; tinylm from one seeded alike
    else:
        kw.update(do_sample=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, **kw)
    out = out.cpu()  # waits for the device
    return time.perf_counter() - t0, [row[x.shape[1] :].tolist() for row in out]


def systems_for(mode: str, args) -> dict:
    """system name -> function(prompts, new_tokens) -> (seconds, tokens per row)."""
    out = {
        "tinylm": lambda m, p, n: run_tinylm(m, p, mode, n),
        "hf_transformers": lambda h, p, n: run_hf(h, p, mode, n),
    }
    if args.compiled and mode in COMPILED_MODES:
        out["tinylm_compiled"] = lambda m, p, n: run_tinylm(m, p, mode, n, compile=True)
    if args.compiled and mode in HF_COMPILED_MODES:
        out["hf_static_compiled"] = lambda h, p, n: run_hf(h, p, mode, n, compile=True)
    return out


def generation_table(hf, model, args) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(7)
    for batch in args.batches:
        prompts = torch.randint(4, hf.config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        for mode in args.modes:
            systems = systems_for(mode, args)
            target = lambda name: hf if name.startswith("hf") else model  # noqa: E731
            compile_s = {}
            for name, run in systems.items():  # warm-up; compiled systems compile here, at full length
                t0 = time.perf_counter()
                run(target(name), prompts, args.new_tokens if "compiled" in name else 4)
                compile_s[name] = round(time.perf_counter() - t0, 1) if "compiled" in name else None
            repeats = 1 if (mode == "greedy_nocache" and batch > 1) else args.repeats
            times = {name: [] for name in systems}
            outputs = {}
            for _ in range(repeats):  # alternate: A B C A B C
                for name, run in systems.items():
                    dt, outputs[name] = run(target(name), prompts, args.new_tokens)
                    times[name].append(dt)
            reference = outputs["hf_transformers"]
            for name in systems:
                produced = sum(len(t) for t in outputs[name])
                rows.append(
                    {
                        "table": "generate",
                        "system": name,
                        "mode": mode,
                        "batch": batch,
                        "new_tokens": args.new_tokens,
                        "tokens_per_s": round(produced / statistics.median(times[name]), 1),
                        "same_tokens_as_reference": outputs[name] == reference if name != "hf_transformers" else None,
                        "repeats": repeats,
                        "compile_s": compile_s[name],
                    }
                )
            cell = rows[-len(systems) :]
            print(
                f"  {mode:15s} batch {batch:3d}: "
                + ", ".join(
                    f"{r['system']} {r['tokens_per_s']:.1f} tok/s"
                    + ("" if r["same_tokens_as_reference"] in (None, True) else " (DIFFERENT TOKENS)")
                    for r in cell
                ),
                flush=True,
            )
    return rows


def cache_speedup_table(model, args) -> list[dict]:
    rows = []
    prompt = torch.randint(
        4, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(3)
    ).tolist()
    for total in args.totals:
        new = total - args.prompt_len
        speeds = {}
        for mode in ("greedy_cache", "greedy_nocache"):
            reps = args.repeats if mode == "greedy_cache" else 1
            speeds[mode] = new / statistics.median(run_tinylm(model, prompt, mode, new)[0] for _ in range(reps))
        row = {
            "table": "kv_cache_speedup",
            "system": "tinylm",
            "total_length": total,
            "new_tokens": new,
            "cache_tokens_per_s": round(speeds["greedy_cache"], 1),
            "nocache_tokens_per_s": round(speeds["greedy_nocache"], 1),
            "speedup": round(speeds["greedy_cache"] / speeds["greedy_nocache"], 2),
        }
        rows.append(row)
        print(
            f"  total {total:4d}: cache {row['cache_tokens_per_s']:8.1f} tok/s, no cache "
            f"{row['nocache_tokens_per_s']:8.1f} tok/s, speed-up {row['speedup']:.2f}x",
            flush=True,
        )
    return rows


def time_greedy(model, ids, new, stop_ids, repeats, compile=False) -> tuple[float, list[int]]:
    """Median tokens/s of greedy decoding after one untimed run (which compiles, when asked)."""
    cfg = GenerationConfig(max_new_tokens=new, temperature=0, stop_ids=tuple(stop_ids), compile=compile)
    generate_many(model, [ids], cfg)
    times, tokens = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = generate_many(model, [ids], cfg)[0].tokens
        times.append(time.perf_counter() - t0)
    return len(tokens) / statistics.median(times), tokens


def llama_cpp_greedy(gguf: Path, ids: list[int], new: int, stop_ids, threads: int, repeats: int):
    """llama.cpp's greedy tokens/s (llama-cpp-python, ``threads`` threads, float32 cache, the
    prompt's evaluation included as in tinylm's timing) after one untimed run, and its tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False, type_k=0, type_v=0
    )
    times, tokens = [], []
    for k in range(repeats + 1):
        t0, tokens = time.perf_counter(), []
        for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if token in stop_ids or len(tokens) == new:
                break
            tokens.append(token)
        if k:  # the first run is a warm-up
            times.append(time.perf_counter() - t0)
    llm.close()
    return len(tokens) / statistics.median(times), tokens


def llama_cpp_rows(model, tok, ids: list[int], new: int, tinylm_text: str, args) -> list[dict]:
    """stories260K written by `tinylm export-gguf` and decoded greedily by llama.cpp, beside tinylm."""
    try:
        import llama_cpp  # noqa: F401  (a dev extra, compiled from its sdist)
    except ImportError:
        print("  (llama-cpp-python not installed: llama.cpp not timed)")
        return []
    from tinylm.interop.gguf_export import export_gguf

    with tempfile.TemporaryDirectory() as tmp:
        gguf = export_gguf(model, Path(tmp) / "stories260K.gguf", tok)
        speed, tokens = llama_cpp_greedy(gguf, ids, new, set(tok.stop_ids), args.threads, args.repeats)
    same = tok.decode(ids + tokens) == tinylm_text
    print(f"  llama.cpp (llama-cpp-python) on stories260K: {speed:.1f} tok/s; the same text as tinylm: {same}")
    row = {"table": "llama2c", "system": "llama_cpp", "mode": "greedy_cache", "batch": 1}
    return [{**row, "new_tokens": len(tokens), "tokens_per_s": round(speed, 1), "same_tokens_as_tinylm": same}]


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
    new = steps - len(ids) + 1  # run.c picks a token at each of its steps positions; those after the prompt are new
    variants = {"tinylm": False, "tinylm_compiled": True} if args.compiled else {"tinylm": False}
    rows, texts = [], {}
    for system, compile in variants.items():
        speed, tokens = time_greedy(model, ids, new, tok.stop_ids, args.repeats, compile)
        texts[system] = tok.decode(ids + tokens)
        rows.append(
            {
                "table": "llama2c",
                "system": system,
                "mode": "greedy_cache",
                "batch": 1,
                "new_tokens": len(tokens),
                "tokens_per_s": round(speed, 1),
                "same_tokens_as_reference": None,
            }
        )
        print(f"  {system} on stories260K: {speed:.1f} tok/s")
    expected_start = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    print(f"  the text starts as llama2.c's README says: {texts['tinylm'].startswith(expected_start)}")
    if args.llama2c:
        speeds, ref_text = [], None
        for _ in range(args.repeats):
            proc = subprocess.run(
                [str(args.llama2c), str(ckpt), "-z", str(tok_path), "-t", "0", "-n", str(steps), "-i", prompt],
                capture_output=True,
                text=True,
                check=True,
            )
            ref_text = proc.stdout.rstrip("\n")
            m = re.search(r"achieved tok/s:\s*([0-9.]+)", proc.stderr)
            if m:
                speeds.append(float(m.group(1)))
        run_c = statistics.median(speeds) if speeds else float("nan")
        for r in rows:
            r["same_tokens_as_reference"] = texts[r["system"]] == ref_text
            r["vs_llama2c_run"] = round(r["tokens_per_s"] / run_c, 3)
            print(
                f"  {r['system']} / run.c = {r['vs_llama2c_run']:.2f}x; identical text: {r['same_tokens_as_reference']}"
            )
        rows.append(
            {
                "table": "llama2c",
                "system": "llama2c_run",
                "mode": "greedy_cache",
                "batch": 1,
                "new_tokens": rows[0]["new_tokens"],
                "tokens_per_s": round(run_c, 1),
                "same_tokens_as_reference": None,
            }
        )
        print(f"  llama2.c run: {run_c:.1f} tok/s")
    else:
        print("  (no --llama2c binary given: run.c not timed)")
    return rows + llama_cpp_rows(model, tok, ids, new, texts["tinylm"], args)


def bfloat16_rows(args) -> list[dict]:
    """stories260K in float32 and in bfloat16: bits per byte on valid.txt and greedy tokens/s."""
    from tinylm.data.corpora import load_text_file
    from tinylm.evaluation.perplexity import evaluate_texts
    from tinylm.interop import load_any_checkpoint

    ckpt, tok_path = args.llama2c_dir / "stories260K.bin", args.llama2c_dir / "tok512.bin"
    if not (ckpt.is_file() and tok_path.is_file() and args.valid.is_file()):
        print(f"  (skipped: needs {ckpt}, {tok_path} and {args.valid})")
        return []
    texts = [d for d in load_text_file(args.valid) if d][: args.bf16_stories]
    model, tok, _ = load_any_checkpoint(ckpt, tok_path)
    ids = [1] + tok.encode("Once upon a time")
    rows, first_tokens = [], None
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        t0 = time.perf_counter()
        scores = evaluate_texts(m, tok, texts, batch_size=32)
        eval_s = time.perf_counter() - t0
        speed, tokens = time_greedy(m, ids, 200, tok.stop_ids, args.repeats)
        first_tokens = first_tokens or tokens
        rows.append(
            {
                "table": "bfloat16",
                "system": "tinylm",
                "dtype": str(dtype).replace("torch.", ""),
                "stories": len(texts),
                "bpb": round(scores["bpb"], 5),
                "bpb_change": round(scores["bpb"], 5),
                "tokens_per_s": round(speed, 1),
                "eval_seconds": round(eval_s, 1),
                "same_tokens_as_float32": tokens == first_tokens,
            }
        )
    for r in rows:
        r["bpb_change"] = round(r["bpb"] - rows[0]["bpb"], 5)
    for r in rows:
        print(
            f"  {r['dtype']}: {r['bpb']:.5f} bpb on {r['stories']} stories (change {r['bpb_change']:+.5f}), "
            f"greedy {r['tokens_per_s']:.1f} tok/s"
        )
    return rows


INT8_KERNELS = {"int8": "rowwise", "int8_weight_only": "dequantize"}  # name in the tables -> quantize_gpt's kernel


def int8_speed_rows(model, args) -> list[dict]:
    """The bench model in float32 and with int8 weights: ``--dtype int8`` (W8A8, per-token scales)
    and weight-only int8; greedy tokens/s at each batch size, eager and (with --compiled) compiled,
    the three run alternately. The bench model is untrained (nearly flat logits), so its greedy
    tokens part from float32's early; int8's accuracy is the bits-per-byte table's."""
    systems = {
        "float32": model,
        **{name: quantize_gpt(copy.deepcopy(model), kernel) for name, kernel in INT8_KERNELS.items()},
    }
    g = torch.Generator().manual_seed(11)
    rows = []
    for batch in args.batches:
        prompts = torch.randint(4, model.config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        for compile in [False, True] if args.compiled else [False]:
            for m in systems.values():  # warm-up (compiles at full length)
                run_tinylm(m, prompts, "greedy_cache", args.new_tokens if compile else 4, compile)
            times, outputs = {name: [] for name in systems}, {}
            for _ in range(args.repeats):
                for name, m in systems.items():
                    dt, outputs[name] = run_tinylm(m, prompts, "greedy_cache", args.new_tokens, compile)
                    times[name].append(dt)
            speed = {name: batch * args.new_tokens / statistics.median(t) for name, t in times.items()}
            for name in INT8_KERNELS:
                pairs = [(a, b) for ra, rb in zip(outputs["float32"], outputs[name]) for a, b in zip(ra, rb)]
                rows.append(
                    {
                        "table": "int8_speed",
                        "system": "tinylm_compiled" if compile else "tinylm",
                        "weights": name,
                        "batch": batch,
                        "new_tokens": args.new_tokens,
                        "float32_tokens_per_s": round(speed["float32"], 1),
                        "tokens_per_s": round(speed[name], 1),
                        "speedup": round(speed[name] / speed["float32"], 3),  # int8 can run at 0.1x (no VNNI)
                        "same_greedy_tokens": round(sum(a == b for a, b in pairs) / len(pairs), 3),
                        "repeats": args.repeats,
                    }
                )
                r = rows[-1]
                print(
                    f"  {r['system']:15s} batch {batch:3d}: float32 {r['float32_tokens_per_s']:.1f} tok/s, {name} "
                    f"{r['tokens_per_s']:.1f} tok/s, {r['speedup']:.2f}x",
                    flush=True,
                )
    return rows


def int8_bpb_rows(args) -> list[dict]:
    """Bits per byte on valid.txt in float32 and with int8 weights, and greedy tokens/s at batch 1
    in each, for trained models: stories260K (unless --skip-llama2c) and ``--int8-checkpoint`` (the
    bench model is untrained)."""
    from tinylm.data.corpora import load_text_file
    from tinylm.evaluation.perplexity import evaluate_texts
    from tinylm.interop import load_any_checkpoint

    models = (
        []
        if args.skip_llama2c
        else [("stories260K", args.llama2c_dir / "stories260K.bin", args.llama2c_dir / "tok512.bin")]
    )
    if args.int8_checkpoint:
        models.append((args.int8_checkpoint.name, args.int8_checkpoint, None))
    if not models:
        print("  (skipped: --skip-llama2c and no --int8-checkpoint)")
        return []
    if not args.valid.is_file():
        print(f"  (skipped: {args.valid} not found)")
        return []
    texts = [d for d in load_text_file(args.valid) if d][: args.bf16_stories]
    rows = []
    for label, ckpt, tok_path in models:
        if not ckpt.exists() or (tok_path is not None and not tok_path.is_file()):
            print(f"  ({label} skipped: {ckpt} not found)")
            continue
        model, tok, _ = load_any_checkpoint(ckpt, tok_path)
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode("Once upon a time")
        fp_bpb = evaluate_texts(model, tok, texts, batch_size=32)["bpb"]
        fp_speed, fp_tokens = time_greedy(model, ids, 200, tok.stop_ids, args.repeats)
        for name, kernel in INT8_KERNELS.items():
            int8 = quantize_gpt(copy.deepcopy(model), kernel)
            bpb = evaluate_texts(int8, tok, texts, batch_size=32)["bpb"]
            speed, tokens = time_greedy(int8, ids, 200, tok.stop_ids, args.repeats)
            rows.append(
                {
                    "table": "int8_bpb",
                    "model": label,
                    "weights": name,
                    "parameters": model.num_parameters(),
                    "stories": len(texts),
                    "float32_bpb": round(fp_bpb, 5),
                    "bpb": round(bpb, 5),
                    "bpb_change": round(bpb - fp_bpb, 5),
                    "float32_tokens_per_s": round(fp_speed, 1),
                    "tokens_per_s": round(speed, 1),
                    "same_greedy_tokens": tokens == fp_tokens,
                }
            )
            r = rows[-1]
            print(
                f"  {label} {name}: {r['float32_bpb']:.5f} -> {r['bpb']:.5f} bpb ({r['bpb_change']:+.5f}) on "
                f"{len(texts)} stories; greedy {r['float32_tokens_per_s']:.1f} -> {r['tokens_per_s']:.1f} tok/s",
                flush=True,
            )
    return rows


def print_table(rows: list[dict]) -> None:
    gen = [r for r in rows if r["table"] == "generate"]
    if gen:
        names = [
            n
            for n in ("tinylm", "tinylm_compiled", "hf_transformers", "hf_static_compiled")
            if any(r["system"] == n for r in gen)
        ]
        print(
            "\n| mode | batch | "
            + " | ".join(f"{n} tok/s" for n in names)
            + " | tinylm / HF | best tinylm / HF | best tinylm / best HF | same tokens |"
        )
        print("|---|---:|" + "---:|" * (len(names) + 3) + "---|")
        cells = {}
        for r in gen:
            cells.setdefault((r["mode"], r["batch"]), {})[r["system"]] = r
        for (mode, batch), cell in cells.items():
            speed = {n: cell[n]["tokens_per_s"] for n in cell}
            best_ours = max(v for n, v in speed.items() if n.startswith("tinylm"))
            best_hf = max(v for n, v in speed.items() if n.startswith("hf"))
            same = all(c["same_tokens_as_reference"] for n, c in cell.items() if n != "hf_transformers")
            print(
                f"| {mode} | {batch} | "
                + " | ".join(f"{speed[n]:.1f}" if n in speed else "-" for n in names)
                + f" | {speed['tinylm'] / speed['hf_transformers']:.2f}x | {best_ours / speed['hf_transformers']:.2f}x"
                f" | {best_ours / best_hf:.2f}x | {same} |"
            )
    markdown_table(
        rows,
        "kv_cache_speedup",
        ["total length", "cache tok/s", "no cache tok/s", "speed-up"],
        "rrrr",
        lambda r: [
            r["total_length"],
            f"{r['cache_tokens_per_s']:.1f}",
            f"{r['nocache_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
        ],
    )
    markdown_table(
        rows,
        "llama2c",
        ["system (stories260K)", "new tokens", "tok/s", "/ run.c", "same text as run.c"],
        "lrrrl",
        lambda r: [
            r["system"],
            r["new_tokens"],
            f"{r['tokens_per_s']:.1f}",
            r.get("vs_llama2c_run", "-"),
            r["same_tokens_as_reference"],
        ],
    )
    markdown_table(
        rows,
        "bfloat16",
        ["stories260K weights", "stories (valid.txt)", "bpb", "change", "greedy tok/s", "same greedy tokens"],
        "lrrrrl",
        lambda r: [
            r["dtype"],
            r["stories"],
            f"{r['bpb']:.5f}",
            f"{r['bpb_change']:+.5f}",
            f"{r['tokens_per_s']:.1f}",
            r["same_tokens_as_float32"],
        ],
    )
    markdown_table(
        rows,
        "int8_speed",
        [
            "system (bench model, greedy)",
            "weights",
            "batch",
            "float32 tok/s",
            "int8 tok/s",
            "/ float32",
            "same greedy tokens",
        ],
        "llrrrrr",
        lambda r: [
            r["system"],
            r["weights"],
            r["batch"],
            f"{r['float32_tokens_per_s']:.1f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            r["same_greedy_tokens"],
        ],
    )
    markdown_table(
        rows,
        "int8_bpb",
        [
            "model",
            "weights",
            "stories (valid.txt)",
            "float32 bpb",
            "int8 bpb",
            "change",
            "float32 tok/s",
            "int8 tok/s",
            "same greedy tokens",
        ],
        "llrrrrrrl",
        lambda r: [
            r["model"],
            r["weights"],
            r["stories"],
            f"{r['float32_bpb']:.5f}",
            f"{r['bpb']:.5f}",
            f"{r['bpb_change']:+.5f}",
            f"{r['float32_tokens_per_s']:.1f}",
            f"{r['tokens_per_s']:.1f}",
            r["same_greedy_tokens"],
        ],
    )


def markdown_table(rows: list[dict], table: str, header: list[str], align: str, cells) -> None:
    """Print the rows of one table as markdown (``align``: l or r per column); nothing if it has none."""
    rows = [r for r in rows if r["table"] == table]
    if not rows:
        return
    print("\n| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in cells(r)) + " |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small version (under 60 s): 32 new tokens, batch 1 and 4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the llama2.c tables stay on the CPU)")
    p.add_argument("--json", type=Path, help="write all rows as a JSON list")
    p.add_argument("--repeats", type=int, default=None, help="alternating runs per cell (median reported)")
    p.add_argument("--llama2c", type=Path, help="a compiled llama2.c `run` binary to time beside tinylm")
    p.add_argument(
        "--llama2c-dir", type=Path, default=SHARED_LLAMA2C, help="folder with stories260K.bin and tok512.bin"
    )
    p.add_argument("--skip-llama2c", action="store_true")
    p.add_argument(
        "--skip-bfloat16", action="store_true", help="leave out the bfloat16 table (it scores valid.txt twice)"
    )
    p.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the compiled systems too (default: on, off with --quick: compiling takes minutes)",
    )
    p.add_argument("--skip-int8", action="store_true", help="leave out the int8 tables")
    p.add_argument(
        "--int8-checkpoint",
        type=Path,
        help="a trained tinylm checkpoint or run directory for the int8 bits-per-byte table "
        "(e.g. ../runs/tinystories-cpu-25m); stories260K is always scored",
    )
    p.add_argument(
        "--valid", type=Path, default=SHARED_VALID, help="TinyStories valid.txt for the bfloat16 and int8 tables"
    )
    p.add_argument("--modes", dest="modes_arg", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--batches", dest="batches_arg", help="comma-separated batch sizes (default: 1,16; --quick: 1,4)")
    args = p.parse_args(argv)
    if args.compiled is None:
        args.compiled = not args.quick
    torch.set_num_threads(args.threads)
    args.prompt_len = 16
    if args.quick:
        args.new_tokens, args.batches, args.totals = 32, [1, 4], [64, 128]
        args.modes = list(MODES)
        args.repeats = args.repeats or 1
        args.bf16_stories = 20
        dims = dict(vocab=1024, ctx=256, d_model=128, layers=2, heads=4)
    else:
        args.new_tokens, args.batches, args.totals = 256, [1, 16], [64, 256, 512]
        args.modes = list(MODES)
        args.repeats = args.repeats or 3
        args.bf16_stories = None  # every story
        dims = dict(vocab=4096, ctx=512, d_model=256, layers=4, heads=8)
    if args.modes_arg:
        args.modes = [m for m in args.modes_arg.split(",") if m]
        unknown = set(args.modes) - set(MODES)
        if unknown:
            p.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    if args.batches_arg:
        args.batches = [int(b) for b in args.batches_arg.split(",")]
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
        f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "") + ", "
        f"model {dims}, repeats {args.repeats}",
        flush=True,
    )
    t0 = time.perf_counter()
    hf, model = build_models(**dims, device=args.device)
    print(f"parameters: {model.num_parameters():,}")
    rows = generation_table(hf, model, args)
    print("KV-cache speed-up (tinylm, greedy, batch 1):")
    rows += cache_speedup_table(model, args)
    if not args.skip_llama2c:
        print("stories260K (llama2.c checkpoint):")
        rows += llama2c_rows(args)
        if not args.skip_bfloat16:
            print("bfloat16 decoding (stories260K):")
            rows += bfloat16_rows(args)
    if not args.skip_int8 and args.device == "cpu":
        print("int8 weights (bench model, greedy):")
        rows += int8_speed_rows(model, args)
        print("int8 weights, bits per byte on valid.txt (trained models):")
        rows += int8_bpb_rows(args)
    print_table(rows)
    print(f"\nbenchmark took {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
