"""The training loop: teacher forcing, AdamW, warmup + cosine, clipping, token-weighted gradient
accumulation, gradient checkpointing, mixed precision, DistributedDataParallel under torchrun,
periodic validation with early stopping, resumable checkpoints (exact resume), metrics CSV and
TensorBoard, progress (a bar on a terminal, a line every log_interval steps elsewhere).

``train`` is ``setup`` then ``train_loop``. Each ``setup_*`` function returns what it builds (the
data, the model, the step count, the optimizer, the checkpoints, the forward a step runs, the
logs); ``setup`` gathers them into one frozen ``Run``. The loop changes only the ``Counters`` and
the tensors, so it reads top to bottom.

Determinism, which exact resume and the data-parallel equivalence rest on:
- the batch of step s is a function of (seed, s) only (``Batches.get``); a rank draws its rows of it;
- the learning rate is a function of s only;
- dropout draws from the torch generator, whose state is saved in every resumable checkpoint;
- validation uses fixed batches and no randomness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file

from tinylm.config import RunConfig, TrainConfig, check_config
from tinylm.constants import IGNORE_INDEX
from tinylm.data.prepare import PreparedData
from tinylm.data.tokens import Batches
from tinylm.errors import TinyLMError
from tinylm.models.checkpoint import (
    load_checkpoint,
    load_model_state,
    prune_step_checkpoints,
    read_model_state,
    save_checkpoint,
)
from tinylm.models.embeddings import apply_pretrained_embeddings
from tinylm.models.gpt import GPT, eval_mode
from tinylm.tokenizers import Tokenizer
from tinylm.training import distributed as dist_utils
from tinylm.training.distributed import DistContext, all_reduce_sum, shard_rows
from tinylm.training.ema import EMA
from tinylm.training.grad_checkpoint import checkpoint_function, compiled_tinylm_checkpoint
from tinylm.training.metrics import EPOCH_COLUMNS, MetricsLog
from tinylm.training.optim import lr_at, make_optimizer, wall_schedule_enabled
from tinylm.training.precision import autocast, check_precision, make_grad_scaler
from tinylm.training.progress import Progress
from tinylm.training.resume import (
    ResumeState,
    capture_rng,
    check_resume_config,
    load_resume_state,
    restore_optimizer,
    restore_rng,
    state_payload,
    step_dir_name,
)

log = logging.getLogger(__name__)

# dropout in compiled code draws from torch's generator exactly as eager code does: a compiled run
# masks the same units as an eager one, recomputation under checkpointing sees the same masks,
# and resume (which restores the generator) stays exact
TRAIN_COMPILE_OPTIONS = {"fallback_random": True}


@dataclass
class TrainResult:
    steps: int
    best_val_loss: float
    final_train_loss: float
    seconds: float
    tokens_per_s: float
    checkpoint_dir: Path
    stopped_because: str


# ------------------------------------------------------------------------- the parts of one step
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TinyLMError(f"train.device={name} but CUDA is not available here; use train.device=cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: RunConfig, vocab_size: int) -> GPT:
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size)
    if model_cfg.vocab_size < vocab_size:
        raise TinyLMError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
    return GPT(model_cfg)


def per_rank_batch_size(tc: TrainConfig, world_size: int) -> int:
    """Sequences per micro-batch on one process (from global_batch_size when that is set)."""
    if tc.global_batch_size is None:
        return tc.batch_size
    parts = world_size * tc.grad_accum_steps
    if tc.global_batch_size % parts:
        raise TinyLMError(
            f"train.global_batch_size={tc.global_batch_size} is not divisible by world size {world_size} "
            f"x train.grad_accum_steps {tc.grad_accum_steps} = {parts}; use a multiple of {parts}"
        )
    return tc.global_batch_size // parts


def check_batch_fits(split, rows_per_step: int, context_length: int, mode: str) -> None:
    """A step's global batch must not ask for more data than the training split holds."""
    if mode == "stories" and rows_per_step > split.n_docs:
        raise TinyLMError(
            f"the global batch of {rows_per_step} sequences is larger than the train split's "
            f"{split.n_docs} documents; lower train.batch_size or train.grad_accum_steps"
        )
    if mode == "packed" and rows_per_step * context_length > split.n_tokens:
        raise TinyLMError(
            f"the global batch of {rows_per_step} x {context_length} = "
            f"{rows_per_step * context_length:,} tokens is larger than the train split's "
            f"{split.n_tokens:,} tokens; lower train.batch_size or train.grad_accum_steps"
        )


