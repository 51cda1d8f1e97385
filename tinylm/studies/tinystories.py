"""`tinylm experiments`: every table and figure of the TinyStories assignment in one run directory.

Each part is a function that writes its own file into the run directory and returns its results;
the runner stores them as ``<part>.json`` with a key (a hash of the settings the part depends
on). A re-run skips every part whose file holds the same key, so an interrupted run resumes. The
report (tinylm.studies.tinystories_report) only reads files.

    baseline        prepare + train + evaluate + sample (tinylm.pipeline)   eval.json, metrics.csv, ...
    bleu            BLEU protocol at each sampling temperature               bleu.json, bleu_samples_T*.csv
    decoding        sampling vs greedy vs beam k: BLEU and tokens/s         decoding.json, decoding/*.csv
    generations     example generations at several temperatures            generations.json
    kv_cache        generation time with and without the KV cache          kv_cache.json
    accumulation    1/2/4/8 accumulation steps, equal micro-batches         accumulation.json, tradeoffs/
    checkpointing   plain vs gradient checkpointing                         checkpointing.json
                    (both trained and timed by tinylm.studies.tradeoffs)
    attention       attention maps for chosen sentences                     attention/*.png, *.html
    curves          loss and perplexity against step                        curves.png
    machine         what it ran on                                          machine.json
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tinylm.config import RunConfig, apply_updates, parse_overrides, read_config
from tinylm.data.cleaning import clean_documents
from tinylm.data.prepare import load_raw_documents, prepare
from tinylm.errors import TinyLMError
from tinylm.evaluation.plots import attention_html, attention_maps, plot_curves, save_attention_pngs
from tinylm.evaluation.protocol import SAMPLING_TEMPERATURES, BleuProtocol, Decoding, run_bleu
from tinylm.evaluation.report import read_json
from tinylm.generation.generate import complete, generate
from tinylm.generation.processors import GenerationConfig
from tinylm.models.checkpoint import load_checkpoint
from tinylm.pipeline import run_pipeline
from tinylm.studies.tinystories_report import write_report
from tinylm.studies.tradeoffs import Tradeoffs, alternated_runs

log = logging.getLogger(__name__)


@dataclass
class ExperimentsConfig:
    bleu_samples: int = BleuProtocol.n_samples
    prompt_tokens: int = BleuProtocol.prompt_tokens
    max_continuation: int = BleuProtocol.max_continuation
    temperatures: list[float] = field(default_factory=lambda: list(SAMPLING_TEMPERATURES))
    top_k: int | None = None
    smoothing: str = BleuProtocol.smoothing
    beam_widths: list[int] = field(default_factory=lambda: [5, 10])
    kv_new_tokens: list[int] = field(default_factory=lambda: [32, 56, 248])
    kv_prompt_tokens: int = 8
    kv_repeats: int = 3
    accum_steps: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    tradeoff_micro_batches: int = 64
    tradeoff_repeats: int = 2  # each accumulation / checkpointing run, in alternated rounds (median)
    attention_texts: list[str] = field(default_factory=lambda: ["Once upon a time there was a little girl named Lily."])
    sample_temperatures: list[float] = field(default_factory=lambda: list(SAMPLING_TEMPERATURES))
    seed: int = 0
    # torch threads: token-by-token decoding is many small ops, which collapse under contention
    # with 2 threads on a shared CPU (measured: 13-32 vs ~490 tokens/s); training uses train.threads
    decode_threads: int = 1
    train_threads: int | None = None  # None: train.threads, else 2


def load_experiment_config(path: str | Path | None, overrides: list[str] | None = None,
                           quick: bool = False) -> tuple[RunConfig, ExperimentsConfig]:
    """The run config and the experiments section; ``quick`` merges the file's ``quick`` section.
    Command-line overrides (``data.train=PATH``, ``experiments.bleu_samples=10``) come last."""
    raw = read_config(path, quick) if path else {}
    exp_raw = raw.pop("experiments", None) or {}
    ov = parse_overrides(overrides or [])
    exp_ov = ov.pop("experiments", {})
    cfg, exp = RunConfig(), ExperimentsConfig()
    apply_updates(cfg, raw)
    apply_updates(cfg, ov)
    for section in (exp_raw, exp_ov):
        if not isinstance(section, dict):
            raise TinyLMError("the experiments section must be a mapping of keys")
        apply_updates(exp, section, prefix="experiments.")
    if any(k < 1 for k in exp.accum_steps):
        raise TinyLMError(f"experiments.accum_steps must all be >= 1 (got {exp.accum_steps})")
    bad = [k for k in exp.accum_steps if exp.tradeoff_micro_batches % k]
    if bad:
        raise TinyLMError(f"experiments.tradeoff_micro_batches={exp.tradeoff_micro_batches} is not a multiple of "
                          f"accumulation steps {bad}; every trade-off run must see the same micro-batches")
    return cfg, exp


# ------------------------------------------------------------------------------------- context
@dataclass
class Context:
    cfg: RunConfig
    exp: ExperimentsConfig
    run_dir: Path
    quick: bool
    _model: tuple | None = None
    _prepared: object = None
    _valid_texts: list[str] | None = None

    @property
    def threads(self) -> int:
        """Threads for the training runs."""
        return self.exp.train_threads or self.cfg.train.threads or 2

    @property
    def decode_threads(self) -> int:
        return self.exp.decode_threads

    def model(self):
        """(model, tokenizer) of the baseline's best checkpoint, on CPU, in eval mode."""
        if self._model is None:
            model, tokenizer, _ = load_checkpoint(self.run_dir / "checkpoints" / "best")
            self._model = (model, tokenizer)
        return self._model

    def prepared(self):
        if self._prepared is None:
            self._prepared = prepare(self.cfg, self.run_dir)
        return self._prepared

    def valid_texts(self) -> list[str]:
        """The validation stories, cleaned exactly as the prepared split was."""
        if self._valid_texts is None:
            raw = load_raw_documents(self.cfg.data)
            if "valid" not in raw:
                raise TinyLMError("no validation stories: give data.valid=PATH or a data.valid_fraction > 0")
            self._valid_texts, _ = clean_documents(raw["valid"], self.cfg.data)
        return self._valid_texts


