"""`tinylm experiments`: every table and figure of the TinyStories assignment in one run directory.

Each part is a function that writes its own files into the run directory and returns its results;
the runner stores them as the stage ``<part>.json`` (tinylm.studies.stages), keyed by the settings
the part depends on. A re-run skips every part whose file holds the same key, so an interrupted
run resumes. The report (tinylm.studies.tinystories_report) only reads files.

    baseline        prepare + train + evaluate + sample (tinylm.pipeline)   eval.json, metrics.csv, ...
    bleu            BLEU protocol at each sampling temperature               bleu.json, bleu_samples_T*.csv
    decoding        sampling vs greedy vs beam k: BLEU, tokens/s, examples  decoding.json, decoding_samples_*.csv,
                                                                             decoding.png
    generations     prompt | ground truth | one continuation per temperature generations.json
    kv_cache        a batch of prompts with and without the KV cache        kv_cache.json
                    (greedy and top-k sampling; the cache's memory)
    accumulation    1/2/4/8 accumulation steps at equal tokens (whole       accumulation.json, accumulation.png
                    epochs each) and at equal optimizer updates
    checkpointing   plain vs tinylm's vs torch's gradient checkpointing     checkpointing.json, checkpointing.png
    embedding_init  FastText frozen vs fine-tuned vs random init, equal steps embedding_init.json, .png
                    (the last three trained and timed by tinylm.studies.tradeoffs, under tradeoffs/)
    tokenizers      word vocabulary with <unk> vs with BPE pieces for OOV   tokenizers.json
    attention       attention maps for chosen sentences                     attention/*.png, *.html
    curves          loss and perplexity against step                        curves.png
    machine         what it ran on                                          machine.json
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch

from tinylm.config import (
    BleuSelection,
    BleuSmoothing,
    ConfigError,
    GenerationConfig,
    RunConfig,
    apply_updates,
    check_config,
    config_from_dict,
    like,
    merge_dicts,
    option,
    parse_overrides,
    read_config,
)
from tinylm.data.cleaning import clean_documents
from tinylm.data.prepare import PreparedData, load_raw_documents, prepare
from tinylm.errors import TinyLMError
from tinylm.evaluation.plots import attention_html, attention_maps, plot_curves, save_attention_pngs
from tinylm.evaluation.protocol import SAMPLING_TEMPERATURES, BleuProtocol, Decoding, run_bleu, select_samples
from tinylm.evaluation.report import read_json
from tinylm.generation.generate import complete, generate, generate_many
from tinylm.models.checkpoint import load_checkpoint
from tinylm.pipeline import result_checkpoint, run_pipeline
from tinylm.studies import tinystories_figures as figures
from tinylm.studies.stages import Stage, stage_key
from tinylm.studies.tinystories_fluency import judge_stamp, part_fluency
from tinylm.studies.tinystories_protocols import part_protocols
from tinylm.studies.tinystories_report import QUALITY_PARTS, write_experiments_report
from tinylm.studies.tradeoffs import (
    Tradeoffs,
    Variant,
    accumulation_variants,
    alternated_runs,
    first_stories,
    start_val_loss,
)
from tinylm.tokenizers.io import train_from_config

log = logging.getLogger(__name__)


@dataclass
class ExperimentsConfig:
    bleu_samples: int = like(BleuProtocol, "n_samples")
    prompt_tokens: int = like(BleuProtocol, "prompt_tokens")
    max_continuation: int | None = like(BleuProtocol, "max_continuation")
    bleu_selection: BleuSelection = BleuProtocol.selection  # random: seeded, as the reports
    temperatures: list[float] = option(list(SAMPLING_TEMPERATURES), ge=0)
    top_k: int | None = option(None, ge=1)
    # the decoding comparison's sampling row (the reports sampled at 0.8-0.85 with top-k 50)
    decoding: GenerationConfig = option(factory=lambda: GenerationConfig(temperature=0.8, top_k=50))
    smoothing: BleuSmoothing = BleuProtocol.smoothing
    beam_widths: list[int] = option([5, 10], ge=1)
    beam_no_repeat_ngram: int = option(
        3, "each beam width again with n-gram blocking of this size, beside plain beam (0: not run)", ge=0
    )
    decoding_prompts: list[str] = option(
        ["The sun was shining and", "Once, there was a boy named Tim.", "there was a brave explorer"],
        "prompts every decoding setting continues side by side (the reports' own examples)",
    )
    kv_new_tokens: list[int] = option([32, 56, 248], "new tokens per row; past the context the window slides", ge=1)
    kv_prompt_tokens: int = option(8, ge=1)
    kv_batch: int = option(20, "prompts decoded together (the reports timed a batch of 20)", ge=1)
    kv_repeats: int = option(3, ge=1)
    generation_table_stories: int = option(5, "rows of the prompt | ground truth | temperatures table", ge=1)
    embedding_micro_batches: int = option(200, "steps of each frozen / fine-tuned / random-init run", ge=1)
    accum_steps: list[int] = option([1, 2, 4, 8], ge=1)
    accum_epochs: int = option(
        1,
        "epochs of the trade-off split at the smallest accumulation (equal tokens: every "
        "k trains them; equal updates: k / smallest k times as many)",
        ge=1,
    )
    accum_micro_batch: int | None = option(
        None, "rows per micro-batch of the accumulation runs (None: train.batch_size; three reports used 16)", ge=1
    )
    tradeoff_stories: int | None = option(
        None,
        "the first N training stories are the accumulation and "
        "checkpointing runs' split (None: all; one report used 10%)",
        ge=1,
    )
    tradeoff_micro_batches: int = option(64, "micro-batches of each checkpointing run", ge=1)
    tradeoff_repeats: int = option(2, "each checkpointing run, in alternated rounds (median)", ge=0)
    tradeoff_start: Literal["trained", "scratch"] = option(
        "trained",
        "trained: the accumulation and checkpointing runs continue from the judged model's result "
        "checkpoint, where the reports' losses are; scratch: each from a fresh model",
    )
    tradeoff_lr_scale: float = option(
        0.3, "the continued runs' learning rates (peak and final) as a share of the judged run's", gt=0, le=1
    )
    tradeoff_eval_batches: int | None = option(
        0, "validation batches of each trade-off run (0: the whole validation split; None: train.eval_batches)", ge=0
    )
    attention_texts: list[str] = option(["Once upon a time there was a little girl named Lily."])
    sample_temperatures: list[float] = option(list(SAMPLING_TEMPERATURES), ge=0)
    seed: int = 0
    # torch threads: token-by-token decoding is many small ops, which collapse under contention
    # with 2 threads on a shared CPU (measured: 13-32 vs ~490 tokens/s); training uses train.threads
    decode_threads: int = option(1, ge=1)
    train_threads: int | None = option(None, "None: train.threads, else 2", ge=1)
    decoding_examples: int = option(5, "prompts whose continuations the decoding comparison prints side by side", ge=0)
    judge: str | None = option(
        None,
        "checkpoint of a stronger model, trained on the same split, that scores every decoding's "
        "continuations in bits per byte (the fluency part); None: the part is not run",
    )
    # the second column: the same task and tokenizer trained with this repository's settings
    tinylm_settings: dict = option(
        None,
        "overrides of the run's model, train, embeddings and data.batching for the tinylm-settings "
        "model; the quality parts (BLEU, decoding, generations, KV cache, attention) then use it. "
        "Empty: no second column",
        factory=dict,
    )

    def validate(self) -> None:
        column = self.tinylm_settings
        if set(column) - COLUMN_SECTIONS or set(column.get("data") or {}) - {"batching"}:
            raise ConfigError(
                "tinylm_settings",
                "experiments.tinylm_settings may set model, train, embeddings, sample and data.batching only: "
                "the two columns share the data and the tokenizer, so their perplexities compare",
            )
        smallest = min(self.accum_steps)
        bad = [k for k in self.accum_steps if k % smallest]
        if bad:
            raise TinyLMError(
                f"experiments.accum_steps {bad} are not multiples of the smallest, {smallest}: the "
                "equal-updates runs train k / smallest times its epochs"
            )


COLUMN_SECTIONS = {"model", "train", "embeddings", "sample", "data"}


def column_config(cfg: RunConfig, exp: ExperimentsConfig) -> RunConfig:
    """The tinylm-settings column's run config: the run's, with ``experiments.tinylm_settings`` over it."""
    try:
        return config_from_dict(merge_dicts(cfg.to_dict(), exp.tinylm_settings))
    except TinyLMError as exc:
        raise TinyLMError(f"experiments.tinylm_settings: {exc}") from None


def load_experiment_config(
    path: str | Path | None, overrides: list[str] | None = None, quick: bool = False
) -> tuple[RunConfig, ExperimentsConfig]:
    """The run config and the experiments section, both checked whole; ``quick`` merges the file's
    ``quick`` section. Command-line overrides (``data.train=PATH``, ``experiments.bleu_samples=10``) come last."""
    raw = read_config(path, quick) if path else {}
    ov = parse_overrides(overrides or [])
    sections = [raw.pop("experiments", None) or {}, ov.pop("experiments", {})]
    cfg, exp, column = config_from_dict(merge_dicts(raw, ov)), ExperimentsConfig(), {}
    for section in sections:
        if not isinstance(section, dict):
            raise TinyLMError("the experiments section must be a mapping of keys")
        column = merge_dicts(column, section.pop("tinylm_settings", None) or {})  # key by key, not replaced
        apply_updates(exp, section, prefix="experiments.")
    exp.tinylm_settings = column
    check_config(exp, "experiments.")
    if column:
        column_config(cfg, exp)  # checked whole now, not an hour into the run
    return cfg, exp


# --------------------------------------------------------------------------------------- study
@dataclass
class Study:
    """One run of the assignment: its settings, its directory, and what several parts load."""

    cfg: RunConfig
    exp: ExperimentsConfig
    run_dir: Path
    quick: bool

    @property
    def threads(self) -> int:
        """Threads for the training runs."""
        return self.exp.train_threads or self.cfg.train.threads or 2

    @property
    def column_dir(self) -> Path:
        return self.run_dir / "tinylm-settings"

    @property
    def judged_dir(self) -> Path:
        """The run whose model the quality parts judge: the tinylm-settings column when there is one."""
        return self.column_dir if self.exp.tinylm_settings else self.run_dir

    @property
    def judged_cfg(self) -> RunConfig:
        """The judged run's config: the tinylm-settings column's when there is one."""
        return column_config(self.cfg, self.exp) if self.exp.tinylm_settings else self.cfg

    @cached_property
    def model(self) -> tuple:
        """(model, tokenizer) of the judged run's result checkpoint, on CPU, in eval mode."""
        return result_model(self.judged_dir)

    @cached_property
    def prepared(self) -> PreparedData:
        return prepare(self.cfg, self.run_dir)

    @cached_property
    def valid_texts(self) -> list[str]:
        """The validation stories, cleaned exactly as the prepared split was."""
        return self.texts("valid")

    def texts(self, split: str) -> list[str]:
        """The stories of a split, cleaned exactly as the prepared split was."""
        raw = load_raw_documents(self.cfg.data)
        if split not in raw:
            raise TinyLMError(f"no {split} stories: give data.{split}=PATH or a data.{split}_fraction > 0")
        return clean_documents(raw[split], self.cfg.data)[0]