def micro_batches(batches: Batches, step: int, batch_size: int, accum: int, dist: DistContext) -> list:
    """This rank's micro-batches of ``step``: rows (m * world + rank) * B .. + B of the global batch."""
    return [batches.get(step, *shard_rows(m, dist.rank, dist.world_size, batch_size)) for m in range(accum)]


def accumulate_gradients(
    run_model,
    micro: list,
    device,
    precision: str = "fp32",
    scaler=None,
    dist: DistContext | None = None,
    ddp_model=None,
    label_smoothing: float = 0.0,
) -> tuple[float, int]:
    """Forward and backward over the micro-batches; returns (mean loss per target token, targets).

    The gradient equals that of one batch holding every micro-batch of every rank: each summed
    loss is divided by the global number of target tokens (weighting by tokens, not by
    micro-batch), times the world size because DDP averages gradients over ranks. Gradients are
    synchronised only on the last micro-batch.
    """
    dist = dist or DistContext()
    local_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
    (n_targets,) = all_reduce_sum([local_targets], dist, device)
    n_targets = max(int(n_targets), 1)
    step_loss = 0.0
    # only when asked for: a reference model wrapped by the benchmarks takes no such argument
    smoothing = {"label_smoothing": label_smoothing} if label_smoothing else {}
    for m, (x, y) in enumerate(micro):
        no_sync = ddp_model is not None and dist.enabled and m < len(micro) - 1
        with ddp_model.no_sync() if no_sync else contextlib.nullcontext():
            with autocast(device, precision):
                _, loss_sum = run_model(x.to(device), y.to(device), loss_reduction="sum", **smoothing)
            loss = loss_sum * dist.world_size / n_targets
            (scaler.scale(loss) if scaler is not None else loss).backward()
        step_loss += float(loss_sum.detach())
    (total,) = all_reduce_sum([step_loss], dist, device)
    return total / n_targets, n_targets


@torch.no_grad()
def validation_loss(
    model,
    batches: Batches,
    cfg: RunConfig,
    device,
    precision: str = "fp32",
    dist: DistContext | None = None,
    batch_size: int | None = None,
    document_start: int | None = None,
) -> float:
    """Mean token NLL over ``eval_batches`` fixed batches (the same every time), or the whole split.

    An evaluation batch holds ``batch_size * world_size`` rows; under DDP each rank scores its own
    rows (or whole batches of the sequential pass) and the sums are all-reduced, so N ranks report
    the loss one process with N times the batch would. ``document_start``: attention within stories
    (``train.document_attention``)."""
    dist = dist or DistContext()
    batch_size = batch_size or cfg.train.batch_size
    with eval_mode(model):
        total, count = 0.0, 0
        if cfg.train.eval_batches > 0:
            rows = shard_rows(0, dist.rank, dist.world_size, batch_size)
            source = (batches.get(i, *rows) for i in range(cfg.train.eval_batches))
        else:
            source = (
                xy
                for i, xy in enumerate(batches.sequential(batch_size * dist.world_size))
                if i % dist.world_size == dist.rank
            )
        for x, y in source:
            with autocast(device, precision):
                within = {"document_start": document_start} if document_start is not None else {}
                _, loss = model(x.to(device), y.to(device), loss_reduction="sum", **within)
            total += float(loss)
            count += int((y != IGNORE_INDEX).sum())
        total, count = all_reduce_sum([total, count], dist, device)
    return total / max(count, 1)


