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

A trade-off measured in a model's first steps says little about the regime the reports measured
(validation losses of 2.2-2.6 nats): with ``init_from`` every run continues from a trained
checkpoint instead, at ``lr_scale`` of the run's learning rates (a second, smaller cosine: a trained
model at full rate first climbs out of its annealed minimum), with no weight average and the
step clock, so every variant follows the same schedule of its own length.
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
from tinylm.studies.stages import Stage, stage_key
from tinylm.training.grad_checkpoint import checkpoint_function
from tinylm.training.memory import cuda_peak_bytes, cuda_peak_scope, measure_step_activation_bytes
from tinylm.training.metrics import read_metrics
from tinylm.training.trainer import build_model, start_from_weights, train, validation_loss

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
    init_from: str | None = None  # a trained checkpoint every run continues from (None: a fresh model)
    lr_scale: float = 1.0  # the continued runs' learning rates, as a share of the run config's
    compile: bool | None = None  # None: the run config's train.compile
    eval_batches: int | None = None  # None: the run config's; 0: the whole validation split
    # a run finished before under the very same settings is reused, so a long part stopped midway
    # resumes run by run (for parts compared by loss; timed parts re-run whole, in one sitting)
    reuse_finished: bool = False


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
    # with epochs: make as many updates as accumulation ``updates_of`` makes in them (so k / updates_of
    # of the epochs' tokens), not whole epochs
    updates_of: int | None = None


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
    """Equal tokens: every k trains ``epochs`` epochs (k times fewer updates of a k times larger
    batch); equal updates: every k makes the updates the largest k makes in those epochs, so k sees
    k / largest of their tokens. The largest k's run belongs to both comparisons."""
    k_max = max(accum_steps)
    variants = [
        Variant(f"tokens_k{k}", f"k={k}", accum=k, epochs=epochs, comparison="both" if k == k_max else "equal tokens")
        for k in accum_steps
    ]
    variants += [
        Variant(f"updates_k{k}", f"k={k}", accum=k, epochs=epochs, comparison="equal updates", updates_of=k_max)
        for k in accum_steps
        if k != k_max
    ]
    return variants