def result_model(run_dir: Path) -> tuple:
    """(model, tokenizer) of a training run's result checkpoint, on CPU, in eval mode."""
    checkpoints = run_dir / "checkpoints"
    return load_checkpoint(checkpoints / result_checkpoint(checkpoints))[:2]


# ----------------------------------------------------------------------------------------- parts
def part_baseline(study: Study) -> dict:
    (study.run_dir / "eval.json").unlink(missing_ok=True)  # a failed training run must not leave the old one
    summary = run_pipeline(study.cfg, study.run_dir)
    model, _ = result_model(study.run_dir)
    return {
        "summary": summary,
        "parameters_total": model.num_parameters(),
        "parameters_trainable": model.num_parameters(trainable_only=True),
    }


def part_tinylm_settings(study: Study) -> dict:
    """The second column: the same data and tokenizer (prepared again in its own directory, which
    rebuilds the same vocabulary) trained with the column's settings."""
    if not study.exp.tinylm_settings:
        return {"off": True}
    out = study.column_dir
    (out / "eval.json").unlink(missing_ok=True)
    summary = run_pipeline(column_config(study.cfg, study.exp), out)
    model, _ = result_model(out)
    return {
        "summary": summary,
        "run_dir": out.name,
        "parameters_total": model.num_parameters(),
        "parameters_trainable": model.num_parameters(trainable_only=True),
    }