# ---------------------------------------------------------------------------- what setup builds
@dataclass(frozen=True)
class TrainData:
    train: Batches
    valid: Batches
    batch_size: int  # sequences per micro-batch on this rank
    rows_per_step: int  # sequences per optimizer step, over every micro-batch of every rank


@dataclass(frozen=True)
class Optimization:
    """What an update changes besides the weights: the optimizer, fp16's gradient scaler (a
    pass-through otherwise) and the weight average (``train.ema_decay``)."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: EMA | None

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups keep their own peak rate

    def step(self, model: GPT, grad_clip: float) -> None:
        """Clip (after unscaling, so the norm is the true one), step, zero the gradients, average."""
        if grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(model)

    def restore(self, saved: ResumeState) -> None:
        restore_optimizer(self.optimizer, saved)
        if self.ema is not None:  # a run resumed with EMA must have saved its average
            where = saved.path / "ema.safetensors"
            try:
                self.ema.load_state_tensors(load_file(str(where)))
            except Exception as exc:  # missing, unreadable or not this model's average
                raise TinyLMError(f"resume: the weight average {where} is unusable ({exc})") from exc
        if saved.scaler_state:
            self.scaler.load_state_dict(saved.scaler_state)


@dataclass
class Counters:
    """How far the run is. A resumable checkpoint saves the first four; the rest count this session."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0
    best_val: float = math.inf
    bad_evals: int = 0  # evaluations since the validation loss last improved
    session_tokens: int = 0
    last_loss: float = math.nan
    epoch_loss_sum: float = 0.0  # the running epoch's (a resumed run restarts the sum)
    epoch_targets: int = 0


@dataclass(frozen=True)
class Checkpoints:
    """Resumable checkpoints in ``directory``, written by rank 0. Saving is a collective call under
    DDP: it gathers every rank's RNG state."""

    directory: Path
    cfg: RunConfig
    tokenizer: Tokenizer
    model: GPT
    optim: Optimization
    dist: DistContext

    def save(self, name: str, counters: Counters, val_loss: float) -> None:
        """The steps done (with EMA, the average also as a model of its own, to evaluate or sample)."""
        rngs = dist_utils.gather_objects(capture_rng(), self.dist)
        if not self.dist.is_main:
            return
        resumable = {
            "step": counters.step,
            "data_position": counters.step,
            "tokens_seen": counters.tokens_seen,
            "best_val": counters.best_val,
            "bad_evals": counters.bad_evals,
            "world_size": self.dist.world_size,
        }
        tensors, files = state_payload(self.optim.optimizer, self.optim.scaler, rngs, resumable)
        meta = {"step": counters.step, "val_loss": val_loss, "tokens_seen": counters.tokens_seen}
        ema = self.optim.ema
        if ema is not None:
            tensors["ema.safetensors"] = ema.state_tensors()
            if name != "best":
                save_checkpoint(
                    self.directory / "ema",
                    ema.averaged_model(self.model),
                    self.tokenizer,
                    self.cfg,
                    {**meta, "ema_decay": self.cfg.train.ema_decay, "ema_updates": ema.updates},
                )
        save_checkpoint(
            self.directory / name, self.model, self.tokenizer, self.cfg, meta, extra_files=files, extra_tensors=tensors
        )

    def save_step(self, counters: Counters) -> None:
        """A checkpoint named after its step; only the newest ``train.keep_last`` of those stay."""
        self.save(step_dir_name(counters.step), counters, counters.best_val)
        if self.dist.is_main:
            prune_step_checkpoints(self.directory, self.cfg.train.keep_last)

    def restore(self, path: str | Path, force: bool, say: Callable[[str], None]) -> Counters:
        """Weights, optimizer, average, scaler and random state from a resumable checkpoint; its counters."""
        saved = load_resume_state(path)
        check_resume_config(saved.run_config, self.cfg.to_dict(), force)
        if saved.counters["world_size"] != self.dist.world_size:
            raise TinyLMError(
                f"resume: {saved.path} was written by {saved.counters['world_size']} process(es) and "
                f"this run has {self.dist.world_size}; resume with the same number of processes"
            )
        load_model_state(self.model, saved.path, read_model_state(saved.path, self.model.config))
        self.optim.restore(saved)
        counters = Counters(
            saved.step, saved.counters["tokens_seen"], float(saved.counters["best_val"]), saved.counters["bad_evals"]
        )
        restore_rng(saved.rng_per_rank[self.dist.rank])  # last: nothing after it draws random numbers before step 1
        say(f"train: resuming from {saved.path} at step {counters.step}")
        return counters


