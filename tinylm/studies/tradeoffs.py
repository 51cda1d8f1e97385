"""Training trade-offs measured through the real trainer: the same micro-batches trained with
k accumulation steps, with and without gradient checkpointing (tinylm's or torch's), or with
other embeddings (`tinylm experiments` uses it).

Times are the trainer's own (the metrics row of the last step, written before that step's
validation and checkpoint saves); every variant runs ``tradeoff_repeats`` times in alternated
rounds after one untimed warm-up step, and the tables give medians plus each run. A variant
with ``epochs`` trains whole epochs of the split in the trainer's epoch order, and its time per
epoch is measured (the trainer's epochs.csv), not projected from a few micro-batches. Activation
memory is measured with the training engine's meter (bytes autograd saves for backward in one
micro-batch step); on CUDA the peak of ``torch.cuda.max_memory_allocated`` over the run too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinylm.config import RunConfig, apply_updates
from tinylm.data.prepare import PreparedData
from tinylm.data.tokens import Batches, TokenSplit
from tinylm.errors import TinyLMError
from tinylm.training.grad_checkpoint import checkpoint_function
from tinylm.training.memory import cuda_peak_bytes, cuda_peak_scope, measure_step_activation_bytes
from tinylm.training.metrics import read_metrics
from tinylm.training.trainer import build_model, train

log = logging.getLogger(__name__)
trainer_log = logging.getLogger(train.__module__)


@contextlib.contextmanager
def quiet(logger: logging.Logger):
    """Only warnings from ``logger`` while the block runs (the many short runs would flood the log)."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class Tradeoffs:
    """What every trade-off run shares: the run config, its prepared data, where the runs go."""

    cfg: RunConfig
    prepared: PreparedData
    out_dir: Path  # each run writes into out_dir/<name>
    micro_batches: int  # micro-batches every variant trains on
    repeats: int  # alternated rounds per variant (medians are reported)
    threads: int


@dataclass(frozen=True)
class Variant:
    """One way to train the same micro-batches."""

    name: str  # also the run directory (name_<repeat>)
    label: str = ""  # for tables and figures; the name when empty
    accum: int = 1
    checkpointing: str | None = None  # None, or the implementation: "tinylm" | "torch"
    embeddings: dict = field(default_factory=dict)  # EmbeddingsConfig fields for this run
    epochs: int | None = None  # whole epochs of the split (every story once each); None: the shared micro-batches
    comparison: str = ""  # which comparison the run belongs to (tables and figures group by it)


def epoch_units(prepared: PreparedData, cfg: RunConfig) -> int:
    """Rows of one epoch of the training split: its stories, or its non-overlapping packed windows."""
    split = prepared.splits["train"]
    return split.n_docs if cfg.data.batching == "stories" else (split.n_tokens - 1) // cfg.model.context_length


def first_stories(prepared: PreparedData, n: int) -> PreparedData:
    """The same prepared data with only the first ``n`` training stories (the trade-off runs' split)."""
    split = prepared.splits["train"]
    if n >= split.n_docs:
        return prepared
    end = int(split.offsets[n])
    share = end / max(split.n_tokens, 1)  # bytes and words are counted per split, not per story
    head = TokenSplit(
        split.name, split.ids[:end], split.offsets[: n + 1], round(split.n_bytes * share), round(split.n_words * share)
    )
    return dataclasses.replace(prepared, splits={**prepared.splits, "train": head})