# ----------------------------------------------------------------------------------------- parts
def part_baseline(ctx: Context) -> dict:
    (ctx.run_dir / "eval.json").unlink(missing_ok=True)  # a failed training run must not leave the old one
    summary = run_pipeline(ctx.cfg, ctx.run_dir)
    model, _ = ctx.model()
    return {"summary": summary, "parameters_total": model.num_parameters(),
            "parameters_trainable": model.num_parameters(trainable_only=True)}


def _protocol(exp: ExperimentsConfig):
    return BleuProtocol(exp.bleu_samples, exp.prompt_tokens, exp.max_continuation, exp.seed, exp.smoothing)


def part_bleu(ctx: Context) -> dict:
    torch.set_num_threads(ctx.decode_threads)
    model, tok = ctx.model()
    settings = [Decoding(f"T{t:g}", temperature=t, top_k=ctx.exp.top_k) for t in ctx.exp.temperatures]
    out = run_bleu(model, tok, ctx.valid_texts(), _protocol(ctx.exp), settings, csv_dir=ctx.run_dir)
    out["threads"] = ctx.decode_threads
    return out


def part_decoding(ctx: Context) -> dict:
    torch.set_num_threads(ctx.decode_threads)
    model, tok = ctx.model()
    settings = [Decoding("sample_T1", temperature=1.0, top_k=ctx.exp.top_k), Decoding("greedy", temperature=0.0)]
    settings += [Decoding(f"beam{k}", beam_width=k) for k in ctx.exp.beam_widths]
    out = run_bleu(model, tok, ctx.valid_texts(), _protocol(ctx.exp), settings, csv_dir=ctx.run_dir / "decoding")
    base = out["settings"][0].get("tokens_per_s")
    for row in out["settings"]:
        if base and "tokens_per_s" in row:
            row["speed_vs_sampling"] = row["tokens_per_s"] / base
    out["threads"] = ctx.decode_threads
    return out


def part_generations(ctx: Context) -> dict:
    torch.set_num_threads(ctx.decode_threads)
    model, tok = ctx.model()
    s = ctx.cfg.sample
    rows = []
    for t in ctx.exp.sample_temperatures:
        cfg = GenerationConfig(max_new_tokens=s.max_new_tokens, temperature=t, top_k=s.top_k, top_p=s.top_p,
                               seed=ctx.exp.seed, stop_ids=tok.stop_ids)
        for c in complete(model, tok, s.prompts, cfg):
            new = c.results[0].tokens
            rows.append({"temperature": t, "prompt": c.prompt, "prompt_as_tokenized": tok.decode(c.prompt_ids),
                         "continuation": tok.decode(new), "text": tok.decode([*c.prompt_ids, *new]),
                         "new_tokens": len(new)})
    return {"top_k": s.top_k, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "samples": rows}