def _protocol(exp: ExperimentsConfig):
    return BleuProtocol(
        exp.bleu_samples, exp.prompt_tokens, exp.max_continuation, exp.seed, exp.smoothing, exp.bleu_selection
    )


def part_bleu(study: Study) -> dict:
    torch.set_num_threads(study.exp.decode_threads)
    model, tok = study.model
    settings = [Decoding(f"T{t:g}", temperature=t, top_k=study.exp.top_k) for t in study.exp.temperatures]
    return {
        **run_bleu(model, tok, study.valid_texts, _protocol(study.exp), settings, csv_dir=study.run_dir),
        "threads": study.exp.decode_threads,
    }


def part_decoding(study: Study) -> dict:
    torch.set_num_threads(study.exp.decode_threads)
    model, tok = study.model
    knobs = study.exp.decoding
    sampling = Decoding(
        f"sample_T{knobs.temperature:g}" + (f"_k{knobs.top_k}" if knobs.top_k else ""),
        temperature=knobs.temperature,
        top_k=knobs.top_k,
    )
    settings = [sampling, Decoding("greedy", temperature=0.0)]
    for k in study.exp.beam_widths:
        settings.append(Decoding(f"beam{k}", beam_width=k))
        if n := study.exp.beam_no_repeat_ngram:
            settings.append(Decoding(f"beam{k}_no_repeat{n}", beam_width=k, no_repeat_ngram_size=n))
    out = run_bleu(
        model,
        tok,
        study.valid_texts,
        _protocol(study.exp),
        settings,
        csv_dir=study.run_dir,
        csv_prefix="decoding_samples_",
    )
    base = out["settings"][0].get("tokens_per_s")
    for row in out["settings"]:
        if base and "tokens_per_s" in row:
            row["speed_vs_sampling"] = row["tokens_per_s"] / base
    out["threads"] = study.exp.decode_threads
    out["examples"] = _decoding_examples(study.run_dir, out["settings"], study.exp.decoding_examples)
    out["prompt_examples"] = _prompt_examples(study, settings)
    out["png"] = figures.decoding_chart(out["settings"], study.run_dir / "decoding.png").name
    return out