def _tradeoff_steps(tradeoffs: Tradeoffs, cfg: RunConfig, v: Variant) -> int:
    """Updates of variant ``v``: its epochs' (the trainer derives the same count from train.epochs,
    dropping a last partial step), the epochs' of accumulation ``updates_of``, or the shared micro-batches'."""
    if not v.epochs:
        return tradeoffs.micro_batches // v.accum
    units = epoch_units(tradeoffs.prepared, cfg)
    steps = v.epochs * (units // (cfg.train.batch_size * (v.updates_of or v.accum)))
    if steps < 1:
        raise TinyLMError(
            f"an epoch of the trade-off runs' {units} training rows is less than one update of "
            f"{cfg.train.batch_size} x {v.updates_of or v.accum} rows; give more "
            "experiments.tradeoff_stories or fewer accumulation steps"
        )
    return steps


def _tradeoff_config(tradeoffs: Tradeoffs, v: Variant) -> RunConfig:
    cfg = copy.deepcopy(tradeoffs.cfg)
    tc = cfg.train
    steps = _tradeoff_steps(tradeoffs, cfg, v)
    tc.grad_accum_steps = v.accum
    tc.max_steps = steps
    tc.epochs = v.epochs if v.updates_of is None else None
    tc.max_tokens = None
    tc.max_minutes = None
    tc.schedule_clock = "steps"  # every variant's schedule follows its own steps, whatever the machine's speed
    tc.ema_decay = 0.0  # the runs compare what the optimizer reached, not an average over their last steps
    if tradeoffs.init_from:
        tc.init_from = tradeoffs.init_from
        tc.lr, tc.min_lr, tc.muon_lr = (rate * tradeoffs.lr_scale for rate in (tc.lr, tc.min_lr, tc.muon_lr))
        tc.warmup_steps = max(1, steps // 10)  # the same share of every variant's updates
    else:
        # the run's own warmup, at most half of these short runs: warmed up over only a few steps to
        # lr 1e-3, the random-init model's loss can jump back to the untrained level for an update
        tc.warmup_steps = max(1, min(tc.warmup_steps, steps // 2))
    if tradeoffs.compile is not None:
        tc.compile = tradeoffs.compile
    if tradeoffs.eval_batches is not None:
        tc.eval_batches = tradeoffs.eval_batches
    tc.eval_interval = steps  # one validation, at the end
    tc.log_interval = 1  # every step's loss: the curves compare the variants step by step
    tc.grad_checkpointing = v.checkpointing is not None
    tc.checkpoint_impl = v.checkpointing or tc.checkpoint_impl
    tc.early_stopping_patience = 0
    tc.progress = False
    tc.threads = tradeoffs.threads
    apply_updates(cfg.embeddings, v.embeddings, prefix="embeddings.")
    return cfg


def start_val_loss(tradeoffs: Tradeoffs) -> float:
    """The validation loss every continued run starts from, measured as the runs measure theirs."""
    cfg = _tradeoff_config(tradeoffs, Variant("start"))
    prepared = tradeoffs.prepared
    model = build_model(cfg, prepared.tokenizer.vocab_size)
    start_from_weights(model, tradeoffs.init_from, prepared.tokenizer)
    valid = Batches(prepared.splits["valid"], cfg.model.context_length, cfg.data.batching, seed=cfg.train.seed + 1)
    document_start = prepared.tokenizer.sos_id if cfg.train.document_attention else None
    return validation_loss(model, valid, cfg, torch.device("cpu"), document_start=document_start)


def _activation_bytes(tradeoffs: Tradeoffs, cfg: RunConfig) -> int:
    """Peak bytes autograd saves in one forward + backward of one micro-batch (tinylm.training.memory's meter)."""
    prepared = tradeoffs.prepared
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, prepared.tokenizer.vocab_size).train()
    batches = Batches(prepared.splits["train"], model.config.context_length, cfg.data.batching, seed=cfg.train.seed)
    x, y = batches.get(0, 0, cfg.train.batch_size)
    checkpoint_blocks = checkpoint_function(cfg.train.checkpoint_impl) if cfg.train.grad_checkpointing else None
    return int(measure_step_activation_bytes(model, x, y, checkpoint_blocks)["peak_activation_bytes"])


def _finished_run(tradeoffs: Tradeoffs, cfg: RunConfig, v: Variant, out: Path) -> Stage:
    """Where run ``out`` keeps its row, keyed by everything the run reads: its config, the variant,
    and the sizes of the token splits it trains and validates on."""
    splits = {name: [split.n_tokens, split.n_docs] for name, split in tradeoffs.prepared.splits.items()}
    inputs = {"run": cfg.to_dict(), "variant": dataclasses.asdict(v), "splits": splits}
    return Stage(out / "tradeoff_row.json", stage_key(inputs))


def _tradeoff_run(tradeoffs: Tradeoffs, v: Variant, name: str) -> dict:
    cfg = _tradeoff_config(tradeoffs, v)
    out = tradeoffs.out_dir / name
    out.mkdir(parents=True, exist_ok=True)
    finished = _finished_run(tradeoffs, cfg, v, out) if tradeoffs.reuse_finished else None
    if finished and (row := finished.fresh()) is not None:
        log.info(f"{name}: finished before under the same settings, reused ({finished.path.name})")
        return row
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
        "epochs": v.epochs if v.updates_of is None else round(M / per_epoch, 3),
        "train_stories": prepared.splits["train"].n_docs,
    }
    if v.epochs and v.updates_of is None:
        row.update(_epoch_times(out / "epochs.csv"))
    log.info(
        f"{name}: {result.steps} steps x {v.accum}, final train loss {result.final_train_loss:.4f}, "
        f"{seconds:.1f} s of training"
    )
    if finished:
        finished.save(row)
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
        if v.epochs and v.updates_of is None:
            row["epoch_seconds"] = statistics.median(t for r in rs for t in r["epoch_seconds_each"])
        row["peak_activation_bytes"] = _activation_bytes(tradeoffs, _tradeoff_config(tradeoffs, v))
        rows.append(row)
    return rows
