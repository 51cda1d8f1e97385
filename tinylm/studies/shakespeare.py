"""`tinylm study shakespeare`: tokenizers -> n-grams -> neural bigram -> GPT, one table.

Four stages on the same train/valid/test split of the corpus (contiguous chunks spread over every
play, tinylm.data.splits.split_chunks), one tokenizer at a time:

1. tokenizers: BPE (byte-level ``bpe``, or the report's word-level ``word_bpe`` with one or more
   normalisations) for each merge count, characters, words; tokens per word and exact
   reconstruction on every split, the compression table between merge counts, and a check of how
   many lines of one split occur verbatim in another;
2. n-gram LMs of each order: add-1, add-0.1, Jelinek-Mercer interpolation (weights by EM on
   validation, or fixed), interpolated modified Kneser-Ney; one ``<sos>`` or n-1 of them;
3. the neural bigram: a learning-rate sweep and an embedding x weight-decay grid (on the first
   tokenizer, or on each), the best setting kept;
4. GPTs of each configured size trained by tinylm.training.trainer.train, on all or a fraction of
   the data, with a context that fits every split (a split shorter than one context window is an
   error, never an infinite perplexity).

Every setting is a StudyConfig field, read from a preset (``shakespeare-study``: tinylm's stronger
defaults; ``shakespeare-report``: the settings of the four-stage report) and ``key=value``
overrides. Every model is scored the same way: each document from its ``<sos>``, every token after
it, not ``<eos>``. Token perplexities are not comparable across tokenizers; bits per byte (total
NLL / (ln 2 * UTF-8 bytes of the text the tokens stand for)) are, for tokenizers of the same text.

Each stage of each tokenizer is saved as ``<tokenizer>/stage-<name>.json`` with the settings it
depends on; a rerun with the same settings reuses it, so an interrupted study resumes by stage.
Outputs: ``results.csv``, ``results.md``, ``learning_curves.png``, ``bigram_curves/*.png``,
``samples.md``, ``study.json`` (tinylm.studies.shakespeare_report).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tinylm.config import ModelConfig, RunConfig, apply_updates, parse_overrides, read_config
from tinylm.constants import SOS_ID, UNK_ID
from tinylm.data.cleaning import clean_documents
from tinylm.data.prepare import load_raw_documents, prepare
from tinylm.data.splits import line_overlap
from tinylm.data.tokens import TokenSplit
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_split, metrics
from tinylm.models.bigram import BigramConfig, train_bigram
from tinylm.models.checkpoint import load_checkpoint
from tinylm.models.ngram import NGramLM
from tinylm.pipeline import sample_prompts
from tinylm.studies.shakespeare_report import write_outputs
from tinylm.tokenizers.word_bpe import EOW_ID
from tinylm.training.metrics import read_metrics
from tinylm.training.trainer import train

log = logging.getLogger(__name__)


@dataclass
class StudyConfig:
    out_dir: str = "runs/study-shakespeare"
    source: str = "shakespeare"  # or "text" with train_path (a .jsonl of documents; used by the tests)
    train_path: str | None = None
    max_documents: int | None = None  # the first N works only
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    # Task 1: tokenizers
    bpe_type: str = "bpe"  # bpe (byte-level) | word_bpe (the report's: characters of words, end-of-word token)
    bpe_merges: list[int] = field(default_factory=lambda: [1000, 2000, 3000])
    normalizations: list[str] = field(default_factory=lambda: ["lower_nopunct"])  # word_bpe; models use the first
    model_merges: list[int] | None = None  # merge counts that go on to stages 2-4 (None: all)
    char: bool = True
    word: bool = True
    word_vocab: int = 8000  # words beyond the most frequent 8000 become <unk>
    overlap_sample: int = 100  # lines sampled per split pair for the verbatim overlap check
    # Task 2: n-grams
    orders: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    smoothings: list[str] = field(default_factory=lambda: ["laplace", "add_0.1", "interpolated", "kneser_ney"])
    start_padding: str = "single"  # single <sos> (KenLM) | order: n-1 <sos> (the report)
    fixed_weights: list[float] = field(default_factory=lambda: [0.01, 0.1, 0.2, 0.3, 0.4])  # uniform, 1-gram, ...
    # Task 3: neural bigram
    bigram_lrs: list[float] = field(default_factory=list)  # learning-rate sweep (with bigram_lr_d_embed, no decay)
    bigram_lr_d_embed: int = 64
    bigram_d_embeds: list[int] = field(default_factory=lambda: [32, 128])  # grid, at bigram_grid_lr
    bigram_weight_decays: list[float] = field(default_factory=lambda: [0.0, 0.1])
    bigram_grid_lr: float = 1e-2
    bigram_batch_size: int = 2048
    bigram_mode: str = "auto"  # auto | counts (full-batch pair counts) | pairs (minibatches)
    bigram_schedule: str = "cosine"  # cosine (warmup, decay to lr/10) | constant
    bigram_max_steps: int = 3000
    bigram_max_seconds: float = 60.0
    bigram_eval_interval: int | None = None  # None: max_steps / 30
    bigram_patience: int = 4  # evaluations without improvement
    bigram_sweep_on: str = "first"  # first (its best setting for the others) | all
    # Task 4: GPT
    gpt: bool = True
    gpt_sizes: list[str] = field(default_factory=lambda: ["base=4x192x6"])  # name=LAYERSxD_MODELxHEADS
    gpt_tokenizers: list[str] | None = None  # tokenizer names that get GPTs (None: every modelled one)
    gpt_data_fraction: float = 1.0  # the first fraction of each split's tokens
    context_length: int = 128
    dropout: float = 0.1
    gpt_batch_size: int = 32
    gpt_max_steps: int = 3000
    gpt_minutes: float = 6.0  # wall-clock budget per GPT
    gpt_lr: float = 2e-3
    gpt_eval_interval: int = 50
    gpt_eval_batches: int = 20
    threads: int = 1  # torch threads; 1 is the fastest on a CPU shared with other jobs (see the notes)
    prompts: list[str] = field(default_factory=lambda: ["ROMEO:", "To be, or not to be", "KING HENRY.\nOnce more"])
    sample_tokens: int = 60
    temperature: float = 0.8
    seed: int = 1337
    compare_with: str | None = None  # another study's directory, for the summary's "tinylm best" column


def load_study_config(spec: str | None = "shakespeare-study", overrides: list[str] | None = None,
                      quick: bool = False) -> StudyConfig:
    """StudyConfig defaults <- the file or preset (its quick section too with ``quick``) <- ``key=value``."""
    cfg = StudyConfig()
    apply_updates(cfg, read_config(spec, quick))
    if overrides:
        apply_updates(cfg, parse_overrides(overrides))
    return cfg


SMOOTHING_K = {"laplace": ("add_k", 1.0), "add_0.1": ("add_k", 0.1), "interpolated": ("interpolated", 1.0),
               "interpolated_fixed": ("interpolated", 1.0), "kneser_ney": ("kneser_ney", 1.0)}
DATA_FIELDS = ("source", "train_path", "max_documents", "valid_fraction", "test_fraction")
SAMPLE_FIELDS = ("prompts", "sample_tokens", "temperature", "seed")
STAGE_FIELDS = {"tokenizer": DATA_FIELDS + ("word_vocab",),
                "ngram": DATA_FIELDS + SAMPLE_FIELDS + ("orders", "smoothings", "start_padding", "fixed_weights"),
                "bigram": DATA_FIELDS + SAMPLE_FIELDS,  # + every bigram_* field
                "gpt": DATA_FIELDS + SAMPLE_FIELDS + ("context_length", "dropout")}  # + every gpt_* field


@dataclass
class TokenizerSpec:
    name: str
    kind: str
    vocab_size: int = 0
    merges: int | None = None
    normalization: str = "lower_nopunct"
    modelled: bool = True  # goes on to stages 2-4


def parse_size(spec: str) -> tuple[str, int, int, int]:
    """``"small=6x256x8"`` -> ("small", layers, d_model, heads)."""
    try:
        name, dims = spec.split("=")
        layers, d_model, heads = (int(v) for v in dims.lower().split("x"))
    except ValueError:
        raise TinyLMError(f"GPT size {spec!r} is not of the form name=LAYERSxD_MODELxHEADS (e.g. small=6x256x8)") from None
    if min(layers, d_model, heads) < 1 or d_model % heads:
        raise TinyLMError(f"GPT size {spec!r}: layers, d_model and heads must be >= 1, d_model a multiple of heads")
    return name, layers, d_model, heads


def tokenizer_specs(cfg: StudyConfig) -> list[TokenizerSpec]:
    """Every tokenizer of the study, the modelled ones first."""
    bad = [m for m in cfg.bpe_merges if m < 1]
    if bad:
        raise TinyLMError(f"BPE merges must be at least 1 (got {bad[0]})")
    modelled = cfg.bpe_merges if cfg.model_merges is None else cfg.model_merges
    if set(modelled) - set(cfg.bpe_merges):
        raise TinyLMError(f"model_merges {modelled} must be among bpe_merges {cfg.bpe_merges}")
    if cfg.bpe_type == "bpe":
        specs = [TokenizerSpec(f"bpe-{m}", "bpe", 260 + m, modelled=m in modelled) for m in cfg.bpe_merges]
    elif cfg.bpe_type == "word_bpe":
        if not cfg.normalizations:
            raise TinyLMError("word_bpe needs at least one normalization (lower_nopunct, aggressive, none)")
        specs = [TokenizerSpec(f"word_bpe-{m}" + ("" if i == 0 else f"-{norm}"), "word_bpe", merges=m,
                               normalization=norm, modelled=i == 0 and m in modelled)
                 for i, norm in enumerate(cfg.normalizations) for m in cfg.bpe_merges]
    else:
        raise TinyLMError(f"bpe_type {cfg.bpe_type!r} is not one of bpe, word_bpe")
    if cfg.char:
        specs.append(TokenizerSpec("char", "char"))
    if cfg.word:
        specs.append(TokenizerSpec("word", "word", cfg.word_vocab))
    if not specs:
        raise TinyLMError("the study has no tokenizer (give bpe_merges or enable char/word)")
    return sorted(specs, key=lambda s: not s.modelled)


def check_context_fits(splits: dict, context_length: int) -> None:
    """A split shorter than one context window cannot be scored like the others: refuse it."""
    for name, split in splits.items():
        if split.n_tokens < context_length + 1:
            raise TinyLMError(f"the {name} split has {split.n_tokens} tokens, fewer than one context window "
                              f"({context_length + 1}); use a smaller context_length or more data")


def run_config(cfg: StudyConfig, spec: TokenizerSpec, out_dir: Path) -> RunConfig:
    rc = RunConfig(out_dir=str(out_dir))
    rc.data.source, rc.data.train = cfg.source, cfg.train_path
    rc.data.split_by, rc.data.max_documents = "chunk", cfg.max_documents
    rc.data.valid_fraction, rc.data.test_fraction = cfg.valid_fraction, cfg.test_fraction
    rc.tokenizer.type, rc.tokenizer.vocab_size = spec.kind, spec.vocab_size
    rc.tokenizer.merges, rc.tokenizer.normalization = spec.merges, spec.normalization
    t = rc.train
    t.batch_size, t.max_steps, t.max_minutes, t.lr, t.min_lr = cfg.gpt_batch_size, cfg.gpt_max_steps, cfg.gpt_minutes, cfg.gpt_lr, cfg.gpt_lr / 10
    t.warmup_steps = max(1, min(100, cfg.gpt_max_steps // 10))
    t.eval_interval, t.eval_batches, t.log_interval = cfg.gpt_eval_interval, cfg.gpt_eval_batches, cfg.gpt_eval_interval
    t.early_stopping_patience, t.threads, t.progress, t.seed, t.device = 3, cfg.threads, False, cfg.seed, "cpu"
    rc.sample.prompts, rc.sample.max_new_tokens, rc.sample.temperature = list(cfg.prompts), cfg.sample_tokens, cfg.temperature
    return rc


def _row(tok_name, vocab, model, order, setting, params, valid, test, seconds) -> dict:
    return {"tokenizer": tok_name, "vocab_size": vocab, "model": model, "order": order, "smoothing": setting,
            "parameters": params, "valid_ppl": valid["token_ppl"], "test_ppl": test["token_ppl"],
            "valid_bpb": valid["bpb"], "test_bpb": test["bpb"], "valid_tokens": valid["tokens"],
            "test_tokens": test["tokens"], "seconds": round(seconds, 2)}


def _split_metrics(nll_and_count, split) -> dict:
    nll, n = nll_and_count
    if not math.isfinite(nll):
        raise TinyLMError(f"a model gave an infinite loss on the {split.name} split")
    return metrics(nll, n, split.n_bytes, split.n_words)


def _stage_key(cfg: StudyConfig, stage: str, spec: TokenizerSpec, extra=None) -> str:
    values = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k in STAGE_FIELDS[stage] or k.startswith(f"{stage}_")}
    payload = json.dumps([values, dataclasses.asdict(spec), extra], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cached_stage(path: Path, key: str, run, say) -> dict:
    """``run()``'s result, or the one saved at ``path`` by an earlier run with the same ``key``;
    ``result["seconds"]`` is the wall time of the run that computed it."""
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            say(f"reusing {path.parent.name}/{path.name}")
            return saved["result"]
    t0 = time.perf_counter()
    result = run()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "result": result}, default=float))
    os.replace(tmp, path)
    return result


def split_stats(tok, split: TokenSplit, docs: list[str]) -> dict:
    """Tokens per word and exact reconstruction of one split. For word_bpe, tokens per word counts
    the pieces of words, not the end-of-word token after each (the report's definition)."""
    ids = np.asarray(split.ids)
    content = int(np.count_nonzero(ids >= 4))
    if tok.type_name == "word_bpe":
        content -= int(np.count_nonzero(ids == EOW_ID))
    exact = sum(tok.decode(tok.encode(d)) == tok.represented(d) for d in docs)
    return {"tokens": split.n_tokens, "tokens_per_word": content / max(split.n_words, 1),
            "bytes_per_token": split.n_bytes / max(content, 1), "unk_rate": float(np.mean(ids == UNK_ID)),
            "reconstructed": exact, "documents": len(docs), "distinct_tokens": int(np.unique(ids[ids >= 4]).size)}


def stage_tokenizer(cfg, spec, prepared, docs) -> dict:
    tok, splits = prepared.tokenizer, prepared.splits
    per_split = {name: split_stats(tok, splits[name], docs[name]) for name in ("train", "valid", "test")}
    return {"tokenizer": spec.name, "type": spec.kind, "merges": spec.merges,
            "normalization": spec.normalization if spec.kind == "word_bpe" else None,
            "vocab_size": tok.vocab_size, "modelled": spec.modelled, "splits": per_split}


def _sample(tok, prompt: str, new_ids: list[int]) -> str:
    """The prompt as the model saw it (normalised by word_bpe) and what the new tokens add."""
    return tok.represented(prompt) + tok.decode_continuation([SOS_ID, *tok.encode(prompt)], new_ids)


def stage_ngram(cfg, spec, tok, splits, ids, say) -> dict:
    out = {"rows": [], "samples": []}
    V = tok.vocab_size
    for order in cfg.orders:
        t0 = time.perf_counter()
        counted = NGramLM(order, V, "kneser_ney", start_padding=cfg.start_padding).fit(ids["train"])
        t_count = time.perf_counter() - t0
        for name in cfg.smoothings:
            if name not in SMOOTHING_K:
                raise TinyLMError(f"unknown smoothing {name!r}; choose from {', '.join(SMOOTHING_K)}")
            t1 = time.perf_counter()
            smoothing, k = SMOOTHING_K[name]
            lm = counted.smoothed(smoothing, k)
            if name == "interpolated":
                lm.fit_weights(ids["valid"])
            elif name == "interpolated_fixed":
                if len(cfg.fixed_weights) < order + 1:
                    raise TinyLMError(f"fixed_weights needs {order + 1} weights (uniform, unigram, ...) for order {order}")
                lm.set_weights(cfg.fixed_weights[: order + 1])
            valid = _split_metrics(lm.score(ids["valid"]), splits["valid"])
            test = _split_metrics(lm.score(ids["test"]), splits["test"])
            out["rows"].append(_row(spec.name, V, "ngram", order, name, None, valid, test,
                                    t_count + time.perf_counter() - t1))
            for i, p in enumerate(cfg.prompts):
                new = lm.generate([SOS_ID, *tok.encode(p)], cfg.sample_tokens, cfg.temperature, seed=cfg.seed + i)
                out["samples"].append([spec.name, f"{order}-gram {name}", p, _sample(tok, p, new)])
        say(f"[{spec.name}] {order}-gram: " + ", ".join(f"{r['smoothing']} {r['valid_ppl']:.2f}"
                                                       for r in out["rows"][-len(cfg.smoothings):]))
    return out


def bigram_runs(cfg: StudyConfig) -> list[tuple[str, BigramConfig]]:
    """(label, config) of every bigram run of a sweep: the learning rates, then the grid."""
    if cfg.bigram_schedule not in ("cosine", "constant"):
        raise TinyLMError(f"bigram_schedule {cfg.bigram_schedule!r} is not one of cosine, constant")
    steps = cfg.bigram_max_steps
    base = BigramConfig(max_steps=steps, max_seconds=cfg.bigram_max_seconds, threads=1, seed=cfg.seed,
                        eval_interval=cfg.bigram_eval_interval or max(10, steps // 30), patience=cfg.bigram_patience,
                        batch_size=cfg.bigram_batch_size, mode=cfg.bigram_mode,
                        warmup_steps=0 if cfg.bigram_schedule == "constant" else min(50, steps // 10))

    def at(lr, **kw):
        min_lr = lr if cfg.bigram_schedule == "constant" else lr / 10
        return dataclasses.replace(base, lr=lr, min_lr=min_lr, **kw)
    runs = [(f"lr={lr:g} d={cfg.bigram_lr_d_embed}", at(lr, d_embed=cfg.bigram_lr_d_embed, weight_decay=0.0))
            for lr in cfg.bigram_lrs]
    runs += [(f"d={d} wd={wd:g}", at(cfg.bigram_grid_lr, d_embed=d, weight_decay=wd))
             for d in cfg.bigram_d_embeds for wd in cfg.bigram_weight_decays]
    if not runs:
        raise TinyLMError("the bigram stage has no run (give bigram_lrs or bigram_d_embeds and bigram_weight_decays)")
    return runs


def stage_bigram(cfg, spec, tok, splits, ids, best_from_first, say) -> dict:
    """Every run of the sweep (or the first tokenizer's best setting), scored on valid and test."""
    V = tok.vocab_size
    runs = bigram_runs(cfg)
    if best_from_first is not None:
        runs = [r for r in runs if r[0] == best_from_first]
    out = {"runs": [], "samples": []}
    best = None
    for label, bcfg in runs:
        result = train_bigram(ids["train"], ids["valid"], V, bcfg)
        valid = _split_metrics(result.model.score(ids["valid"]), splits["valid"])
        test = _split_metrics(result.model.score(ids["test"]), splits["test"])
        out["runs"].append({"tokenizer": spec.name, "label": label, "lr": bcfg.lr, "d_embed": bcfg.d_embed,
                            "weight_decay": bcfg.weight_decay, "batch_size": bcfg.batch_size,
                            "best_val_loss": result.best_val_loss, "valid_ppl": valid["token_ppl"],
                            "test_ppl": test["token_ppl"], "valid_bpb": valid["bpb"], "test_bpb": test["bpb"],
                            "steps": result.steps, "stopped": result.stopped_because,
                            "seconds": round(result.seconds, 2), "history": result.history})
        say(f"[{spec.name}] neural bigram {label}: valid ppl {valid['token_ppl']:.2f} ({result.steps} steps, "
            f"{result.stopped_because})")
        if best is None or result.best_val_loss < best[0].best_val_loss:
            best = (result, label, valid, test)
    result, label, valid, test = best
    out["best"] = label
    out["row"] = _row(spec.name, V, "neural_bigram", 2, label, result.model.num_parameters(), valid, test,
                      sum(r["seconds"] for r in out["runs"]))
    for i, p in enumerate(cfg.prompts):
        new = result.model.generate([SOS_ID, *tok.encode(p)], cfg.sample_tokens, cfg.temperature, seed=cfg.seed + i)
        out["samples"].append([spec.name, f"neural bigram {label}", p, _sample(tok, p, new)])
    return out


def head_of_split(split: TokenSplit, fraction: float, tok) -> TokenSplit:
    """The first ``fraction`` of a split's tokens (documents cut there), bytes and words counted
    on the decoded text (exact for tokenizers lossless on their normalised text)."""
    if fraction >= 1.0:
        return split
    n = max(2, int(round(split.n_tokens * fraction)))
    ids = np.asarray(split.ids[:n])
    offsets = np.append(split.offsets[split.offsets < n], n)
    text = tok.decode(ids.tolist())
    return TokenSplit(split.name, ids, offsets, len(text.encode("utf-8")), len(text.split()))


def stage_gpt(cfg, spec, rc, prepared, size: str, gpt_dir: Path, say) -> dict:
    name, layers, d_model, heads = parse_size(size)
    if not 0 < cfg.gpt_data_fraction <= 1:
        raise TinyLMError(f"gpt_data_fraction must be in (0, 1] (got {cfg.gpt_data_fraction})")
    rc = dataclasses.replace(rc, model=ModelConfig(context_length=cfg.context_length, d_model=d_model,
                                                   n_layers=layers, n_heads=heads, dropout=cfg.dropout))
    splits = {k: head_of_split(s, cfg.gpt_data_fraction, prepared.tokenizer) for k, s in prepared.splits.items()}
    check_context_fits(splits, cfg.context_length)
    part = dataclasses.replace(prepared, splits=splits)
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    result = train(rc, part, gpt_dir)
    model, tokenizer, _ = load_checkpoint(result.checkpoint_dir / "best")
    model.to(torch.device("cpu"))
    ev = {k: evaluate_split(model, splits[k]) for k in ("valid", "test")}
    params = model.num_parameters()
    row = _row(spec.name, tokenizer.vocab_size, "gpt", None, name, params, ev["valid"], ev["test"],
               time.perf_counter() - t0)
    curve = [{"step": r["step"], "train_loss": r["train_loss"], "val_loss": r["val_loss"]}
             for r in read_metrics(gpt_dir / "metrics.csv") if r["val_loss"] is not None]
    samples = [[spec.name, f"GPT {name}", s["prompt"], tokenizer.represented(s["prompt"]) + s["continuation"]]
               for s in sample_prompts(model, tokenizer, rc.sample)]
    run = {"tokenizer": spec.name, "size": name, "layers": layers, "d_model": d_model, "heads": heads,
           "context_length": cfg.context_length, "parameters": params, "train_tokens": splits["train"].n_tokens,
           "tokens_per_parameter": splits["train"].n_tokens / params, "data_fraction": cfg.gpt_data_fraction,
           "steps": result.steps, "stopped": result.stopped_because, "train_seconds": round(result.seconds, 1),
           "tokens_per_s": result.tokens_per_s, "tokens_seen": result.steps * cfg.gpt_batch_size * cfg.context_length,
           "valid_ppl": ev["valid"]["token_ppl"], "test_ppl": ev["test"]["token_ppl"]}
    say(f"[{spec.name}] GPT {name} ({params:,} parameters): {result.steps} steps ({result.stopped_because}), "
        f"{result.tokens_per_s:,.0f} tokens/s, valid ppl {ev['valid']['token_ppl']:.2f}, bpb {ev['valid']['bpb']:.3f}")
    return {"row": row, "run": run, "curve": curve, "samples": samples}


def load_split_documents(cfg: StudyConfig, rc: RunConfig) -> dict[str, list[str]]:
    raw = load_raw_documents(rc.data)
    return {name: clean_documents(raw[name], rc.data)[0] for name in ("train", "valid", "test")}


def run_study(cfg: StudyConfig) -> dict:
    specs = tokenizer_specs(cfg)  # every setting is checked before anything is written
    sizes = [parse_size(s)[0] for s in cfg.gpt_sizes] if cfg.gpt else []
    if cfg.gpt and cfg.gpt_tokenizers is not None:
        unknown = set(cfg.gpt_tokenizers) - {s.name for s in specs if s.modelled}
        if unknown:
            raise TinyLMError(f"gpt_tokenizers {sorted(unknown)} are not modelled tokenizers of this study")
    bigram_runs(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def say(msg):  # every line with the elapsed time, so the stage costs can be read off the log
        log.info(f"{time.perf_counter() - start:7.1f}s {msg}")
    state = {"rows": [], "tokenizers": [], "samples": [], "bigram_runs": [], "gpt_runs": [], "gpt_curves": [],
             "stage_seconds": {}, "overlap": None}
    torch.set_num_threads(cfg.threads)
    docs = None

    def timed(stage, fn):  # a stage's wall time as computed, also when it is reused
        result = fn()
        state["stage_seconds"][stage] = state["stage_seconds"].get(stage, 0.0) + result["seconds"]
        return result
    best_bigram = None
    for spec in specs:
        tok_dir = out / spec.name
        rc = run_config(cfg, spec, tok_dir)
        t0 = time.perf_counter()
        prepared = prepare(rc, tok_dir)
        t_prepare = time.perf_counter() - t0
        tok, splits = prepared.tokenizer, prepared.splits
        for name in ("train", "valid", "test"):
            if name not in splits or splits[name].n_tokens < 2:
                raise TinyLMError(f"the {name} split is empty for tokenizer {spec.name}")
        if cfg.gpt and spec.modelled:  # refuse a too-short split before spending time on the other stages
            check_context_fits({k: head_of_split(s, cfg.gpt_data_fraction, tok) for k, s in splits.items()},
                               cfg.context_length)
        if docs is None:
            docs = load_split_documents(cfg, rc)
            state["overlap"] = {f"{a}-{b}": line_overlap(docs[a], docs[b], cfg.overlap_sample, seed=cfg.seed)
                                for a, b in (("train", "valid"), ("train", "test"), ("valid", "test"))}
        # the tokenizer stage includes training it (prepare), whose cache is reused on reruns
        stats = timed("1 tokenizers", lambda: cached_stage(
            tok_dir / "stage-tokenizer.json", _stage_key(cfg, "tokenizer", spec),
            lambda: {**stage_tokenizer(cfg, spec, prepared, docs), "prepare_seconds": round(t_prepare, 1)}, say))
        state["stage_seconds"]["1 tokenizers"] += stats.get("prepare_seconds", 0.0)
        state["tokenizers"].append(stats)
        v = stats["splits"]["valid"]
        say(f"[{spec.name}] {tok.vocab_size} tokens, {v['tokens_per_word']:.3f} tokens per word (valid), "
            f"reconstruction {v['reconstructed']}/{v['documents']}")
        if not spec.modelled:
            continue
        ids = {name: np.asarray(s.ids, dtype=np.int64) for name, s in splits.items()}
        ngram = timed("2 n-grams", lambda: cached_stage(
            tok_dir / "stage-ngram.json", _stage_key(cfg, "ngram", spec),
            lambda: stage_ngram(cfg, spec, tok, splits, ids, say), say))
        state["rows"] += ngram["rows"]
        state["samples"] += ngram["samples"]
        fixed = best_bigram if cfg.bigram_sweep_on == "first" else None
        bigram = timed("3 neural bigram", lambda: cached_stage(
            tok_dir / "stage-bigram.json", _stage_key(cfg, "bigram", spec, fixed),
            lambda: stage_bigram(cfg, spec, tok, splits, ids, fixed, say), say))
        best_bigram = best_bigram or bigram["best"]
        state["rows"].append(bigram["row"])
        state["bigram_runs"] += bigram["runs"]
        state["samples"] += bigram["samples"]
        if cfg.gpt and (cfg.gpt_tokenizers is None or spec.name in cfg.gpt_tokenizers):
            for size, size_name in zip(cfg.gpt_sizes, sizes):
                gpt = timed("4 GPT", lambda: cached_stage(
                    tok_dir / f"stage-gpt-{size_name}.json", _stage_key(cfg, "gpt", spec, size),
                    lambda: stage_gpt(cfg, spec, rc, prepared, size, tok_dir / f"gpt-{size_name}", say), say))
                state["rows"].append(gpt["row"])
                state["gpt_runs"].append(gpt["run"])
                state["gpt_curves"].append([f"{spec.name} {size_name}", gpt["curve"]])
                state["samples"] += gpt["samples"]
    state["seconds"] = round(time.perf_counter() - start, 1)
    write_outputs(cfg, state, out)
    say(f"study finished in {state['seconds']:.0f} s: {out}/results.md, results.csv, learning_curves.png, samples.md")
    return state