def _decoding_examples(run_dir: Path, settings: list[dict], n: int) -> list[dict]:
    """The first ``n`` samples with distinct prompts, the real continuation and each setting's, read
    back from the per-sample CSVs just written (the table shows what the BLEU numbers were computed on)."""
    columns = {}
    for s in settings:
        with open(run_dir / s["csv"], newline="", encoding="utf-8") as f:
            columns[s["name"]] = list(csv.DictReader(f))
    first = next(iter(columns.values()))
    distinct: dict[str, int] = {}  # prompt -> its first row
    for i, row in enumerate(first):
        distinct.setdefault(row["prompt"], i)
    return [
        {
            "prompt": first[i]["prompt"],
            "reference": first[i]["reference_continuation"],
            **{
                name: {"text": rows[i]["hypothesis_continuation"], "sentence_bleu4": float(rows[i]["sentence_bleu4"])}
                for name, rows in columns.items()
            },
        }
        for i in list(distinct.values())[:n]
    ]


def _prompt_examples(study: Study, settings: list[Decoding]) -> list[dict]:
    """``experiments.decoding_prompts`` continued by every setting (``sample.max_new_tokens`` at most)."""
    model, tok = study.model
    rows = [{"prompt": p} for p in study.exp.decoding_prompts]
    for setting in settings:
        cfg = setting.generation(study.cfg.sample.max_new_tokens, study.exp.seed, tok.stop_ids)
        for row, c in zip(rows, complete(model, tok, study.exp.decoding_prompts, cfg)):
            row[setting.name] = c.continuation(tok)
    return rows


def part_generations(study: Study) -> dict:
    torch.set_num_threads(study.exp.decode_threads)
    model, tok = study.model
    s = study.cfg.sample
    rows = []
    for t in study.exp.sample_temperatures:
        cfg = GenerationConfig(
            max_new_tokens=s.max_new_tokens,
            temperature=t,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=study.exp.seed,
            stop_ids=tok.stop_ids,
        )
        for c in complete(model, tok, s.prompts, cfg):
            new = c.results[0].tokens
            rows.append(
                {
                    "temperature": t,
                    "prompt": c.prompt,
                    "prompt_as_tokenized": tok.decode(c.prompt_ids),
                    "continuation": tok.decode(new),
                    "text": tok.decode([*c.prompt_ids, *new]),
                    "new_tokens": len(new),
                }
            )
    return {
        "top_k": s.top_k,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "samples": rows,
        "table": _ground_truth_table(study, model, tok),
    }


def _ground_truth_table(study: Study, model, tok) -> dict:
    """Validation stories drawn as for BLEU: their first tokens, the real rest, and one continuation
    per temperature of the same length (at most sample.max_new_tokens)."""
    protocol = dataclasses.replace(
        _protocol(study.exp),
        n_samples=study.exp.generation_table_stories,
        max_continuation=study.cfg.sample.max_new_tokens,
    )
    chosen = select_samples(tok, study.valid_texts, protocol, model.config.context_length).samples
    rows = []
    for k, smp in enumerate(chosen):
        row = {"story": smp.index, "prompt": tok.decode(smp.prompt_ids), "ground_truth": tok.decode(smp.reference_ids)}
        for t in study.exp.sample_temperatures:
            new = generate(
                model,
                [tok.bos_id, *smp.prompt_ids],
                len(smp.reference_ids),
                t,
                study.cfg.sample.top_k,
                study.cfg.sample.top_p,
                seed=study.exp.seed + k,
                stop_ids=tok.stop_ids,
            )
            row[f"T={t:g}"] = tok.decode(new)
        rows.append(row)
    return {
        "temperatures": [f"T={t:g}" for t in study.exp.sample_temperatures],
        "top_k": study.cfg.sample.top_k,
        "rows": rows,
    }