@dataclass(frozen=True)
class RunLogs:
    """What a session reports besides its checkpoints, written by rank 0: metrics.csv, epochs.csv,
    TensorBoard and the progress display (a bar on a terminal, a line every log_interval steps)."""

    say: Callable[[str], None]  # logs on rank 0 only
    metrics: MetricsLog | None
    epoch_log: MetricsLog | None
    writer: object | None  # TensorBoard's SummaryWriter
    progress: Progress | None

    def record_step(self, counters: Counters, lr: float, tok_s: float, elapsed: float, device) -> dict:
        """The progress display and TensorBoard after a step; returns the step's metrics row."""
        if self.progress is not None:
            memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            self.progress.update(counters.step, counters.last_loss, tok_s, elapsed, memory)
        if self.writer is not None:
            for name, value in (("train/loss", counters.last_loss), ("train/lr", lr), ("train/tokens_per_s", tok_s)):
                self.writer.add_scalar(name, value, counters.step)
        return {
            "step": counters.step,
            "tokens": counters.tokens_seen,
            "lr": f"{lr:.3e}",
            "train_loss": repr(counters.last_loss),
            "tokens_per_s": f"{tok_s:.1f}",
            "elapsed_s": f"{elapsed:.2f}",
        }

    def message(self, text: str) -> None:
        (self.progress.message if self.progress is not None else self.say)(text)

    def close(self) -> None:
        for closable in (self.progress, self.writer):
            if closable is not None:
                closable.close()


@dataclass(frozen=True)
class Run:
    """What the setup built for one session; the loop changes only the counters and the tensors."""

    cfg: RunConfig  # as saved: the resolved model config, and the step count the schedule follows
    dist: DistContext
    device: torch.device
    model: GPT
    forward: Callable  # what a step runs: the model or its DDP wrapper, maybe compiled, with its forward options
    ddp_model: torch.nn.Module | None  # for DDP's no_sync while gradients accumulate
    optim: Optimization
    data: TrainData
    checkpoints: Checkpoints
    logs: RunLogs
    document_start: int | None  # the token that opens a story when attention stays within stories


# ---------------------------------------------------------------------------------------- setup
def train(
    cfg: RunConfig,
    prepared: PreparedData,
    out_dir: str | Path,
    *,
    resume: str | Path | None = None,
    force: bool = False,
    on_evaluate: Callable[[GPT, int, int], None] | None = None,
) -> TrainResult:
    """Train (or, with ``resume``, continue training) and write checkpoints into ``out_dir``.
    ``on_evaluate(model, step, tokens_seen)`` runs on rank 0 after each evaluation, with the random
    state saved and restored around it (what it draws cannot change the run).

    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 logs and writes files.
    """
    dist = dist_utils.setup_distributed(cfg.train.device)
    try:
        run, counters = setup(cfg, prepared, Path(out_dir), dist, resume, force)
        return train_loop(run, counters, on_evaluate)
    finally:
        dist_utils.cleanup(dist)


