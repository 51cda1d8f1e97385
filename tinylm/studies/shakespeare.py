"""`tinylm study shakespeare`: tokenizers -> n-grams -> neural bigram -> GPT, one table.

Four stages on the same train/valid/test split of the corpus (contiguous chunks spread over every
play), one tokenizer at a time: 1. the tokenizers (BPE of each merge count, characters, words):
tokens per word, exact reconstruction, verbatim overlap between splits; 2. n-gram LMs of each
order and smoothing; 3. the neural bigram's learning-rate sweep and embedding x weight-decay grid;
4. GPTs of each size trained by tinylm.training, on all or a fraction of the data, with a context
that fits every split (a split shorter than one context window is an error, never an infinite
perplexity). The settings are a StudyConfig (tinylm.studies.study_config, a section per stage).

Every model is scored the same way: each document from its ``<sos>``, every token after it, not
``<eos>``. Token perplexities are not comparable across tokenizers; bits per byte (total NLL /
(ln 2 * UTF-8 bytes of the text the tokens stand for)) are, for tokenizers of the same text.

Each stage of each tokenizer is saved as ``<tokenizer>/stage-<name>.json``, keyed by the settings
it depends on (tinylm.studies.stages), so an interrupted study resumes by stage. ``run_study`` is
the recipe; tinylm.studies.shakespeare_report writes results.md, results.csv, samples.md, the
figures and study.json.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tinylm.config import GenerationConfig, ModelConfig, RunConfig, apply_updates, check_config, parse_overrides
from tinylm.constants import EOS_ID, SOS_ID, UNK_ID
from tinylm.data.cleaning import clean_documents
from tinylm.data.prepare import PreparedData, load_raw_documents, prepare
from tinylm.data.splits import line_overlap
from tinylm.data.tokens import TokenSplit
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_split, metrics
from tinylm.generation.sampling import sample_from_context
from tinylm.models.checkpoint import load_checkpoint
from tinylm.models.ngram import NGramLM
from tinylm.pipeline import sample_prompts
from tinylm.studies.shakespeare_report import SPLITS, write_outputs
from tinylm.studies.stages import Stage, stage_key
from tinylm.studies.study_config import StudyConfig, TokenizerSpec, parse_size, tokenizer_specs
from tinylm.tokenizers.word_bpe import EOW_ID
from tinylm.training.bigram import BigramConfig, train_bigram
from tinylm.training.metrics import read_metrics
from tinylm.training.trainer import train

log = logging.getLogger(__name__)

SMOOTHING_K = {
    "laplace": ("add_k", 1.0),
    "add_0.1": ("add_k", 0.1),
    "interpolated": ("interpolated", 1.0),
    "interpolated_fixed": ("interpolated", 1.0),
    "kneser_ney": ("kneser_ney", 1.0),
}


def check_context_fits(splits: dict, context_length: int) -> None:
    """A split shorter than one context window cannot be scored like the others: refuse it."""
    for name, split in splits.items():
        if split.n_tokens < context_length + 1:
            raise TinyLMError(
                f"the {name} split has {split.n_tokens} tokens, fewer than one context window "
                f"({context_length + 1}); use a smaller gpt.context_length or more data"
            )


def run_config(cfg: StudyConfig, spec: TokenizerSpec, out_dir: Path) -> RunConfig:
    """The run config of one tokenizer's data and GPT training (tinylm.data.prepare, tinylm.training)."""
    rc, gpt, sampling = RunConfig(out_dir=str(out_dir), data=dataclasses.replace(cfg.data)), cfg.gpt, cfg.sampling
    rc.tokenizer.type, rc.tokenizer.vocab_size = spec.kind, spec.vocab_size
    rc.tokenizer.merges, rc.tokenizer.normalization = spec.merges, spec.normalization
    t = rc.train
    t.batch_size, t.max_steps, t.max_minutes = gpt.batch_size, gpt.max_steps, gpt.minutes or None
    # with a wall-clock cap the cosine ends when the cap (or max_steps) does: a capped run is a finished one
    t.schedule_clock = "wall" if gpt.minutes else "steps"
    t.lr, t.min_lr, t.warmup_steps = gpt.lr, gpt.lr / 10, max(1, min(100, gpt.max_steps // 10))
    t.eval_interval, t.eval_batches, t.log_interval = gpt.eval_interval, gpt.eval_batches, gpt.eval_interval
    # train.progress stays on: a bar on a terminal, a line per evaluation in a log file
    t.early_stopping_patience, t.threads, t.seed, t.device = gpt.patience, cfg.threads, cfg.seed, "cpu"
    rc.sample.prompts, rc.sample.max_new_tokens = list(sampling.prompts), sampling.max_new_tokens
    rc.sample.temperature = sampling.temperature
    return rc


def converged(stopped_because: str) -> bool:
    """A trained model counts as converged only when its validation loss stopped improving for the
    patience; a run ended by its step or wall-clock cap may still have been improving."""
    return stopped_because == "early_stopping"


def _row(tok_name, vocab, model, order, setting, params, valid, test, seconds, is_converged=True) -> dict:
    """One model's scores; n-grams are fitted in closed form, so they are always converged."""
    return {
        "tokenizer": tok_name,
        "vocab_size": vocab,
        "model": model,
        "order": order,
        "smoothing": setting,
        "parameters": params,
        "valid_ppl": valid["token_ppl"],
        "test_ppl": test["token_ppl"],
        "valid_bpb": valid["bpb"],
        "test_bpb": test["bpb"],
        "valid_tokens": valid["tokens"],
        "test_tokens": test["tokens"],
        "seconds": round(seconds, 2),
        "converged": is_converged,
    }


def _split_metrics(nll_and_count, split) -> dict:
    nll, n = nll_and_count
    if not math.isfinite(nll):
        raise TinyLMError(f"a model gave an infinite loss on the {split.name} split")
    return metrics(nll, n, split.n_bytes, split.n_words)


def report_split_stats(tok, split: TokenSplit, docs: list[str]) -> dict:
    """Tokens per word and exact reconstruction of one cached split, by the four-stage report's
    definitions: for word_bpe, tokens per word counts the pieces of words, not the end-of-word
    token after each, and a document is reconstructed when it decodes to its normalised text
    (``tinylm tokenizer-stats`` counts every token against the raw text instead)."""
    ids = np.asarray(split.ids)
    content = int(np.count_nonzero(ids >= 4))
    if tok.type_name == "word_bpe":
        content -= int(np.count_nonzero(ids == EOW_ID))
    exact = sum(tok.decode(tok.encode(d)) == tok.represented(d) for d in docs)
    return {
        "tokens": split.n_tokens,
        "tokens_per_word": content / max(split.n_words, 1),
        "bytes_per_token": split.n_bytes / max(content, 1),
        "unk_rate": float(np.mean(ids == UNK_ID)),
        "reconstructed": exact,
        "documents": len(docs),
        "distinct_tokens": int(np.unique(ids[ids >= 4]).size),
    }


def tokenizer_stats(spec: TokenizerSpec, prepared: PreparedData, docs: dict[str, list[str]]) -> dict:
    per_split = {name: report_split_stats(prepared.tokenizer, prepared.splits[name], docs[name]) for name in SPLITS}
    return {
        "tokenizer": spec.name,
        "type": spec.kind,
        "merges": spec.merges,
        "normalization": spec.normalization if spec.kind == "word_bpe" else None,
        "vocab_size": prepared.tokenizer.vocab_size,
        "modelled": spec.modelled,
        "splits": per_split,
    }


def samples(cfg: StudyConfig, tok, tok_name: str, model: str, next_token_logits) -> list[list[str]]:
    """[tokenizer, model, prompt, text] for each prompt (prompt i sampled with seed + i): the prompt
    as the model saw it (normalised by word_bpe) and what the new tokens add."""
    rows = []
    for i, prompt in enumerate(cfg.sampling.prompts):
        context = [SOS_ID, *tok.encode(prompt)]
        new = sample_from_context(
            next_token_logits,
            context,
            GenerationConfig(
                cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature, seed=cfg.seed + i, stop_ids=(EOS_ID,)
            ),
        )
        rows.append([tok_name, model, prompt, tok.represented(prompt) + tok.decode_continuation(context, new)])
    return rows


def _token_ids(prepared: PreparedData) -> dict[str, np.ndarray]:
    return {name: np.asarray(s.ids, dtype=np.int64) for name, s in prepared.splits.items()}


def ngram_models(
    cfg: StudyConfig, spec: TokenizerSpec, prepared: PreparedData, say, save_dir: Path | None = None
) -> dict:
    """Every order x smoothing, scored on valid and test, with samples; the Kneser-Ney model of
    each order saved as ``save_dir/ngram-<order>.npz`` (what ``tinylm serve`` loads)."""
    out = {"rows": [], "samples": []}
    tok, splits, ids, V = prepared.tokenizer, prepared.splits, _token_ids(prepared), prepared.tokenizer.vocab_size
    for order in cfg.ngram.orders:
        t0 = time.perf_counter()
        counted = NGramLM(order, V, "kneser_ney", start_padding=cfg.ngram.start_padding).fit(ids["train"])
        t_count = time.perf_counter() - t0
        for name in cfg.ngram.smoothings:
            t1 = time.perf_counter()
            lm = counted.smoothed(*SMOOTHING_K[name])
            if name == "interpolated":
                lm.fit_weights(ids["valid"])
            elif name == "interpolated_fixed":
                lm.set_weights(cfg.ngram.fixed_weights[: order + 1])
            valid = _split_metrics(lm.score(ids["valid"]), splits["valid"])
            test = _split_metrics(lm.score(ids["test"]), splits["test"])
            if save_dir is not None and name == "kneser_ney":
                lm.save(save_dir / f"ngram-{order}.npz")
            out["rows"].append(
                _row(spec.name, V, "ngram", order, name, None, valid, test, t_count + time.perf_counter() - t1)
            )
            out["samples"] += samples(cfg, tok, spec.name, f"{order}-gram {name}", lm.next_token_logits)
        say(
            f"[{spec.name}] {order}-gram: "
            + ", ".join(f"{r['smoothing']} {r['valid_ppl']:.2f}" for r in out["rows"][-len(cfg.ngram.smoothings) :])
        )
    return out


def bigram_runs(cfg: StudyConfig) -> list[tuple[str, BigramConfig]]:
    """(label, config) of every bigram run of a sweep: the learning rates, then the grid."""
    b = cfg.bigram
    base = BigramConfig(
        max_steps=b.max_steps,
        max_seconds=b.max_seconds,
        threads=1,
        seed=cfg.seed,
        eval_interval=b.eval_interval or max(10, b.max_steps // 30),
        patience=b.patience,
        batch_size=b.batch_size,
        mode=b.mode,
        optimizer=b.optimizer,
        warmup_steps=0 if b.schedule == "constant" else min(50, b.max_steps // 10),
    )

    def at(lr, **kw):
        return dataclasses.replace(base, lr=lr, min_lr=lr if b.schedule == "constant" else lr / 10, **kw)

    return [(f"lr={lr:g} d={b.lr_d_embed}", at(lr, d_embed=b.lr_d_embed, weight_decay=0.0)) for lr in b.lrs] + [
        (f"d={d} wd={wd:g}", at(b.grid_lr, d_embed=d, weight_decay=wd)) for d in b.d_embeds for wd in b.weight_decays
    ]


def bigram_sweep(
    cfg: StudyConfig, spec: TokenizerSpec, prepared: PreparedData, best_from_first, say, save_dir: Path | None = None
) -> dict:
    """Every run of the sweep (or the first tokenizer's best setting), scored on valid and test;
    the best run's model saved as ``save_dir/bigram.pt``."""
    tok, splits, ids, V = prepared.tokenizer, prepared.splits, _token_ids(prepared), prepared.tokenizer.vocab_size
    runs = [r for r in bigram_runs(cfg) if best_from_first is None or r[0] == best_from_first]
    out = {"runs": [], "samples": []}
    best = None
    for label, bcfg in runs:
        result = train_bigram(ids["train"], ids["valid"], V, bcfg)
        valid = _split_metrics(result.model.score(ids["valid"]), splits["valid"])
        test = _split_metrics(result.model.score(ids["test"]), splits["test"])
        out["runs"].append(
            {
                "tokenizer": spec.name,
                "label": label,
                "lr": bcfg.lr,
                "d_embed": bcfg.d_embed,
                "weight_decay": bcfg.weight_decay,
                "batch_size": bcfg.batch_size,
                "best_val_loss": result.best_val_loss,
                "valid_ppl": valid["token_ppl"],
                "test_ppl": test["token_ppl"],
                "valid_bpb": valid["bpb"],
                "test_bpb": test["bpb"],
                "steps": result.steps,
                "stopped": result.stopped_because,
                "converged": converged(result.stopped_because),
                "optimizer": bcfg.optimizer,
                "seconds": round(result.seconds, 2),
                "history": result.history,
            }
        )
        say(
            f"[{spec.name}] neural bigram {label}: valid ppl {valid['token_ppl']:.2f} ({result.steps} steps, "
            f"{result.stopped_because})"
        )
        if best is None or result.best_val_loss < best[0].best_val_loss:
            best = (result, label, valid, test)
    result, label, valid, test = best
    if save_dir is not None:
        result.model.save(save_dir / "bigram.pt", {"label": label})
    out["best"] = label
    out["row"] = _row(
        spec.name,
        V,
        "neural_bigram",
        2,
        label,
        result.model.num_parameters(),
        valid,
        test,
        sum(r["seconds"] for r in out["runs"]),
        converged(result.stopped_because),
    )
    out["samples"] = samples(cfg, tok, spec.name, f"neural bigram {label}", result.model.next_token_logits)
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


def gpt_model(
    cfg: StudyConfig, spec: TokenizerSpec, rc: RunConfig, prepared: PreparedData, size: str, gpt_dir: Path, say
) -> dict:
    """One GPT trained by tinylm.training on the first gpt.data_fraction of each split, its best checkpoint scored."""
    name, layers, d_model, heads = parse_size(size)
    gpt = cfg.gpt
    rc = dataclasses.replace(
        rc,
        model=ModelConfig(
            context_length=gpt.context_length, d_model=d_model, n_layers=layers, n_heads=heads, dropout=gpt.dropout
        ),
        train=dataclasses.replace(rc.train),
    )
    apply_updates(rc, parse_overrides(gpt.run_overrides))
    check_config(rc)
    splits = {k: head_of_split(s, gpt.data_fraction, prepared.tokenizer) for k, s in prepared.splits.items()}
    check_context_fits(splits, gpt.context_length)
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    result = train(rc, dataclasses.replace(prepared, splits=splits), gpt_dir)
    model, tokenizer, _ = load_checkpoint(result.checkpoint_dir / "best")
    ev = {k: evaluate_split(model, splits[k]) for k in ("valid", "test")}
    params = model.num_parameters()
    row = _row(
        spec.name,
        tokenizer.vocab_size,
        "gpt",
        None,
        name,
        params,
        ev["valid"],
        ev["test"],
        time.perf_counter() - t0,
        converged(result.stopped_because),
    )
    curve = [
        {"step": r["step"], "train_loss": r["train_loss"], "val_loss": r["val_loss"]}
        for r in read_metrics(gpt_dir / "metrics.csv")
        if r["val_loss"] is not None
    ]
    gpt_samples = [
        [spec.name, f"GPT {name}", s["prompt"], tokenizer.represented(s["prompt"]) + s["continuation"]]
        for s in sample_prompts(model, tokenizer, rc.sample)
    ]
    run = {
        "tokenizer": spec.name,
        "size": name,
        "layers": layers,
        "d_model": d_model,
        "heads": heads,
        "context_length": gpt.context_length,
        "parameters": params,
        "train_tokens": splits["train"].n_tokens,
        "tokens_per_parameter": splits["train"].n_tokens / params,
        "data_fraction": gpt.data_fraction,
        "steps": result.steps,
        "stopped": result.stopped_because,
        "converged": converged(result.stopped_because),
        "schedule_clock": rc.train.schedule_clock,  # wall: its cosine ended with the cap
        "train_seconds": round(result.seconds, 1),
        "tokens_per_s": result.tokens_per_s,
        "tokens_seen": result.steps * gpt.batch_size * gpt.context_length,
        "valid_ppl": ev["valid"]["token_ppl"],
        "test_ppl": ev["test"]["token_ppl"],
    }
    say(
        f"[{spec.name}] GPT {name} ({params:,} parameters): {result.steps} steps ({result.stopped_because}), "
        f"{result.tokens_per_s:,.0f} tokens/s, valid ppl {ev['valid']['token_ppl']:.2f}, bpb {ev['valid']['bpb']:.3f}"
    )
    return {"row": row, "run": run, "curve": curve, "samples": gpt_samples}


def load_split_documents(rc: RunConfig) -> dict[str, list[str]]:
    raw = load_raw_documents(rc.data)
    return {name: clean_documents(raw[name], rc.data)[0] for name in SPLITS}


# ------------------------------------------------------------------------------------ the recipe
@dataclass
class StudyRun:
    """What the stages of one run share: the settings, the run directory, the clock, the tables."""

    cfg: StudyConfig
    out: Path
    start: float = field(default_factory=time.perf_counter)
    state: dict = field(
        default_factory=lambda: {
            **{table: [] for table in ("rows", "tokenizers", "samples", "bigram_runs", "gpt_runs", "gpt_curves")},
            "stage_seconds": {},
            "overlap": None,
        }
    )
    docs: dict[str, list[str]] | None = None  # each split's cleaned documents
    best_bigram: str | None = None  # the first tokenizer's best bigram setting

    def say(self, msg: str) -> None:
        """Every line with the elapsed time, so the stage costs can be read off the log."""
        log.info(f"{time.perf_counter() - self.start:7.1f}s {msg}")

    @property
    def model_inputs(self) -> list:
        """What every model stage depends on besides its own section: the seed and the sampling."""
        return [self.cfg.seed, asdict(self.cfg.sampling)]

    def stage(self, label: str, path: Path, inputs: list, compute) -> dict:
        """A stage's result, reused while the data settings and ``inputs`` are unchanged; its wall
        time as computed counts under ``label`` either way."""
        key = stage_key([asdict(self.cfg.data), *inputs])
        result = Stage(path, key).run(compute, self.say)
        seconds = self.state["stage_seconds"]
        seconds[label] = seconds.get(label, 0.0) + result["seconds"]
        return result


def tokenizer_stage(study: StudyRun, spec: TokenizerSpec) -> tuple[RunConfig, PreparedData]:
    """Stage 1: train (or reuse) the tokenizer and its token splits, refuse an unusable split,
    describe it; the first tokenizer also loads the documents and checks the splits' overlap."""
    cfg, tok_dir = study.cfg, study.out / spec.name
    rc = run_config(cfg, spec, tok_dir)
    t0 = time.perf_counter()
    prepared = prepare(rc, tok_dir)
    t_prepare = time.perf_counter() - t0
    for name in SPLITS:
        if name not in prepared.splits or prepared.splits[name].n_tokens < 2:
            raise TinyLMError(f"the {name} split is empty for tokenizer {spec.name}")
    if cfg.gpt.enabled and spec.modelled:  # refuse a too-short split before spending time on the other stages
        check_context_fits(
            {k: head_of_split(s, cfg.gpt.data_fraction, prepared.tokenizer) for k, s in prepared.splits.items()},
            cfg.gpt.context_length,
        )
    if study.docs is None:
        study.docs = docs = load_split_documents(rc)
        study.state["overlap"] = {
            f"{a}-{b}": line_overlap(docs[a], docs[b], cfg.tokenizers.overlap_sample, seed=cfg.seed)
            for a, b in (("train", "valid"), ("train", "test"), ("valid", "test"))
        }
    # the stage's time includes training the tokenizer (prepare), whose cache is reused on reruns
    stats = study.stage(
        "1 tokenizers",
        tok_dir / "stage-tokenizer.json",
        [cfg.tokenizers.word_vocab, asdict(spec)],
        lambda: {**tokenizer_stats(spec, prepared, study.docs), "prepare_seconds": round(t_prepare, 1)},
    )
    study.state["stage_seconds"]["1 tokenizers"] += stats.get("prepare_seconds", 0.0)
    study.state["tokenizers"].append(stats)
    v = stats["splits"]["valid"]
    study.say(
        f"[{spec.name}] {prepared.tokenizer.vocab_size} tokens, {v['tokens_per_word']:.3f} tokens per word "
        f"(valid), reconstruction {v['reconstructed']}/{v['documents']}"
    )
    return rc, prepared


def ngram_stage(study: StudyRun, spec: TokenizerSpec, prepared: PreparedData) -> None:
    """Stage 2: the n-gram models of every order and smoothing."""
    ngram = study.stage(
        "2 n-grams",
        study.out / spec.name / "stage-ngram.json",
        [*study.model_inputs, asdict(study.cfg.ngram), asdict(spec)],
        lambda: ngram_models(study.cfg, spec, prepared, study.say, study.out / spec.name),
    )
    study.state["rows"] += ngram["rows"]
    study.state["samples"] += ngram["samples"]


def bigram_stage(study: StudyRun, spec: TokenizerSpec, prepared: PreparedData) -> None:
    """Stage 3: the neural bigram sweep, or (bigram.sweep_on: first) the first tokenizer's best setting."""
    fixed = study.best_bigram if study.cfg.bigram.sweep_on == "first" else None
    bigram = study.stage(
        "3 neural bigram",
        study.out / spec.name / "stage-bigram.json",
        [*study.model_inputs, asdict(study.cfg.bigram), asdict(spec), fixed],
        lambda: bigram_sweep(study.cfg, spec, prepared, fixed, study.say, study.out / spec.name),
    )
    study.best_bigram = study.best_bigram or bigram["best"]
    study.state["rows"].append(bigram["row"])
    study.state["bigram_runs"] += bigram["runs"]
    study.state["samples"] += bigram["samples"]


def gpt_stages(study: StudyRun, spec: TokenizerSpec, rc: RunConfig, prepared: PreparedData) -> None:
    """Stage 4: a GPT of each size, on the tokenizers that get GPTs."""
    gpt = study.cfg.gpt
    if not gpt.enabled or (gpt.tokenizers is not None and spec.name not in gpt.tokenizers):
        return
    for size in gpt.sizes:
        name, tok_dir = parse_size(size)[0], study.out / spec.name
        result = study.stage(
            "4 GPT",
            tok_dir / f"stage-gpt-{name}.json",
            [*study.model_inputs, asdict(gpt), asdict(spec), size],
            lambda: gpt_model(study.cfg, spec, rc, prepared, size, tok_dir / f"gpt-{name}", study.say),
        )
        study.state["rows"].append(result["row"])
        study.state["gpt_runs"].append(result["run"])
        study.state["gpt_curves"].append([f"{spec.name} {name}", result["curve"]])
        study.state["samples"] += result["samples"]


def run_study(cfg: StudyConfig) -> dict:
    """Every stage on every tokenizer (the modelled ones through stages 2-4), then the tables and figures."""
    check_config(cfg)  # every setting is checked before anything is written
    study = StudyRun(cfg, Path(cfg.out_dir))
    study.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    for spec in tokenizer_specs(cfg):
        rc, prepared = tokenizer_stage(study, spec)
        if spec.modelled:
            ngram_stage(study, spec, prepared)
            bigram_stage(study, spec, prepared)
            gpt_stages(study, spec, rc, prepared)
    study.state["seconds"] = round(time.perf_counter() - study.start, 1)
    write_outputs(cfg, study.state, study.out)
    study.say(
        f"study finished in {study.state['seconds']:.0f} s: {study.out}/results.md, results.csv, "
        "learning_curves.png, samples.md"
    )
    return study.state