def part_kv_cache(study: Study) -> dict:
    """A batch of prompts decoded with and without the cache, greedy and top-k sampling (seeded
    per row), alternated (A B A B), medians; the memory the cache takes."""
    torch.set_num_threads(study.exp.decode_threads)
    model, tok = study.model
    exp = study.exp
    P, B = exp.kv_prompt_tokens, exp.kv_batch
    stories = [ids for ids in (tok.encode(t) for t in study.valid_texts) if len(ids) >= P][:B]
    if len(stories) < B:
        raise TinyLMError(
            f"only {len(stories)} validation stories have the {P} tokens of a KV-cache prompt; "
            f"experiments.kv_batch={B} asks for more"
        )
    prompts = [[tok.bos_id, *ids[:P]] for ids in stories]
    context_length = model.config.context_length
    decodings = [
        ("greedy", {"temperature": 0.0}),
        (
            f"top-k {exp.decoding.top_k}, T={exp.decoding.temperature:g}",
            {"temperature": exp.decoding.temperature, "top_k": exp.decoding.top_k},
        ),
    ]
    generate_many(model, prompts, GenerationConfig(max_new_tokens=4, temperature=0.0))  # warm-up
    rows = []
    for name, knobs in decodings:
        for n in exp.kv_new_tokens:
            times, outs = {True: [], False: []}, {}
            for _ in range(exp.kv_repeats):
                for use_cache in (True, False):
                    gen = GenerationConfig(
                        max_new_tokens=n, seed=exp.seed, seed_per_row=True, use_cache=use_cache, **knobs
                    )
                    t0 = time.perf_counter()
                    outs[use_cache] = [g.tokens for g in generate_many(model, prompts, gen)]
                    times[use_cache].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            new_tokens = sum(len(t) for t in outs[True])
            slots = min(context_length, len(prompts[0]) + n)
            rows.append(
                {
                    "decoding": name,
                    "batch": B,
                    "prompt_tokens": len(prompts[0]),
                    "new_tokens": n,
                    "total_tokens": len(prompts[0]) + n,
                    "beyond_context": len(prompts[0]) + n > context_length,
                    "cache_bytes": model.new_kv_cache(B, slots).nbytes,
                    "cache_slots": slots,
                    "cache_tokens_per_s": new_tokens / med[True],
                    "nocache_tokens_per_s": new_tokens / med[False],
                    "speedup": med[False] / med[True],
                    "same_tokens": outs[True] == outs[False],
                    "cache_seconds": times[True],
                    "nocache_seconds": times[False],
                }
            )
            log.info(
                f"kv_cache: {name}, {B} x {n} new tokens: {rows[-1]['cache_tokens_per_s']:.0f} vs "
                f"{rows[-1]['nocache_tokens_per_s']:.0f} tokens/s ({rows[-1]['speedup']:.2f}x)"
            )
    return {
        "threads": exp.decode_threads,
        "repeats": exp.kv_repeats,
        "context_length": context_length,
        "batch": B,
        "rows": rows,
    }


def part_tokenizers(study: Study) -> dict:
    """The word vocabulary with <unk> for the words it lacks against the same vocabulary with BPE
    pieces for them (the fourth report's scheme): <unk> rate and tokens per word on validation."""
    tc = study.cfg.tokenizer
    if tc.type != "word":
        return {"missing": f"the comparison is of word-level tokenizers; this run's tokenizer is {tc.type}"}
    train, valid = study.texts("train"), study.valid_texts
    rows = []
    for oov in ("unk", "bpe"):
        t0 = time.perf_counter()
        tok = train_from_config(dataclasses.replace(tc, oov=oov), train)
        seconds = time.perf_counter() - t0
        ids = [tok.encode(t) for t in valid]
        n_tokens, n_words = sum(map(len, ids)), sum(len(tok.split(t)) for t in valid)
        kept = sum(tok.decode(i) == tok.normalize(t) for i, t in zip(ids, valid))
        rows.append(
            {
                "oov": oov,
                "vocab_size": tok.vocab_size,
                "words_in_vocabulary": len(tok.words),
                "unk_rate": sum(x == tok.unk_id for doc in ids for x in doc) / max(n_tokens, 1),
                "tokens_per_word": n_tokens / max(n_words, 1),
                "stories_restored": kept / max(len(valid), 1),
                "train_seconds": seconds,
            }
        )
    return {"rows": rows, "stories": len(valid), "oov_merges": tc.oov_merges, "configured": tc.oov}


HEAD_PATTERNS = {  # what a head can attend to, as the key's offset from the query (None: the first token)
    "the previous token": -1,
    "the first token (<sos>)": None,
    "its own token": 0,
}