def setup(
    cfg: RunConfig,
    prepared: PreparedData,
    out_dir: Path,
    dist: DistContext,
    resume: str | Path | None = None,
    force: bool = False,
) -> tuple[Run, Counters]:
    """Everything one session trains with, and the counters it starts from. The order is the random
    stream's: the seed, then the model's initial weights; a resumed run's RNG state comes back after
    everything that draws."""
    check_config(cfg)  # a config built in code is checked like a loaded one, before any work
    say = log.info if dist.is_main else _quiet
    data = setup_data(cfg, prepared.splits, dist)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    device = setup_process(cfg.train, dist)
    model = setup_model(cfg, prepared, out_dir, dist, device)
    cfg = setup_schedule(dataclasses.replace(cfg, model=model.config), data, say)
    optim = setup_optimizer(model, cfg.train, device)
    checkpoints = setup_checkpointing(cfg, out_dir, prepared.tokenizer, model, optim, dist)
    counters = Counters() if resume is None else checkpoints.restore(resume, force, say)
    document_start = prepared.tokenizer.sos_id if cfg.train.document_attention else None
    ddp_model = dist_utils.wrap_ddp(model, dist, device) if dist.enabled else None
    forward = setup_forward(ddp_model if ddp_model is not None else model, cfg.train, document_start)
    say(_header(cfg.train, model, device, data, dist))
    logs = setup_logs(cfg, out_dir, dist, say, counters.step, resumed=resume is not None)
    return Run(cfg, dist, device, model, forward, ddp_model, optim, data, checkpoints, logs, document_start), counters


def setup_data(cfg: RunConfig, splits: dict, dist: DistContext) -> TrainData:
    """The training batches (with train.epochs, each epoch visits every row once) and the fixed
    validation batches, checked against the split sizes."""
    tc, context_length = cfg.train, cfg.model.context_length
    if "valid" not in splits:
        raise TinyLMError("no validation split was prepared")
    batch_size = per_rank_batch_size(tc, dist.world_size)
    rows_per_step = batch_size * tc.grad_accum_steps * dist.world_size
    check_batch_fits(splits["train"], rows_per_step, context_length, cfg.data.batching)
    train_batches = Batches(
        splits["train"],
        context_length,
        cfg.data.batching,
        seed=tc.seed,
        epoch_rows=rows_per_step if tc.epochs else None,
    )
    valid_batches = Batches(splits["valid"], context_length, cfg.data.batching, seed=tc.seed + 1)
    return TrainData(train_batches, valid_batches, batch_size, rows_per_step)


def setup_process(tc: TrainConfig, dist: DistContext) -> torch.device:
    """Threads, seeds, and the device this process trains on (checked for the precision)."""
    if tc.threads:
        torch.set_num_threads(tc.threads)
    seed_everything(tc.seed)
    device = dist_utils.rank_device(dist, resolve_device(tc.device))
    check_precision(device, tc.precision)
    return device


def setup_model(cfg: RunConfig, prepared: PreparedData, out_dir: Path, dist: DistContext, device) -> GPT:
    """The model on ``device``, the same initial weights on every rank (pretrained embeddings when
    configured); then each rank's own dropout stream."""
    model = build_model(cfg, prepared.tokenizer.vocab_size).to(device)
    if cfg.train.init_from:
        start_from_weights(model, cfg.train.init_from, prepared.tokenizer)
    elif getattr(cfg, "embeddings", None) is not None and cfg.embeddings.kind != "none":
        apply_pretrained_embeddings(
            model,
            prepared.tokenizer,
            cfg.embeddings,
            prepared.splits["train"].ids,
            out_dir if dist.is_main else None,
            cache_dir=prepared.data_dir,
        )
    if dist.rank:
        torch.manual_seed(cfg.train.seed + 1_000_003 * dist.rank)  # ranks draw different dropout masks
    return model


def start_from_weights(model: GPT, checkpoint: str, tokenizer) -> None:
    """Copy a checkpoint's weights into ``model``: the same architecture and the same vocabulary."""
    trained, trained_tokenizer, _ = load_checkpoint(checkpoint)
    pieces = lambda tok: (tok.type_name, [tok.decode([i]) for i in range(tok.vocab_size)])  # noqa: E731
    if pieces(trained_tokenizer) != pieces(tokenizer):
        raise TinyLMError(f"train.init_from={checkpoint}: its tokenizer is not the one this run prepared")
    try:
        model.load_state_dict(trained.state_dict())
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise TinyLMError(f"train.init_from={checkpoint}: its model does not match model.*: {first}") from None


