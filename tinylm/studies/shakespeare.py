"""`tinylm study shakespeare`: tokenizers -> n-grams -> neural bigram -> GPT, one table.

Four stages on the same train/valid/test split of the corpus (contiguous chunks spread over every
play, tinylm.data.splits.split_chunks), one tokenizer at a time:

1. tokenizers: BPE with 1000/2000/3000 merges, characters, words; tokens per word and whether
   decode(encode(text)) gives the text back, on the validation split;
2. n-gram LMs of orders 1-4: Laplace (add-1), add-0.1 , Jelinek-Mercer
   interpolation (weights by EM on validation) and interpolated modified Kneser-Ney;
3. the neural bigram: a sweep over embedding size and weight decay on the first tokenizer, then
   the best setting on every tokenizer;
4. a GPT trained by tinylm.training.trainer.train with a context that fits every split (a split
   shorter than one context window is an error, never an infinite perplexity).

Every model is scored the same way: each document from its ``<sos>``, every token after it, not
``<eos>``. Token perplexities are not comparable across tokenizers (a token is a different unit
in each); bits per byte (total NLL / (ln 2 * UTF-8 bytes)) are, and the table shows both.

Outputs in the run directory: ``results.csv``, ``results.md`` (all tables), ``learning_curves.png``,
``samples.md``, ``study.json``, and per tokenizer the prepared data and the GPT run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tinylm.config import ModelConfig, RunConfig, apply_updates, parse_overrides, read_config
from tinylm.constants import SOS_ID, UNK_ID
from tinylm.data.cleaning import clean_documents
from tinylm.data.prepare import load_raw_documents, prepare
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_split, metrics
from tinylm.models.bigram import BigramConfig, sweep_bigram, train_bigram
from tinylm.models.checkpoint import load_checkpoint
from tinylm.models.ngram import NGramLM
from tinylm.pipeline import sample_prompts
from tinylm.studies.shakespeare_report import write_outputs
from tinylm.training.metrics import read_metrics
from tinylm.training.trainer import train

log = logging.getLogger(__name__)


@dataclass
class StudyConfig:
    out_dir: str = "runs/study-shakespeare"
    source: str = "shakespeare"  # or "text" with train_path (a .jsonl of documents; used by the tests)
    train_path: str | None = None
    max_documents: int | None = None
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    bpe_merges: list[int] = field(default_factory=lambda: [1000, 2000, 3000])
    char: bool = True
    word: bool = True
    word_vocab: int = 8000  # words beyond the most frequent 8000 become <unk>
    orders: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    smoothings: list[str] = field(default_factory=lambda: ["laplace", "add_0.1", "interpolated", "kneser_ney"])
    bigram_d_embeds: list[int] = field(default_factory=lambda: [32, 128])
    bigram_weight_decays: list[float] = field(default_factory=lambda: [0.0, 0.1])
    bigram_max_steps: int = 3000
    bigram_max_seconds: float = 60.0
    gpt: bool = True
    context_length: int = 128
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 6
    dropout: float = 0.1
    gpt_batch_size: int = 32
    gpt_max_steps: int = 3000
    gpt_minutes: float = 6.0  # wall-clock budget per tokenizer
    gpt_lr: float = 2e-3
    gpt_eval_interval: int = 50
    gpt_eval_batches: int = 20
    threads: int = 1  # torch threads; 1 is the fastest on a CPU shared with other jobs (see the notes)
    prompts: list[str] = field(default_factory=lambda: ["ROMEO:", "To be, or not to be", "KING HENRY.\nOnce more"])
    sample_tokens: int = 60
    temperature: float = 0.8
    seed: int = 1337


def load_study_config(spec: str | None = "shakespeare-study", overrides: list[str] | None = None,
                      quick: bool = False) -> StudyConfig:
    """StudyConfig defaults <- the file or preset (its quick section too with ``quick``) <- ``key=value``."""
    cfg = StudyConfig()
    apply_updates(cfg, read_config(spec, quick))
    if overrides:
        apply_updates(cfg, parse_overrides(overrides))
    return cfg


SMOOTHING_K = {"laplace": ("add_k", 1.0), "add_0.1": ("add_k", 0.1), "interpolated": ("interpolated", 1.0),
               "kneser_ney": ("kneser_ney", 1.0)}


def check_context_fits(splits: dict, context_length: int) -> None:
    """A split shorter than one context window cannot be scored like the others: refuse it."""
    for name, split in splits.items():
        if split.n_tokens < context_length + 1:
            raise TinyLMError(f"the {name} split has {split.n_tokens} tokens, fewer than one context window "
                              f"({context_length + 1}); use a smaller context_length or more data")


def tokenizer_settings(cfg: StudyConfig) -> list[tuple[str, str, int]]:
    """(name, type, vocab_size) for every tokenizer of the study."""
    bad = [m for m in cfg.bpe_merges if m < 1]
    if bad:
        raise TinyLMError(f"BPE merges must be at least 1 (got {bad[0]})")
    out = [(f"bpe-{m}", "bpe", 260 + m) for m in cfg.bpe_merges]
    if cfg.char:
        out.append(("char", "char", 0))
    if cfg.word:
        out.append(("word", "word", cfg.word_vocab))
    if not out:
        raise TinyLMError("the study has no tokenizer (give bpe_merges or enable char/word)")
    return out


def run_config(cfg: StudyConfig, tok_type: str, vocab_size: int, out_dir: Path):
    rc = RunConfig(out_dir=str(out_dir))
    rc.data.source, rc.data.train = cfg.source, cfg.train_path
    rc.data.split_by, rc.data.max_documents = "chunk", cfg.max_documents
    rc.data.valid_fraction, rc.data.test_fraction = cfg.valid_fraction, cfg.test_fraction
    rc.tokenizer.type, rc.tokenizer.vocab_size = tok_type, vocab_size
    rc.model = ModelConfig(context_length=cfg.context_length, d_model=cfg.d_model, n_layers=cfg.n_layers,
                           n_heads=cfg.n_heads, dropout=cfg.dropout)
    t = rc.train
    t.batch_size, t.max_steps, t.max_minutes, t.lr, t.min_lr = cfg.gpt_batch_size, cfg.gpt_max_steps, cfg.gpt_minutes, cfg.gpt_lr, cfg.gpt_lr / 10
    t.warmup_steps = max(1, min(100, cfg.gpt_max_steps // 10))
    t.eval_interval, t.eval_batches, t.log_interval = cfg.gpt_eval_interval, cfg.gpt_eval_batches, cfg.gpt_eval_interval
    t.early_stopping_patience, t.threads, t.progress, t.seed, t.device = 3, cfg.threads, False, cfg.seed, "cpu"
    rc.sample.prompts, rc.sample.max_new_tokens, rc.sample.temperature = list(cfg.prompts), cfg.sample_tokens, cfg.temperature
    return rc


def _row(tok_name, vocab, model, order, smoothing, params, valid, test, seconds) -> dict:
    return {"tokenizer": tok_name, "vocab_size": vocab, "model": model, "order": order, "smoothing": smoothing,
            "parameters": params, "valid_ppl": valid["token_ppl"], "test_ppl": test["token_ppl"],
            "valid_bpb": valid["bpb"], "test_bpb": test["bpb"], "valid_tokens": valid["tokens"],
            "test_tokens": test["tokens"], "seconds": round(seconds, 2)}


def _split_metrics(nll_and_count, split) -> dict:
    nll, n = nll_and_count
    if not math.isfinite(nll):
        raise TinyLMError(f"a model gave an infinite loss on the {split.name} split")
    return metrics(nll, n, split.n_bytes, split.n_words)


def _sample_text(tokenizer, prompt: str, new_ids: list[int]) -> str:
    return prompt + tokenizer.decode(new_ids)


def study_tokenizer(cfg: StudyConfig, tok_name: str, tok_type: str, vocab: int, out: Path, state: dict, say) -> None:
    """All four stages for one tokenizer; rows, curves and samples go into ``state``."""
    tok_dir = out / tok_name
    rc = run_config(cfg, tok_type, vocab, tok_dir)
    t0 = time.perf_counter()
    prepared = prepare(rc, tok_dir)
    tok, splits = prepared.tokenizer, prepared.splits
    for name in ("train", "valid", "test"):
        if name not in splits or splits[name].n_tokens < 2:
            raise TinyLMError(f"the {name} split is empty for tokenizer {tok_name}")
    if cfg.gpt:  # refuse a too-short split before spending time on the other stages
        check_context_fits(splits, cfg.context_length)
    V = tok.vocab_size
    ids = {name: np.asarray(s.ids, dtype=np.int64) for name, s in splits.items()}

    # Task 1: tokens per word and reconstruction on the validation documents
    raw = load_raw_documents(rc.data)["valid"]
    valid_docs, _ = clean_documents(raw, rc.data)
    exact = sum(tok.decode(tok.encode(d)) == d for d in valid_docs)
    vs = splits["valid"]
    state["tokenizers"].append({
        "tokenizer": tok_name, "vocab_size": V, "train_tokens": splits["train"].n_tokens,
        "valid_tokens": vs.n_tokens, "tokens_per_word": (vs.n_tokens - 2 * vs.n_docs) / max(vs.n_words, 1),
        "bytes_per_token": vs.n_bytes / max(vs.n_tokens - 2 * vs.n_docs, 1),
        "unk_rate": float(np.mean(ids["valid"] == UNK_ID)),
        "reconstructed": f"{exact}/{len(valid_docs)}", "prepare_seconds": round(time.perf_counter() - t0, 1)})
    say(f"[{tok_name}] {V} tokens, {state['tokenizers'][-1]['tokens_per_word']:.3f} tokens per word, "
        f"reconstruction {exact}/{len(valid_docs)}")

    def prompt_ids(p):
        return [SOS_ID, *tok.encode(p)]

    # Task 2: n-grams (one count per order, every smoothing on the same counts)
    for order in cfg.orders:
        t0 = time.perf_counter()
        counted = NGramLM(order, V, "kneser_ney").fit(ids["train"])
        t_count = time.perf_counter() - t0
        for name in cfg.smoothings:
            if name not in SMOOTHING_K:
                raise TinyLMError(f"unknown smoothing {name!r}; choose from {', '.join(SMOOTHING_K)}")
            t1 = time.perf_counter()
            smoothing, k = SMOOTHING_K[name]
            lm = counted.smoothed(smoothing, k)
            if smoothing == "interpolated":
                lm.fit_weights(ids["valid"])
            valid = _split_metrics(lm.score(ids["valid"]), splits["valid"])
            test = _split_metrics(lm.score(ids["test"]), splits["test"])
            state["rows"].append(_row(tok_name, V, "ngram", order, name, None, valid, test,
                                      t_count + time.perf_counter() - t1))
            if order == max(cfg.orders) and name == "kneser_ney":
                for i, p in enumerate(cfg.prompts):
                    new = lm.generate(prompt_ids(p), cfg.sample_tokens, cfg.temperature, seed=cfg.seed + i)
                    state["samples"].append((tok_name, f"{order}-gram Kneser-Ney", p, _sample_text(tok, p, new)))
        say(f"[{tok_name}] {order}-gram: " + ", ".join(f"{r['smoothing']} {r['valid_ppl']:.2f}"
                                                      for r in state["rows"][-len(cfg.smoothings):]))

    # Task 3: neural bigram (the sweep on the first tokenizer picks the setting for all)
    t0 = time.perf_counter()
    # one thread: the bigram's small matrix products slow down with two threads on a busy CPU
    base = BigramConfig(max_steps=cfg.bigram_max_steps, max_seconds=cfg.bigram_max_seconds, threads=1,
                        seed=cfg.seed, eval_interval=max(10, cfg.bigram_max_steps // 30),
                        warmup_steps=min(50, cfg.bigram_max_steps // 10), mode="auto")
    if state.get("bigram_best") is None:
        results = sweep_bigram(ids["train"], ids["valid"], V, cfg.bigram_d_embeds, cfg.bigram_weight_decays, base)
        state["bigram_sweep"] = [{"tokenizer": tok_name, "d_embed": r.config.d_embed, "weight_decay": r.config.weight_decay,
                                  "best_val_loss": r.best_val_loss, "steps": r.steps, "stopped": r.stopped_because}
                                 for r in results]
        for r in results:
            state["curves"]["bigram-sweep"].append((f"d={r.config.d_embed} wd={r.config.weight_decay}", r.history))
        best = results[0]
        state["bigram_best"] = (best.config.d_embed, best.config.weight_decay)
    else:
        d, wd = state["bigram_best"]
        best = train_bigram(ids["train"], ids["valid"], V, dataclasses.replace(base, d_embed=d, weight_decay=wd))
    state["curves"]["bigram"].append((tok_name, best.history))
    valid = _split_metrics(best.model.score(ids["valid"]), splits["valid"])
    test = _split_metrics(best.model.score(ids["test"]), splits["test"])
    state["rows"].append(_row(tok_name, V, "neural_bigram", 2, f"d={best.config.d_embed} wd={best.config.weight_decay}",
                              best.model.num_parameters(), valid, test, time.perf_counter() - t0))
    for i, p in enumerate(cfg.prompts):
        new = best.model.generate(prompt_ids(p), cfg.sample_tokens, cfg.temperature, seed=cfg.seed + i)
        state["samples"].append((tok_name, "neural bigram", p, _sample_text(tok, p, new)))
    say(f"[{tok_name}] neural bigram: valid ppl {valid['token_ppl']:.2f} ({best.steps} steps, {best.stopped_because})")

    # Task 4: the GPT, through the tinylm trainer
    if cfg.gpt:
        torch.set_num_threads(cfg.threads)
        run_gpt(cfg, rc, prepared, tok_name, V, tok_dir / "gpt", state, say)


def run_gpt(cfg: StudyConfig, rc, prepared, tok_name: str, V: int, gpt_dir: Path, state: dict, say) -> None:
    check_context_fits(prepared.splits, rc.model.context_length)
    t0 = time.perf_counter()
    result = train(rc, prepared, gpt_dir)
    model, tokenizer, _ = load_checkpoint(result.checkpoint_dir / "best")
    model.to(torch.device("cpu"))
    ev = {name: evaluate_split(model, prepared.splits[name]) for name in ("valid", "test")}
    state["rows"].append(_row(tok_name, V, "gpt", None, f"{rc.model.n_layers}x{rc.model.d_model} ctx {rc.model.context_length}",
                              model.num_parameters(), ev["valid"], ev["test"], time.perf_counter() - t0))
    curve = [{"step": r["step"], "train_loss": r["train_loss"], "val_loss": r["val_loss"]}
             for r in read_metrics(gpt_dir / "metrics.csv") if r["val_loss"] is not None]
    state["curves"]["gpt"].append((tok_name, curve))
    for s in sample_prompts(model, tokenizer, rc.sample):
        state["samples"].append((tok_name, "GPT", s["prompt"], s["prompt"] + s["continuation"]))
    say(f"[{tok_name}] gpt: {result.steps} steps ({result.stopped_because}), valid ppl {ev['valid']['token_ppl']:.2f}, "
        f"bpb {ev['valid']['bpb']:.3f}")


def run_study(cfg: StudyConfig) -> dict:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def say(msg):  # every line with the elapsed time, so the stage costs can be read off the log
        log.info(f"{time.perf_counter() - start:7.1f}s {msg}")
    state = {"rows": [], "tokenizers": [], "samples": [], "bigram_best": None, "bigram_sweep": [],
             "curves": {"gpt": [], "bigram": [], "bigram-sweep": []}}
    torch.set_num_threads(cfg.threads)
    for name, kind, vocab in tokenizer_settings(cfg):
        study_tokenizer(cfg, name, kind, vocab, out, state, say)
    state["seconds"] = round(time.perf_counter() - start, 1)

    write_outputs(cfg, state, out)
    say(f"study finished in {state['seconds']:.0f} s: {out}/results.md, results.csv, learning_curves.png, samples.md")
    return state