def head_patterns(weights: list[np.ndarray]) -> list[dict]:
    """For each pattern of HEAD_PATTERNS, the head that follows it most: the mean weight its queries
    put on that key (queries from the third token on, where the first, previous and own tokens differ)."""
    found = []
    for pattern, offset in HEAD_PATTERNS.items():
        best = None
        for layer, w in enumerate(weights):  # (H, T, T)
            queries = np.arange(2, w.shape[-1])
            if not len(queries):
                return []
            keys = np.zeros_like(queries) if offset is None else queries + offset
            share = w[:, queries, keys].mean(-1)  # (H,)
            head = int(share.argmax())
            if best is None or share[head] > best["weight"]:
                best = {"pattern": pattern, "layer": layer, "head": head, "weight": float(share[head])}
        found.append(best)
    return found


def part_attention(study: Study) -> dict:
    model, tok = study.model
    out_dir = study.run_dir / "attention"
    rows = []
    for i, text in enumerate(study.exp.attention_texts):
        try:
            maps = attention_maps(model, tok, text)
        except TinyLMError as exc:
            rows.append({"text": text, "missing": str(exc)})
            continue
        pngs = save_attention_pngs(maps, out_dir, prefix=f"text{i}")
        page = attention_html(maps, out_dir / f"text{i}.html")
        row_sum_err = max(float(abs(w.sum(-1) - 1).max()) for w in maps.weights)
        above = max(float(np.abs(np.triu(w, k=1)).max()) for w in maps.weights)
        rows.append(
            {
                "text": text,
                "tokens": maps.tokens,
                "layers": maps.n_layers,
                "heads": maps.n_heads,
                "pngs": [str(p.relative_to(study.run_dir)) for p in pngs],
                "html": str(page.relative_to(study.run_dir)),
                "max_row_sum_error": row_sum_err,
                "max_weight_above_diagonal": above,
                "clearest_heads": head_patterns(maps.weights),
            }
        )
    return {"texts": rows}


def part_curves(study: Study) -> dict:
    return {"png": plot_curves(study.run_dir / "metrics.csv", study.run_dir / "curves.png", title="baseline").name}


def machine_info(threads: int | None = None) -> dict:
    import cpuinfo  # deferred: slow to import, and get_cpu_info() probes the CPU in a subprocess

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpuinfo.get_cpu_info().get("brand_raw") or platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def part_machine(study: Study) -> dict:
    return {**machine_info(study.threads), "train_threads": study.threads, "decode_threads": study.exp.decode_threads}


def _tradeoffs(
    study: Study,
    micro_batches: int | None = None,
    repeats: int | None = None,
    whole_split: bool = False,
    batch_size: int | None = None,
    continued: bool = False,
    compile: bool | None = None,
    reuse_finished: bool = False,
) -> Tradeoffs:
    """The trade-off runs' shared settings, in the judged run's config: on the first
    ``tradeoff_stories`` training stories unless ``whole_split``; ``continued``: from the judged
    model's checkpoint when experiments.tradeoff_start is trained."""
    torch.set_num_threads(study.threads)
    cfg, exp = study.judged_cfg, study.exp
    if batch_size:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch_size))
    prepared = study.prepared
    if exp.tradeoff_stories and not whole_split:
        prepared = first_stories(prepared, exp.tradeoff_stories)
    init_from = None
    if continued and exp.tradeoff_start == "trained":
        checkpoints = study.judged_dir / "checkpoints"
        init_from = str(checkpoints / result_checkpoint(checkpoints))
    return Tradeoffs(
        cfg,
        prepared,
        study.run_dir / "tradeoffs",
        micro_batches or exp.tradeoff_micro_batches,
        exp.tradeoff_repeats if repeats is None else repeats,
        study.threads,
        init_from=init_from,
        lr_scale=exp.tradeoff_lr_scale if init_from else 1.0,
        compile=compile,
        eval_batches=exp.tradeoff_eval_batches,
        reuse_finished=reuse_finished,
    )


def _start(study: Study, tradeoffs: Tradeoffs) -> dict:
    """Where the runs start: the judged run's checkpoint and its validation loss, or a fresh model."""
    if not tradeoffs.init_from:
        return {"from": "scratch"}
    return {
        "from": str(Path(tradeoffs.init_from).relative_to(study.run_dir)),
        "val_loss": start_val_loss(tradeoffs),
        "lr_scale": tradeoffs.lr_scale,
    }


def part_accumulation(study: Study) -> dict:
    """Accumulation k = 1, 2, 4, 8 compared at equal tokens and at equal optimizer updates, whole
    epochs of the trade-off split each, one run per setting; time per epoch measured."""
    exp = study.exp
    tradeoffs = _tradeoffs(study, repeats=1, batch_size=exp.accum_micro_batch, continued=True)
    start = _start(study, tradeoffs)
    rows = alternated_runs(tradeoffs, accumulation_variants(exp.accum_steps, exp.accum_epochs))
    png = figures.accumulation_curves(rows, tradeoffs.out_dir, study.run_dir / "accumulation.png", start)
    return {
        "threads": study.threads,
        "start": start,
        "compile": tradeoffs.cfg.train.compile,
        "context_length": tradeoffs.cfg.model.context_length,
        "repeats": 1,
        "rows": rows,
        "png": png.name,
        "epochs": exp.accum_epochs,
        "train_stories": tradeoffs.prepared.splits["train"].n_docs,
        "all_train_stories": study.prepared.splits["train"].n_docs,
    }