def setup_schedule(cfg: RunConfig, data: TrainData, say: Callable[[str], None]) -> RunConfig:
    """The config with the step count the learning-rate schedule follows and the run stops at:
    train.max_steps, or what train.epochs or train.max_tokens make of the data."""
    tc = cfg.train
    if tc.epochs:
        tc = dataclasses.replace(tc, max_steps=tc.epochs * data.train.steps_per_epoch)
        say(
            f"train: {tc.epochs} epoch(s) of {data.train.steps_per_epoch} steps ({data.rows_per_step} rows each) "
            f"= {tc.max_steps} steps"
        )
    if tc.max_tokens:  # every row is context_length positions
        step_tokens = data.rows_per_step * cfg.model.context_length
        tc = dataclasses.replace(tc, max_steps=math.ceil(tc.max_tokens / step_tokens))
        say(f"train: {tc.max_tokens:,} tokens at {step_tokens:,} per step = {tc.max_steps:,} steps")
    return dataclasses.replace(cfg, train=tc)


def setup_optimizer(model: GPT, tc: TrainConfig, device) -> Optimization:
    """The optimizer (train.optimizer), the gradient scaler fp16 needs, and the weight average."""
    return Optimization(
        make_optimizer(model, tc),
        make_grad_scaler(device, tc.precision),
        EMA(model, tc.ema_decay) if tc.ema_decay else None,
    )


def setup_checkpointing(
    cfg: RunConfig, out_dir: Path, tokenizer: Tokenizer, model: GPT, optim: Optimization, dist: DistContext
) -> Checkpoints:
    """Where the run's checkpoints go, and what each resumable one holds."""
    return Checkpoints(out_dir / "checkpoints", cfg, tokenizer, model, optim, dist)


def setup_forward(run_model: Callable, tc: TrainConfig, document_start: int | None = None) -> Callable:
    """What a training step calls: ``run_model`` (the model or its DDP wrapper) with gradient
    checkpointing and attention within stories bound, through ``torch.compile`` (inductor) with
    ``train.compile``.

    The whole model is compiled, except with our own gradient checkpointing, whose autograd Function
    Dynamo cannot trace: then each block is compiled and the Function stays ours
    (``compiled_tinylm_checkpoint``). The optimizer step is AdamW's fused kernel (``make_optimizer``),
    not a compiled one: see docs/training.md for the measurements."""
    compile_blocks = tc.compile and tc.grad_checkpointing and tc.checkpoint_impl == "tinylm"
    if tc.compile and not compile_blocks:
        run_model = torch.compile(run_model, options=TRAIN_COMPILE_OPTIONS)
    options = {}
    if tc.grad_checkpointing:
        options["checkpoint_blocks"] = (
            compiled_tinylm_checkpoint(TRAIN_COMPILE_OPTIONS)
            if compile_blocks
            else checkpoint_function(tc.checkpoint_impl)
        )
    if document_start is not None:
        options["document_start"] = document_start
    return partial(run_model, **options) if options else run_model


def setup_logs(
    cfg: RunConfig, out_dir: Path, dist: DistContext, say: Callable[[str], None], first_step: int, resumed: bool
) -> RunLogs:
    """config.yaml (every run writes the full config it trains with), the metrics files (a resumed
    run drops the rows after its step: it writes them again), TensorBoard and the progress display."""
    tc = cfg.train
    if not dist.is_main:
        return RunLogs(say, None, None, None, None)
    cfg.save(out_dir / "config.yaml")
    metrics = MetricsLog(out_dir / "metrics.csv", fresh=not resumed)
    epoch_log = MetricsLog(out_dir / "epochs.csv", EPOCH_COLUMNS, fresh=not resumed) if tc.epochs else None
    for log_file in (metrics, epoch_log):
        if resumed and log_file is not None:
            log_file.truncate_after(first_step)
    writer = _tensorboard_writer(out_dir) if tc.tensorboard else None
    progress = Progress(tc, first_step, say) if tc.progress else None
    return RunLogs(say, metrics, epoch_log, writer, progress)