def part_kv_cache(ctx: Context) -> dict:
    """Greedy decoding of n new tokens with and without the cache, alternated (A B A B), medians."""
    torch.set_num_threads(ctx.decode_threads)
    model, tok = ctx.model()
    P = ctx.exp.kv_prompt_tokens
    story = next((t for t in ctx.valid_texts() if len(tok.encode(t)) >= P), None)
    if story is None:
        raise TinyLMError(f"no validation story has {P} tokens for the KV-cache prompt")
    prompt = [tok.bos_id, *tok.encode(story)[:P]]
    ctx_len = model.config.context_length
    generate(model, prompt, 8, 0.0)  # warm-up (allocations, first-call overheads)
    rows = []
    for n in ctx.exp.kv_new_tokens:
        times = {True: [], False: []}
        outs = {}
        for _ in range(ctx.exp.kv_repeats):
            for use_cache in (True, False):
                t0 = time.perf_counter()
                outs[use_cache] = generate(model, prompt, n, 0.0, eos_id=None, use_cache=use_cache)
                times[use_cache].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"prompt_tokens": len(prompt), "new_tokens": n, "total_tokens": len(prompt) + n,
                     "beyond_context": len(prompt) + n > ctx_len,
                     "cache_tokens_per_s": n / med[True], "nocache_tokens_per_s": n / med[False],
                     "speedup": med[False] / med[True], "same_tokens": outs[True] == outs[False],
                     "cache_seconds": times[True], "nocache_seconds": times[False]})
        log.info(f"kv_cache: {n} new tokens: {rows[-1]['cache_tokens_per_s']:.0f} vs "
                f"{rows[-1]['nocache_tokens_per_s']:.0f} tokens/s ({rows[-1]['speedup']:.2f}x)")
    return {"threads": ctx.decode_threads, "repeats": ctx.exp.kv_repeats, "context_length": ctx_len, "decoding": "greedy",
            "rows": rows}


def part_attention(ctx: Context) -> dict:
    model, tok = ctx.model()
    out_dir = ctx.run_dir / "attention"
    rows = []
    for i, text in enumerate(ctx.exp.attention_texts):
        try:
            maps = attention_maps(model, tok, text)
        except TinyLMError as exc:
            rows.append({"text": text, "missing": str(exc)})
            continue
        pngs = save_attention_pngs(maps, out_dir, prefix=f"text{i}")
        page = attention_html(maps, out_dir / f"text{i}.html")
        row_sum_err = max(float(abs(w.sum(-1) - 1).max()) for w in maps.weights)
        above = max(float(np.abs(np.triu(w, k=1)).max()) for w in maps.weights)
        rows.append({"text": text, "tokens": maps.tokens, "layers": maps.n_layers, "heads": maps.n_heads,
                     "pngs": [str(p.relative_to(ctx.run_dir)) for p in pngs],
                     "html": str(page.relative_to(ctx.run_dir)),
                     "max_row_sum_error": row_sum_err, "max_weight_above_diagonal": above})
    return {"texts": rows}


def part_curves(ctx: Context) -> dict:
    path = plot_curves(ctx.run_dir / "metrics.csv", ctx.run_dir / "curves.png", title="baseline")
    return {"png": path.name}


def machine_info(threads: int | None = None) -> dict:
    import cpuinfo  # deferred: slow to import, and get_cpu_info() probes the CPU in a subprocess

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpuinfo.get_cpu_info().get("brand_raw") or platform.processor(), "cpu_count": os.cpu_count(),
            "torch_threads": threads or torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def part_machine(ctx: Context) -> dict:
    return {**machine_info(ctx.threads), "train_threads": ctx.threads, "decode_threads": ctx.decode_threads}


def _tradeoffs(ctx: Context) -> Tradeoffs:
    torch.set_num_threads(ctx.threads)
    return Tradeoffs(ctx.cfg, ctx.prepared(), ctx.run_dir / "tradeoffs", ctx.exp.tradeoff_micro_batches,
                     ctx.exp.tradeoff_repeats, ctx.threads)


