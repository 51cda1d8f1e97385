"""`tinylm experiments`: every table and figure of the TinyStories assignment in one run directory.

Each part is a function that writes its own file into the run directory and returns its results;
the runner stores them as ``<part>.json`` with a key (a hash of the settings the part depends
on). A re-run skips every part whose file holds the same key, so an interrupted run resumes. The
report (tinylm.studies.tinystories_report) only reads files.

    baseline        prepare + train + evaluate + sample (tinylm.pipeline)   eval.json, metrics.csv, ...
    bleu            BLEU protocol at each sampling temperature               bleu.json, bleu_samples_T*.csv
    decoding        sampling vs greedy vs beam k: BLEU and tokens/s         decoding.json, decoding/*.csv, decoding.png
    generations     prompt | ground truth | one continuation per temperature generations.json
    kv_cache        a batch of prompts with and without the KV cache        kv_cache.json
                    (greedy and top-k sampling; the cache's memory)
    accumulation    1/2/4/8 accumulation steps, equal micro-batches         accumulation.json, accumulation.png
    checkpointing   plain vs tinylm's vs torch's gradient checkpointing     checkpointing.json, checkpointing.png
    embedding_init  FastText frozen vs fine-tuned vs random init, equal steps embedding_init.json, .png
                    (the last three trained and timed by tinylm.studies.tradeoffs, under tradeoffs/)
    tokenizers      word vocabulary with <unk> vs with BPE pieces for OOV   tokenizers.json
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
from tinylm.evaluation.protocol import SAMPLING_TEMPERATURES, BleuProtocol, Decoding, run_bleu, select_samples
from tinylm.evaluation.report import read_json
from tinylm.generation.generate import complete, generate, generate_many
from tinylm.generation.processors import GenerationConfig
from tinylm.models.checkpoint import load_checkpoint
from tinylm.pipeline import run_pipeline
from tinylm.studies.tinystories_report import write_report
from tinylm.studies import tinystories_figures as figures
from tinylm.studies.tradeoffs import Tradeoffs, Variant, alternated_runs
from tinylm.tokenizers.io import train_from_config

log = logging.getLogger(__name__)


@dataclass
class ExperimentsConfig:
    bleu_samples: int = BleuProtocol.n_samples
    prompt_tokens: int = BleuProtocol.prompt_tokens
    max_continuation: int | None = BleuProtocol.max_continuation  # None: the rest of the story
    bleu_selection: str = BleuProtocol.selection  # random (seeded, as the reports) | first
    temperatures: list[float] = field(default_factory=lambda: list(SAMPLING_TEMPERATURES))
    top_k: int | None = None
    # the decoding comparison's sampling row (the reports sampled at 0.8-0.85 with top-k 50)
    decoding_temperature: float = 0.8
    decoding_top_k: int | None = 50
    smoothing: str = BleuProtocol.smoothing
    beam_widths: list[int] = field(default_factory=lambda: [5, 10])
    kv_new_tokens: list[int] = field(default_factory=lambda: [32, 56, 248])
    kv_prompt_tokens: int = 8
    kv_batch: int = 20  # prompts decoded together (the reports timed a batch of 20)
    kv_repeats: int = 3
    generation_table_stories: int = 5  # rows of the prompt | ground truth | temperatures table
    embedding_micro_batches: int = 200  # steps of each frozen / fine-tuned / random-init run
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
            self._valid_texts = self.texts("valid")
        return self._valid_texts

    def texts(self, split: str) -> list[str]:
        """The stories of a split, cleaned exactly as the prepared split was."""
        raw = load_raw_documents(self.cfg.data)
        if split not in raw:
            raise TinyLMError(f"no {split} stories: give data.{split}=PATH or a data.{split}_fraction > 0")
        return clean_documents(raw[split], self.cfg.data)[0]


# ----------------------------------------------------------------------------------------- parts
def part_baseline(ctx: Context) -> dict:
    (ctx.run_dir / "eval.json").unlink(missing_ok=True)  # a failed training run must not leave the old one
    summary = run_pipeline(ctx.cfg, ctx.run_dir)
    model, _ = ctx.model()
    return {"summary": summary, "parameters_total": model.num_parameters(),
            "parameters_trainable": model.num_parameters(trainable_only=True)}


def _protocol(exp: ExperimentsConfig):
    return BleuProtocol(exp.bleu_samples, exp.prompt_tokens, exp.max_continuation, exp.seed, exp.smoothing,
                        exp.bleu_selection)


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
    sampling = Decoding(f"sample_T{ctx.exp.decoding_temperature:g}" + (f"_k{ctx.exp.decoding_top_k}"
                                                                       if ctx.exp.decoding_top_k else ""),
                        temperature=ctx.exp.decoding_temperature, top_k=ctx.exp.decoding_top_k)
    settings = [sampling, Decoding("greedy", temperature=0.0)]
    settings += [Decoding(f"beam{k}", beam_width=k) for k in ctx.exp.beam_widths]
    out = run_bleu(model, tok, ctx.valid_texts(), _protocol(ctx.exp), settings, csv_dir=ctx.run_dir / "decoding")
    base = out["settings"][0].get("tokens_per_s")
    for row in out["settings"]:
        if base and "tokens_per_s" in row:
            row["speed_vs_sampling"] = row["tokens_per_s"] / base
    out["threads"] = ctx.decode_threads
    out["png"] = figures.decoding_chart(out["settings"], ctx.run_dir / "decoding.png").name
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
    return {"top_k": s.top_k, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "samples": rows,
            "table": _ground_truth_table(ctx, model, tok)}


def _ground_truth_table(ctx: Context, model, tok) -> dict:
    """Validation stories drawn as for BLEU: their first tokens, the real rest, and one continuation
    per temperature of the same length (at most sample.max_new_tokens)."""
    protocol = dataclasses.replace(_protocol(ctx.exp), n_samples=ctx.exp.generation_table_stories,
                                   max_continuation=ctx.cfg.sample.max_new_tokens)
    chosen = select_samples(tok, ctx.valid_texts(), protocol, model.config.context_length).samples
    rows = []
    for k, smp in enumerate(chosen):
        row = {"story": smp.index, "prompt": tok.decode(smp.prompt_ids), "ground_truth": tok.decode(smp.reference_ids)}
        for t in ctx.exp.sample_temperatures:
            new = generate(model, [tok.bos_id, *smp.prompt_ids], len(smp.reference_ids), t, ctx.cfg.sample.top_k,
                           ctx.cfg.sample.top_p, seed=ctx.exp.seed + k, stop_ids=tok.stop_ids)
            row[f"T={t:g}"] = tok.decode(new)
        rows.append(row)
    return {"temperatures": [f"T={t:g}" for t in ctx.exp.sample_temperatures], "top_k": ctx.cfg.sample.top_k,
            "rows": rows}


def part_kv_cache(ctx: Context) -> dict:
    """A batch of prompts decoded with and without the cache, greedy and top-k sampling (seeded
    per row), alternated (A B A B), medians; the memory the cache takes."""
    torch.set_num_threads(ctx.decode_threads)
    model, tok = ctx.model()
    exp = ctx.exp
    P, B = exp.kv_prompt_tokens, exp.kv_batch
    stories = [ids for ids in (tok.encode(t) for t in ctx.valid_texts()) if len(ids) >= P][:B]
    if len(stories) < B:
        raise TinyLMError(f"only {len(stories)} validation stories have the {P} tokens of a KV-cache prompt; "
                          f"experiments.kv_batch={B} asks for more")
    prompts = [[tok.bos_id, *ids[:P]] for ids in stories]
    ctx_len = model.config.context_length
    decodings = [("greedy", {"temperature": 0.0}),
                 (f"top-k {exp.decoding_top_k}, T={exp.decoding_temperature:g}",
                  {"temperature": exp.decoding_temperature, "top_k": exp.decoding_top_k})]
    generate_many(model, prompts, GenerationConfig(max_new_tokens=4, temperature=0.0))  # warm-up
    rows = []
    for name, knobs in decodings:
        for n in exp.kv_new_tokens:
            times, outs = {True: [], False: []}, {}
            for _ in range(exp.kv_repeats):
                for use_cache in (True, False):
                    gen = GenerationConfig(max_new_tokens=n, seed=exp.seed, seed_per_row=True, use_cache=use_cache,
                                           **knobs)
                    t0 = time.perf_counter()
                    outs[use_cache] = [g.tokens for g in generate_many(model, prompts, gen)]
                    times[use_cache].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            new_tokens = sum(len(t) for t in outs[True])
            slots = min(ctx_len, len(prompts[0]) + n)
            rows.append({"decoding": name, "batch": B, "prompt_tokens": len(prompts[0]), "new_tokens": n,
                         "total_tokens": len(prompts[0]) + n, "beyond_context": len(prompts[0]) + n > ctx_len,
                         "cache_bytes": model.new_kv_cache(B, slots).nbytes, "cache_slots": slots,
                         "cache_tokens_per_s": new_tokens / med[True], "nocache_tokens_per_s": new_tokens / med[False],
                         "speedup": med[False] / med[True], "same_tokens": outs[True] == outs[False],
                         "cache_seconds": times[True], "nocache_seconds": times[False]})
            log.info(f"kv_cache: {name}, {B} x {n} new tokens: {rows[-1]['cache_tokens_per_s']:.0f} vs "
                     f"{rows[-1]['nocache_tokens_per_s']:.0f} tokens/s ({rows[-1]['speedup']:.2f}x)")
    return {"threads": ctx.decode_threads, "repeats": exp.kv_repeats, "context_length": ctx_len, "batch": B,
            "rows": rows}


def part_tokenizers(ctx: Context) -> dict:
    """The word vocabulary with <unk> for the words it lacks against the same vocabulary with BPE
    pieces for them (the fourth report's scheme): <unk> rate and tokens per word on validation."""
    tc = ctx.cfg.tokenizer
    if tc.type != "word":
        return {"missing": f"the comparison is of word-level tokenizers; this run's tokenizer is {tc.type}"}
    train, valid = ctx.texts("train"), ctx.valid_texts()
    rows = []
    for oov in ("unk", "bpe"):
        t0 = time.perf_counter()
        tok = train_from_config(dataclasses.replace(tc, oov=oov), train)
        seconds = time.perf_counter() - t0
        ids = [tok.encode(t) for t in valid]
        n_tokens, n_words = sum(map(len, ids)), sum(len(tok.split(t)) for t in valid)
        kept = sum(tok.decode(i) == tok.normalize(t) for i, t in zip(ids, valid))
        rows.append({"oov": oov, "vocab_size": tok.vocab_size, "words_in_vocabulary": len(tok.words),
                     "unk_rate": sum(x == tok.unk_id for doc in ids for x in doc) / max(n_tokens, 1),
                     "tokens_per_word": n_tokens / max(n_words, 1), "stories_restored": kept / max(len(valid), 1),
                     "train_seconds": seconds})
    return {"rows": rows, "stories": len(valid), "oov_merges": tc.oov_merges, "configured": tc.oov}


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


def _tradeoffs(ctx: Context, micro_batches: int | None = None, repeats: int | None = None) -> Tradeoffs:
    torch.set_num_threads(ctx.threads)
    return Tradeoffs(ctx.cfg, ctx.prepared(), ctx.run_dir / "tradeoffs",
                     micro_batches or ctx.exp.tradeoff_micro_batches, repeats or ctx.exp.tradeoff_repeats, ctx.threads)


def part_accumulation(ctx: Context) -> dict:
    t = _tradeoffs(ctx)
    rows = alternated_runs(t, [Variant(f"accum_{k}", accum=k) for k in ctx.exp.accum_steps])
    png = figures.accumulation_curves(rows, t.out_dir, ctx.run_dir / "accumulation.png")
    return {"threads": ctx.threads, "repeats": ctx.exp.tradeoff_repeats, "rows": rows, "png": png.name}


def part_checkpointing(ctx: Context) -> dict:
    rows = alternated_runs(_tradeoffs(ctx), [Variant("plain"),
                                             Variant("ckpt_tinylm", "tinylm checkpointing", checkpointing="tinylm"),
                                             Variant("ckpt_torch", "torch.utils.checkpoint", checkpointing="torch")])
    plain = rows[0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / plain["seconds"]
        if row["peak_activation_bytes"] and plain["peak_activation_bytes"]:
            row["memory_ratio"] = row["peak_activation_bytes"] / plain["peak_activation_bytes"]
    png = figures.checkpointing_bars(rows, ctx.run_dir / "checkpointing.png")
    return {"threads": ctx.threads, "repeats": ctx.exp.tradeoff_repeats, "rows": rows, "png": png.name}


def part_embedding_init(ctx: Context) -> dict:
    """Pretrained (or corpus-trained) FastText rows, frozen or fine-tuned, against a random
    initialisation, at an equal number of steps."""
    emb = ctx.cfg.embeddings
    kind = emb.kind if emb.kind != "none" else "train"
    source = {"kind": kind, "path": emb.path}
    variants = [Variant("fasttext_finetuned", "FastText fine-tuned", embeddings={**source, "freeze": False}),
                Variant("random_init", "random init", embeddings={"kind": "none", "freeze": False})]
    notes = []
    if ctx.cfg.model.tie_weights:
        notes.append("frozen FastText is left out: model.tie_weights=true would freeze the output layer too "
                     "(set model.tie_weights=false to compare it)")
    else:
        variants.insert(0, Variant("fasttext_frozen", "FastText frozen", embeddings={**source, "freeze": True}))
    t = _tradeoffs(ctx, ctx.exp.embedding_micro_batches, repeats=1)
    rows = alternated_runs(t, variants)
    for row in rows:
        report = read_json(t.out_dir / row["run_dir"] / "embeddings.json")
        row["coverage"] = report.get("coverage") if isinstance(report, dict) else None
        row["vectors"] = report.get("source") if isinstance(report, dict) else None
    png = figures.embedding_curves(rows, t.out_dir, ctx.run_dir / "embedding_init.png")
    return {"threads": ctx.threads, "rows": rows, "notes": notes, "png": png.name,
            "steps": ctx.exp.embedding_micro_batches}


PARTS: dict[str, Callable[[Context], dict]] = {
    "baseline": part_baseline, "bleu": part_bleu, "decoding": part_decoding, "generations": part_generations,
    "kv_cache": part_kv_cache, "accumulation": part_accumulation, "checkpointing": part_checkpointing,
    "embedding_init": part_embedding_init, "tokenizers": part_tokenizers, "attention": part_attention,
    "curves": part_curves, "machine": part_machine,
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