def _header(tc: TrainConfig, model: GPT, device, data: TrainData, dist: DistContext) -> str:
    return (
        f"train: {model.num_parameters():,} parameters on {device}, context {model.config.context_length}, "
        f"batch {data.batch_size} x {tc.grad_accum_steps} accumulation x {dist.world_size} process(es), "
        f"{tc.precision}"
        + (", torch.compile" if tc.compile else "")
        + (f", gradient checkpointing ({tc.checkpoint_impl})" if tc.grad_checkpointing else "")
    )


def _tensorboard_writer(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter  # deferred: optional, and slow to import
    except ImportError as exc:
        raise TinyLMError("train.tensorboard=true needs the tensorboard package (pip install tensorboard)") from exc
    return SummaryWriter(log_dir=str(out_dir / "tensorboard"))


def _quiet(*args, **kwargs) -> None:
    """``say`` on ranks other than 0: one process reports for all."""


# ------------------------------------------------------------------------------------- the loop
def train_loop(run: Run, counters: Counters, on_evaluate: Callable[[GPT, int, int], None] | None = None) -> TrainResult:
    """Step until max_steps, early stopping or the wall-clock budget, evaluating, logging and saving
    on the way; then the ``last`` checkpoint."""
    tc, logs = run.cfg.train, run.logs
    save_every = tc.save_interval or tc.eval_interval
    start = time.perf_counter()  # tokens/s, max_minutes and the wall schedule count from this session's start
    stopped = "max_steps"
    for step in range(counters.step, tc.max_steps):
        lr = learning_rate(run, step, start)
        train_step(run, counters, step, lr)
        elapsed = time.perf_counter() - start
        tok_s = counters.session_tokens / max(elapsed, 1e-9)
        row = logs.record_step(counters, lr, tok_s, elapsed, run.device)
        is_last, out_of_time = counters.step == tc.max_steps, budget_spent(run, elapsed)
        evaluated = counters.step % tc.eval_interval == 0 or is_last or out_of_time
        if evaluated and evaluate(run, counters, row, tok_s, on_evaluate):
            stopped = "early_stopping"
        if logs.metrics is not None and (evaluated or counters.step % tc.log_interval == 0):
            logs.metrics.write(row)
        if tc.epochs and counters.step % run.data.train.steps_per_epoch == 0:
            end_epoch(run, counters, row, elapsed)
        if counters.step % save_every == 0 and not is_last:
            run.checkpoints.save_step(counters)
        if out_of_time:
            stopped = "max_minutes"
        if stopped != "max_steps":
            break
    logs.close()
    seconds = time.perf_counter() - start
    run.checkpoints.save("last", counters, counters.best_val)
    dist_utils.barrier(run.dist)
    return TrainResult(
        counters.step,
        counters.best_val,
        counters.last_loss,
        seconds,
        counters.session_tokens / max(seconds, 1e-9),
        run.checkpoints.directory,
        stopped,
    )


def learning_rate(run: Run, step: int, start: float) -> float:
    """The schedule's rate at ``step``, the same on every rank; with train.schedule_clock=wall the
    decay follows the share of max_minutes spent since ``start`` (averaged over the ranks)."""
    tc, wall_fraction = run.cfg.train, None
    if wall_schedule_enabled(tc):
        wall_fraction = (time.perf_counter() - start) / (tc.max_minutes * 60)
        if run.dist.enabled:
            wall_fraction = all_reduce_sum([wall_fraction], run.dist, run.device)[0] / run.dist.world_size
    return lr_at(step, tc, wall_fraction)


def train_step(run: Run, counters: Counters, step: int, lr: float) -> None:
    """Forward and backward over this rank's micro-batches of ``step``, one update at ``lr``; a
    non-finite loss stops before the update."""
    tc = run.cfg.train
    run.optim.set_lr(lr)
    micro = micro_batches(run.data.train, step, run.data.batch_size, tc.grad_accum_steps, run.dist)
    loss, n_targets = accumulate_gradients(
        run.forward, micro, run.device, tc.precision, run.optim.scaler, run.dist, run.ddp_model, tc.label_smoothing
    )
    counters.last_loss = loss
    counters.epoch_loss_sum += loss * n_targets
    counters.epoch_targets += n_targets
    if not math.isfinite(loss):
        run.logs.close()
        raise TinyLMError(
            f"training loss became {loss} at step {step + 1}; stopped before that update, the last good checkpoint "
            f"is kept in {run.checkpoints.directory} (lower train.lr, enable train.grad_clip or use fp32)"
        )
    run.optim.step(run.model, tc.grad_clip)
    step_tokens = sum(x.numel() for x, _ in micro) * run.dist.world_size
    counters.tokens_seen += step_tokens
    counters.session_tokens += step_tokens
    counters.step = step + 1


def budget_spent(run: Run, elapsed: float) -> bool:
    """Whether train.max_minutes has run out; decided together, so every rank stops at the same step."""
    tc = run.cfg.train
    if tc.max_minutes is None:
        return False
    spent = elapsed >= tc.max_minutes * 60
    if run.dist.enabled:
        spent = all_reduce_sum([float(spent)], run.dist, run.device)[0] > 0
    return spent


def evaluate(
    run: Run, counters: Counters, row: dict, tok_s: float, on_evaluate: Callable[[GPT, int, int], None] | None = None
) -> bool:
    """The validation loss into ``row``; the ``best`` checkpoint when it improved; the progress line;
    ``on_evaluate`` on rank 0. Returns whether early stopping's patience has run out."""
    tc = run.cfg.train
    val = run_validation(run)
    row.update(val_loss=repr(val), val_ppl=f"{math.exp(min(val, 50)):.3f}")
    improved = val < counters.best_val
    counters.best_val, counters.bad_evals = (val, 0) if improved else (counters.best_val, counters.bad_evals + 1)
    if run.logs.writer is not None:
        run.logs.writer.add_scalar("valid/loss", val, counters.step)
    if improved:
        run.checkpoints.save("best", counters, val)
    run.logs.message(
        f"step {counters.step}: train {counters.last_loss:.4f}, valid {val:.4f} "
        f"(ppl {math.exp(min(val, 50)):.2f}), {tok_s:,.0f} tok/s"
    )
    if on_evaluate is not None and run.dist.is_main:
        # its own random stream: what it draws cannot change the run
        with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []), eval_mode(run.model):
            on_evaluate(run.model, counters.step, counters.tokens_seen)
    patience_spent = bool(tc.early_stopping_patience) and counters.bad_evals >= tc.early_stopping_patience
    if patience_spent:
        run.logs.say(
            f"train: early stopping at step {counters.step}: no validation improvement in "
            f"{counters.bad_evals} evaluations"
        )
    return patience_spent