def part_checkpointing(study: Study) -> dict:
    """Plain training against tinylm's and torch's checkpointing, eager (as the reports ran it: the
    compiler makes its own recomputation choices), alternated rounds of each."""
    tradeoffs = _tradeoffs(study, continued=True, compile=False)
    start = _start(study, tradeoffs)
    rows = alternated_runs(
        tradeoffs,
        [
            Variant("plain"),
            Variant("ckpt_tinylm", "tinylm checkpointing", checkpointing="tinylm"),
            Variant("ckpt_torch", "torch.utils.checkpoint", checkpointing="torch"),
        ],
    )
    plain = rows[0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / plain["seconds"]
        if row["peak_activation_bytes"] and plain["peak_activation_bytes"]:
            row["memory_ratio"] = row["peak_activation_bytes"] / plain["peak_activation_bytes"]
    png = figures.checkpointing_bars(rows, study.run_dir / "checkpointing.png")
    return {
        "threads": study.threads,
        "start": start,
        "repeats": study.exp.tradeoff_repeats,
        "rows": rows,
        "png": png.name,
    }


def part_embedding_init(study: Study) -> dict:
    """Pretrained (or corpus-trained) FastText rows, frozen or fine-tuned, against a random
    initialisation, at an equal number of steps."""
    emb = study.judged_cfg.embeddings
    kind = emb.kind if emb.kind != "none" else "train"
    source = {"kind": kind, "path": emb.path}
    variants = [
        Variant("fasttext_finetuned", "FastText fine-tuned", embeddings={**source, "freeze": False}),
        Variant("random_init", "random init", embeddings={"kind": "none", "freeze": False}),
    ]
    notes = []
    if study.judged_cfg.model.tie_weights:
        notes.append(
            "frozen FastText is left out: model.tie_weights=true would freeze the output layer too "
            "(set model.tie_weights=false to compare it)"
        )
    else:
        variants.insert(0, Variant("fasttext_frozen", "FastText frozen", embeddings={**source, "freeze": True}))
    # about 30 minutes a run on a 2-core CPU: a stopped part resumes after its last finished run
    tradeoffs = _tradeoffs(study, study.exp.embedding_micro_batches, repeats=1, whole_split=True, reuse_finished=True)
    rows = alternated_runs(tradeoffs, variants)
    for row in rows:
        report = read_json(tradeoffs.out_dir / row["run_dir"] / "embeddings.json")
        row["coverage"] = report.get("coverage") if isinstance(report, dict) else None
        row["vectors"] = report.get("source") if isinstance(report, dict) else None
    png = figures.embedding_curves(rows, tradeoffs.out_dir, study.run_dir / "embedding_init.png")
    return {
        "threads": study.threads,
        "model": f"{tradeoffs.cfg.model.n_layers} x {tradeoffs.cfg.model.d_model}",
        "tokens_per_step": tradeoffs.cfg.train.batch_size * tradeoffs.cfg.model.context_length,
        "rows": rows,
        "notes": notes,
        "png": png.name,
        "steps": study.exp.embedding_micro_batches,
    }


PARTS: dict[str, Callable[[Study], dict]] = {
    "baseline": part_baseline,
    "tinylm_settings": part_tinylm_settings,
    "bleu": part_bleu,
    "decoding": part_decoding,
    "fluency": part_fluency,
    "generations": part_generations,
    "kv_cache": part_kv_cache,
    "accumulation": part_accumulation,
    "checkpointing": part_checkpointing,
    "embedding_init": part_embedding_init,
    "protocols": part_protocols,
    "tokenizers": part_tokenizers,
    "attention": part_attention,
    "curves": part_curves,
    "machine": part_machine,
}


TRAINING_PARTS = ("baseline", "tinylm_settings")


CONTINUED_PARTS = ("accumulation", "checkpointing")  # continue from the judged model (tradeoff_start: trained)
MODEL_FREE_PARTS = ("tokenizers", "machine")  # read no trained model

# experiments options that only some parts read: every other part's key leaves them out, so a
# change to the trade-off runs does not send the quality parts back to work (options not named
# here are in every part's key)
OPTION_READERS = {
    "accum_steps": ("accumulation",),
    "accum_epochs": ("accumulation",),
    "accum_micro_batch": ("accumulation",),
    "tradeoff_stories": ("accumulation", "checkpointing"),
    "tradeoff_micro_batches": ("checkpointing",),
    "tradeoff_repeats": ("checkpointing",),
    "tradeoff_start": ("accumulation", "checkpointing"),
    "tradeoff_lr_scale": ("accumulation", "checkpointing"),
    "tradeoff_eval_batches": ("accumulation", "checkpointing", "embedding_init"),
    "embedding_micro_batches": ("embedding_init",),
    "judge": ("fluency",),
}


def trained_by(study: Study, name: str) -> str | None:
    """The training part whose model part ``name`` reads (None for a training part itself, and for
    the embedding comparison in the column's settings, which trains its own models from scratch)."""
    column = bool(study.exp.tinylm_settings)
    if name in TRAINING_PARTS or name in MODEL_FREE_PARTS or (name == "embedding_init" and column):
        return None
    if name in CONTINUED_PARTS and study.exp.tradeoff_start == "scratch":
        return None if column else "baseline"
    judged = name in QUALITY_PARTS or name in CONTINUED_PARTS
    return "tinylm_settings" if judged and column else "baseline"


def part_key(study: Study, name: str, stamps: dict[str, str], finished: dict | None = None) -> str:
    payload = {"part": name, "run": study.cfg.to_dict(), "quick": study.quick}
    if name == "tinylm_settings":
        payload["column"] = study.exp.tinylm_settings
    elif name != "baseline":
        options = dataclasses.asdict(study.exp).items()
        payload["experiments"] = {k: v for k, v in options if name in OPTION_READERS.get(k, (name,))}
        payload["trained"] = stamps.get(trained_by(study, name))
    if name == "fluency":
        payload["judge"] = judge_stamp(study.exp.judge)  # retrained at the same path: scored again
    if name == "machine":
        payload["finished"] = finished  # re-described whenever any other part ran again
    return stage_key(payload)


def _run_part(study: Study, name: str, stage: Stage) -> tuple[dict, str]:
    """(the part's result, its status): reused when its file holds the same key, else computed and
    saved; a TinyLMError of any part but a training part is saved as its error, run again next time."""
    result = stage.fresh()
    if result is not None:
        log.info(f"experiments: {name}: cached ({name}.json)")
        return result, "cached"
    log.info(f"experiments: {name} ...")

    def compute() -> dict:
        try:
            result = PARTS[name](study)
            if trained_by(study, name) == "tinylm_settings":
                result["judged"] = study.column_dir.name  # the report says which model each part judged
        except TinyLMError as exc:
            if name in TRAINING_PARTS:
                raise
            log.info(f"experiments: {name}: {exc}")
            result = {"error": str(exc)}
        return {**result, "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}

    result = stage.compute(compute)
    if result.get("error"):
        return result, f"failed: {result['error']}"
    return result, ("missing: " + result["missing"] if result.get("missing") else "done")


def run_experiments(
    cfg: RunConfig,
    exp: ExperimentsConfig,
    run_dir: str | Path,
    quick: bool = False,
    only: list[str] | None = None,
    command: str | None = None,
) -> dict:
    """Run (or resume) every part, then write report.md and report.html. Returns the manifest."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    unknown = [p for p in (only or []) if p not in PARTS]
    if unknown:
        raise TinyLMError(f"unknown experiment part(s) {', '.join(unknown)}; parts are {', '.join(PARTS)}")
    study = Study(cfg, exp, run_dir, quick)
    t_start = time.perf_counter()
    manifest = {"quick": quick, "command": command, "parts": {}, "experiments": dataclasses.asdict(exp)}
    wanted = set(only or PARTS)
    wanted |= {trained_by(study, name) for name in wanted} - {None}  # a part's model is trained (or cached) first
    stamps, finished = {}, {}
    for name in PARTS:
        stage = Stage(run_dir / f"{name}.json", part_key(study, name, stamps, finished))
        if name not in wanted:
            saved = stage.saved()
            manifest["parts"][name] = (
                "not requested" if not saved else ("done" if saved.get("key") == stage.key else "stale")
            )
            finished[name] = (saved or {}).get("finished_utc")
            if name in TRAINING_PARTS and saved and saved.get("key") == stage.key:  # its model still stands
                stamps[name] = f"{stage.key}@{saved.get('finished_utc')}"
            continue
        result, manifest["parts"][name] = _run_part(study, name, stage)
        if name in TRAINING_PARTS:
            stamps[name] = f"{stage.key}@{result.get('finished_utc')}"
        finished[name] = result.get("finished_utc")
    manifest["seconds"] = round(time.perf_counter() - t_start, 2)
    (run_dir / "experiments.json").write_text(json.dumps(manifest, indent=2))

    md, html, _ = write_experiments_report(run_dir)
    log.info(f"experiments: finished in {manifest['seconds']:.0f} s; report: {md} and {html}")
    return manifest