def part_accumulation(ctx: Context) -> dict:
    rows = alternated_runs(_tradeoffs(ctx), [(f"accum_{k}", k, False) for k in ctx.exp.accum_steps])
    return {"threads": ctx.threads, "repeats": ctx.exp.tradeoff_repeats, "rows": rows}


def part_checkpointing(ctx: Context) -> dict:
    rows = alternated_runs(_tradeoffs(ctx), [("plain", 1, False), ("checkpointing", 1, True)])
    plain = rows[0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / plain["seconds"]
        if row["peak_activation_bytes"] and plain["peak_activation_bytes"]:
            row["memory_ratio"] = row["peak_activation_bytes"] / plain["peak_activation_bytes"]
    return {"threads": ctx.threads, "impl": ctx.cfg.train.checkpoint_impl, "repeats": ctx.exp.tradeoff_repeats,
            "rows": rows}


PARTS: dict[str, Callable[[Context], dict]] = {
    "baseline": part_baseline, "bleu": part_bleu, "decoding": part_decoding, "generations": part_generations,
    "kv_cache": part_kv_cache, "accumulation": part_accumulation, "checkpointing": part_checkpointing,
    "attention": part_attention, "curves": part_curves, "machine": part_machine,
}


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def part_key(ctx: Context, name: str, baseline_stamp: str | None, finished: dict | None = None) -> str:
    payload = {"part": name, "run": ctx.cfg.to_dict(), "quick": ctx.quick}
    if name != "baseline":
        payload["experiments"] = dataclasses.asdict(ctx.exp)
        payload["baseline"] = baseline_stamp
    if name == "machine":
        payload["finished"] = finished  # re-described whenever any other part ran again
    return _hash(payload)


def run_experiments(cfg: RunConfig, exp: ExperimentsConfig, run_dir: str | Path, quick: bool = False,
                    only: list[str] | None = None, command: str | None = None) -> dict:
    """Run (or resume) every part, then write report.md and report.html. Returns the manifest."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    unknown = [p for p in (only or []) if p not in PARTS]
    if unknown:
        raise TinyLMError(f"unknown experiment part(s) {', '.join(unknown)}; parts are {', '.join(PARTS)}")
    ctx = Context(cfg, exp, run_dir, quick)
    t_start = time.perf_counter()
    manifest = {"quick": quick, "command": command, "parts": {},
                "experiments": dataclasses.asdict(exp)}
    stamp, finished = None, {}
    for name, fn in PARTS.items():
        key = part_key(ctx, name, stamp, finished)
        cached = read_json(run_dir / f"{name}.json")
        cached = cached if isinstance(cached, dict) else None  # a damaged part file is run again
        if only and name not in only and name != "baseline":
            manifest["parts"][name] = "not requested" if not cached else ("done" if cached.get("key") == key else "stale")
            continue
        if cached and cached.get("key") == key and not cached.get("error"):
            log.info(f"experiments: {name}: cached ({name}.json)")
            manifest["parts"][name] = "cached"
        else:
            log.info(f"experiments: {name} ...")
            t0 = time.perf_counter()
            try:
                result = fn(ctx)
                status = "missing: " + result["missing"] if result.get("missing") else "done"
            except TinyLMError as exc:
                if name == "baseline":
                    raise
                result, status = {"error": str(exc)}, f"failed: {exc}"
                log.info(f"experiments: {name}: {exc}")
            result.update(key=key, seconds=round(time.perf_counter() - t0, 2),
                          finished_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
            (run_dir / f"{name}.json").write_text(json.dumps(result, indent=2, ensure_ascii=False, default=float))
            manifest["parts"][name] = status
            cached = result
        if name == "baseline":
            stamp = f"{cached.get('key')}@{cached.get('finished_utc')}"
        finished[name] = (cached or {}).get("finished_utc")
    manifest["seconds"] = round(time.perf_counter() - t_start, 2)
    (run_dir / "experiments.json").write_text(json.dumps(manifest, indent=2))

    md, html, _ = write_report(run_dir)
    log.info(f"experiments: finished in {manifest['seconds']:.0f} s; report: {md} and {html}")
    return manifest