def run_validation(run: Run) -> float:
    return validation_loss(
        run.model,
        run.data.valid,
        run.cfg,
        run.device,
        run.cfg.train.precision,
        run.dist,
        run.data.batch_size,
        run.document_start,
    )


def end_epoch(run: Run, counters: Counters, row: dict, elapsed: float) -> None:
    """The epoch's mean training loss and its validation loss into epochs.csv; the sum restarts."""
    epoch = counters.step // run.data.train.steps_per_epoch
    val = float(row["val_loss"]) if "val_loss" in row else run_validation(run)
    train_mean = counters.epoch_loss_sum / max(counters.epoch_targets, 1)
    if run.logs.epoch_log is not None:
        run.logs.epoch_log.write(
            {
                "step": counters.step,
                "epoch": epoch,
                "train_loss": f"{train_mean:.6f}",
                "val_loss": f"{val:.6f}",
                "train_ppl": f"{math.exp(min(train_mean, 50)):.3f}",
                "val_ppl": f"{math.exp(min(val, 50)):.3f}",
                "elapsed_s": f"{elapsed:.2f}",
            }
        )
    run.logs.say(f"epoch {epoch}/{run.cfg.train.epochs}: train {train_mean:.4f}, valid {val:.4f}")
    counters.epoch_loss_sum, counters.epoch_targets = 0.0, 0