def accumulation_variants(accum_steps: list[int], epochs: int) -> list[Variant]:
    """Equal tokens: every k trains ``epochs`` epochs (k times fewer updates); equal updates: k
    trains k / smallest times as many epochs, so every run makes the smallest k's number of updates.
    The smallest k's run belongs to both comparisons."""
    k0 = min(accum_steps)
    variants = [
        Variant(f"tokens_k{k}", f"k={k}", accum=k, epochs=epochs, comparison="both" if k == k0 else "equal tokens")
        for k in accum_steps
    ]
    variants += [
        Variant(f"updates_k{k}", f"k={k}", accum=k, epochs=epochs * k // k0, comparison="equal updates")
        for k in accum_steps
        if k != k0
    ]
    return variants


def _tradeoff_config(tradeoffs: Tradeoffs, v: Variant) -> RunConfig:
    cfg = copy.deepcopy(tradeoffs.cfg)
    if v.epochs:  # the trainer derives the same step count from train.epochs (a last partial step is dropped)
        steps = v.epochs * (epoch_units(tradeoffs.prepared, cfg) // (cfg.train.batch_size * v.accum))
        if steps < 1:
            raise TinyLMError(
                f"an epoch of the trade-off runs' {epoch_units(tradeoffs.prepared, cfg)} training rows "
                f"is less than one update of {cfg.train.batch_size} x {v.accum} rows; give more "
                "experiments.tradeoff_stories or fewer accumulation steps"
            )
    else:
        steps = tradeoffs.micro_batches // v.accum
    cfg.train.grad_accum_steps = v.accum
    cfg.train.max_steps = steps
    cfg.train.epochs = v.epochs
    cfg.train.max_tokens = None
    cfg.train.max_minutes = None
    # the run's own warmup, at most half of these short runs: warmed up over only a few steps to
    # lr 1e-3, the random-init model's loss can jump back to the untrained level for an update
    cfg.train.warmup_steps = max(1, min(cfg.train.warmup_steps, steps // 2))
    cfg.train.eval_interval = steps  # one validation, at the end
    cfg.train.log_interval = 1  # every step's loss: the curves compare the variants step by step
    cfg.train.grad_checkpointing = v.checkpointing is not None
    cfg.train.checkpoint_impl = v.checkpointing or cfg.train.checkpoint_impl
    cfg.train.early_stopping_patience = 0
    cfg.train.progress = False
    cfg.train.threads = tradeoffs.threads
    apply_updates(cfg.embeddings, v.embeddings, prefix="embeddings.")
    return cfg


def _activation_bytes(tradeoffs: Tradeoffs, cfg: RunConfig) -> int:
    """Peak bytes autograd saves in one forward + backward of one micro-batch (tinylm.training.memory's meter)."""
    prepared = tradeoffs.prepared
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, prepared.tokenizer.vocab_size).train()
    batches = Batches(prepared.splits["train"], model.config.context_length, cfg.data.batching, seed=cfg.train.seed)
    x, y = batches.get(0, 0, cfg.train.batch_size)
    checkpoint_blocks = checkpoint_function(cfg.train.checkpoint_impl) if cfg.train.grad_checkpointing else None
    return int(measure_step_activation_bytes(model, x, y, checkpoint_blocks)["peak_activation_bytes"])


def _tradeoff_run(tradeoffs: Tradeoffs, v: Variant, name: str) -> dict:
    cfg = _tradeoff_config(tradeoffs, v)
    out = tradeoffs.out_dir / name
    out.mkdir(parents=True, exist_ok=True)
    prepared = tradeoffs.prepared
    with quiet(trainer_log), cuda_peak_scope():
        result = train(cfg, prepared, out)
        cuda_peak = cuda_peak_bytes()
    per_epoch = epoch_units(prepared, cfg) / cfg.train.batch_size
    M = result.steps * v.accum
    # training time only: the metrics row of the last step is written before its validation and saves
    last = read_metrics(out / "metrics.csv")[-1]
    seconds, tok_s = last["elapsed_s"], last["tokens_per_s"]
    row = {
        "name": name,
        "label": v.label or v.name,
        "comparison": v.comparison,
        "accum_steps": v.accum,
        "grad_checkpointing": v.checkpointing is not None,
        "checkpoint_impl": v.checkpointing,
        "embeddings": v.embeddings,
        "run_dir": name,
        "micro_batch": cfg.train.batch_size,
        "cuda_peak_bytes": cuda_peak,
        "effective_batch": cfg.train.batch_size * v.accum,
        "optimizer_steps": result.steps,
        "micro_batches": M,
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.best_val_loss,
        "seconds": seconds,
        "tokens_per_s": tok_s,
        "seconds_with_eval_and_saves": result.seconds,
        "projected_epoch_seconds": seconds / M * per_epoch,
        "micro_batches_per_epoch": per_epoch,
        "epochs": v.epochs,
        "train_stories": prepared.splits["train"].n_docs,
    }
    if v.epochs:
        row.update(_epoch_times(out / "epochs.csv"))
    log.info(
        f"{name}: {result.steps} steps x {v.accum}, final train loss {result.final_train_loss:.4f}, "
        f"{seconds:.1f} s of training"
    )
    return row


def _epoch_times(epochs_csv: Path) -> dict:
    """Seconds of each epoch, measured: differences of the trainer's elapsed time at epoch ends
    (each includes the validation that ended the epoch before it)."""
    rows = read_metrics(epochs_csv)
    ends = [0.0] + [r["elapsed_s"] for r in rows]
    each = [b - a for a, b in zip(ends, ends[1:])]
    return {
        "epoch_seconds_each": each,
        "epoch_seconds": statistics.median(each) if each else None,
        "epoch_train_losses": [r["train_loss"] for r in rows],
    }


def _warm_up_training(tradeoffs: Tradeoffs) -> None:
    """One untimed step first, so the first timed run does not pay one-time costs (allocator, kernels)."""
    cfg = _tradeoff_config(tradeoffs, Variant("warmup"))
    cfg.train.max_steps, cfg.train.eval_interval, cfg.train.eval_batches, cfg.train.epochs = 1, 1, 1, None
    with quiet(trainer_log):
        train(cfg, tradeoffs.prepared, tradeoffs.out_dir / "warmup")


def alternated_runs(tradeoffs: Tradeoffs, variants: list[Variant]) -> list[dict]:
    """Train each variant ``tradeoff_repeats`` times in rounds (A B C .. A B C ..), so load from
    other jobs hits every variant alike; report medians."""
    _warm_up_training(tradeoffs)
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    for rep in range(max(1, tradeoffs.repeats)):
        for v in variants:
            runs[v.name].append(_tradeoff_run(tradeoffs, v, f"{v.name}_{rep}"))
    rows = []
    for v in variants:
        rs = runs[v.name]
        row = {
            **rs[0],
            "name": v.name,
            "runs": len(rs),
            "seconds_each": [r["seconds"] for r in rs],
            "seconds": statistics.median(r["seconds"] for r in rs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
        }
        if any(r["cuda_peak_bytes"] is not None for r in rs):
            row["cuda_peak_bytes"] = max(r["cuda_peak_bytes"] or 0 for r in rs)
        row["projected_epoch_seconds"] = row["seconds"] / row["micro_batches"] * row["micro_batches_per_epoch"]
        if v.epochs:
            row["epoch_seconds"] = statistics.median(t for r in rs for t in r["epoch_seconds_each"])
        row["peak_activation_bytes"] = _activation_bytes(tradeoffs, _tradeoff_config(tradeoffs, v))
        rows.append(row)
    return rows
