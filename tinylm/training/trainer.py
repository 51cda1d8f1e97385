"""The training loop: teacher forcing, AdamW, warmup + cosine, clipping, token-weighted gradient
accumulation, gradient checkpointing, mixed precision, DistributedDataParallel under torchrun,
periodic validation with early stopping, resumable checkpoints (exact resume), metrics CSV and
TensorBoard, progress (a bar on a terminal, a line every log_interval steps elsewhere).

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

from tinylm.config import RunConfig, check_config
from tinylm.constants import IGNORE_INDEX
from tinylm.data.prepare import Prepared
from tinylm.data.tokens import Batches
from tinylm.errors import TinyLMError
from tinylm.models.checkpoint import load_model_state, prune_step_checkpoints, read_model_state, save_checkpoint
from tinylm.models.embeddings import apply_pretrained_embeddings
from tinylm.models.gpt import GPT, eval_mode
from tinylm.tokenizers import Tokenizer
from tinylm.training import distributed as dist_utils
from tinylm.training.distributed import DistContext, all_reduce_sum, shard_rows
from tinylm.training.ema import EMA
from tinylm.training.grad_checkpoint import compiled_tinylm_checkpoint, enable_grad_checkpointing
from tinylm.training.metrics import EPOCH_COLUMNS, MetricsLog
from tinylm.training.optim import lr_at, make_optimizer, wall_schedule_enabled
from tinylm.training.precision import autocast, check_precision, make_grad_scaler
from tinylm.training.progress import Progress
from tinylm.training.resume import (
    capture_rng,
    check_resume_config,
    load_resume_state,
    restore_optimizer,
    restore_rng,
    state_payload,
    step_dir_name,
)

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    best_val_loss: float
    final_train_loss: float
    seconds: float
    tokens_per_s: float
    checkpoint_dir: Path
    stopped_because: str


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


def per_rank_batch_size(tc, world_size: int) -> int:
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


# dropout in compiled code draws from torch's generator exactly as eager code does: a compiled run
# masks the same units as an eager one, recomputation under checkpointing sees the same masks,
# and resume (which restores the generator) stays exact
COMPILE_OPTIONS = {"fallback_random": True}


def compile_for_training(model: GPT, run_model, tc):
    """``train.compile``: forward, loss and backward through ``torch.compile`` (inductor).

    The whole model (or its DDP wrapper) is compiled, except with our own gradient checkpointing,
    whose autograd Function Dynamo cannot trace: then each block is compiled and the Function
    stays ours (``compiled_tinylm_checkpoint``). The optimizer step is AdamW's fused kernel
    (``make_optimizer``), not a compiled one: see docs/training.md for the measurements."""
    if tc.grad_checkpointing and tc.checkpoint_impl == "tinylm":
        model.checkpoint_fn = compiled_tinylm_checkpoint(COMPILE_OPTIONS)
        return run_model
    return torch.compile(run_model, options=COMPILE_OPTIONS)


def _tensorboard_writer(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter  # deferred: optional, and slow to import
    except ImportError as exc:
        raise TinyLMError("train.tensorboard=true needs the tensorboard package (pip install tensorboard)") from exc
    return SummaryWriter(log_dir=str(out_dir / "tensorboard"))


@dataclass
class TrainState:
    """One training session: what it trains and writes, its clock, and the counters a resumable
    checkpoint saves (``step`` = steps done, ``tokens_seen``, ``best_val``, ``bad_evals``)."""

    cfg: RunConfig  # as saved: the resolved model config, and with train.epochs the step count
    dist: DistContext
    device: torch.device
    out_dir: Path
    say: Callable[[str], None]  # logs on rank 0 only
    tokenizer: Tokenizer
    model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: EMA | None
    batch_size: int  # sequences per micro-batch on this rank
    train_batches: Batches
    valid_batches: Batches
    metrics: MetricsLog | None  # metrics.csv and epochs.csv, written by rank 0
    epoch_log: MetricsLog | None
    step: int = 0
    tokens_seen: int = 0
    best_val: float = math.inf
    bad_evals: int = 0
    run_model: Callable | None = None  # what a step runs: the model, or its DDP wrapper, maybe compiled
    ddp_model: torch.nn.Module | None = None
    writer: object = None  # TensorBoard's SummaryWriter
    progress: Progress | None = None  # a bar on a terminal, a line every log_interval steps elsewhere
    start: float = 0.0
    session_tokens: int = 0
    epoch_loss_sum: float = 0.0  # the running epoch (a resumed run restarts the sum)
    epoch_targets: int = 0
    last_loss: float = math.nan
    stopped: str = "max_steps"
    on_evaluate: Callable[[GPT, int, int], None] | None = None


def train(
    cfg: RunConfig,
    prepared: Prepared,
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
        say = log.info if dist.is_main else (lambda *a, **k: None)
        state = _set_up(cfg, prepared, Path(out_dir), say, dist, fresh=resume is None)
        state.on_evaluate = on_evaluate
        if resume is not None:
            _resume(state, resume, force)
        _start_session(state)
        return _run_steps(state)
    finally:
        dist_utils.cleanup(dist)


def _set_up(cfg: RunConfig, prepared: Prepared, out_dir: Path, say, dist: DistContext, fresh: bool) -> TrainState:
    """The option values, the process (threads, seeds, device), the model, its batches, optimizer,
    average and logs."""
    tc = check_config(cfg).train  # a config built in code is checked like a loaded one, before any work
    batch_size = per_rank_batch_size(tc, dist.world_size)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    seed_everything(tc.seed)
    device = dist_utils.rank_device(dist, resolve_device(tc.device))
    check_precision(device, tc.precision)
    scaler = make_grad_scaler(device, tc.precision)
    tokenizer, splits = prepared.tokenizer, prepared.splits
    model = build_model(cfg, tokenizer.vocab_size).to(device)  # the same initial weights on every rank
    if getattr(cfg, "embeddings", None) is not None and cfg.embeddings.kind != "none":
        apply_pretrained_embeddings(
            model,
            tokenizer,
            cfg.embeddings,
            splits["train"].ids,
            out_dir if dist.is_main else None,
            cache_dir=prepared.data_dir,
        )
    if dist.rank:
        torch.manual_seed(tc.seed + 1_000_003 * dist.rank)  # ranks draw different dropout masks
    cfg = dataclasses.replace(cfg, model=model.config)  # the resolved model config goes on disk
    context_length = model.config.context_length
    if "valid" not in splits:
        raise TinyLMError("no validation split was prepared")
    rows_per_step = batch_size * tc.grad_accum_steps * dist.world_size
    check_batch_fits(splits["train"], rows_per_step, context_length, cfg.data.batching)
    train_batches = Batches(
        splits["train"],
        context_length,
        cfg.data.batching,
        seed=tc.seed,
        epoch_rows=rows_per_step if tc.epochs else None,
    )
    if tc.epochs:  # the step count follows from the data: the schedule and the saved config use it
        tc = dataclasses.replace(tc, max_steps=tc.epochs * train_batches.steps_per_epoch)
        cfg = dataclasses.replace(cfg, train=tc)
        say(
            f"train: {tc.epochs} epoch(s) of {train_batches.steps_per_epoch} steps ({rows_per_step} rows each) = "
            f"{tc.max_steps} steps"
        )
    if tc.max_tokens:  # likewise from the token budget (every row is context_length positions)
        step_tokens = rows_per_step * context_length
        tc = dataclasses.replace(tc, max_steps=math.ceil(tc.max_tokens / step_tokens))
        cfg = dataclasses.replace(cfg, train=tc)
        say(f"train: {tc.max_tokens:,} tokens at {step_tokens:,} per step = {tc.max_steps:,} steps")
    valid_batches = Batches(splits["valid"], context_length, cfg.data.batching, seed=tc.seed + 1)
    optimizer = make_optimizer(model, tc)
    ema = EMA(model, tc.ema_decay) if tc.ema_decay else None
    if tc.grad_checkpointing:
        enable_grad_checkpointing(model, tc.checkpoint_impl)
    metrics = MetricsLog(out_dir / "metrics.csv", fresh=fresh) if dist.is_main else None
    epoch_log = MetricsLog(out_dir / "epochs.csv", EPOCH_COLUMNS, fresh=fresh) if dist.is_main and tc.epochs else None
    return TrainState(
        cfg,
        dist,
        device,
        out_dir,
        say,
        tokenizer,
        model,
        optimizer,
        scaler,
        ema,
        batch_size,
        train_batches,
        valid_batches,
        metrics,
        epoch_log,
    )


def _resume(state: TrainState, resume: str | Path, force: bool) -> None:
    """Weights, optimizer, average, scaler, counters and random state from a resumable checkpoint."""
    saved = load_resume_state(resume)
    check_resume_config(saved.run_config, state.cfg.to_dict(), force)
    if saved.counters["world_size"] != state.dist.world_size:
        raise TinyLMError(
            f"resume: {saved.path} was written by {saved.counters['world_size']} process(es) and "
            f"this run has {state.dist.world_size}; resume with the same number of processes"
        )
    load_model_state(state.model, saved.path, read_model_state(saved.path, state.model.config))
    restore_optimizer(state.optimizer, saved)
    if state.ema is not None:  # a run resumed with EMA must have saved its average
        where = saved.path / "ema.safetensors"
        try:
            state.ema.load_state_tensors(load_file(str(where)))
        except Exception as exc:  # missing, unreadable or not this model's average
            raise TinyLMError(f"resume: the weight average {where} is unusable ({exc})") from exc
    if saved.scaler_state:
        state.scaler.load_state_dict(saved.scaler_state)
    state.step, state.tokens_seen, state.best_val, state.bad_evals = (
        saved.step,
        saved.counters["tokens_seen"],
        float(saved.counters["best_val"]),
        saved.counters["bad_evals"],
    )
    restore_rng(saved.rng_per_rank[state.dist.rank])  # last: nothing below draws random numbers before step 1
    for log_file in (state.metrics, state.epoch_log):
        if log_file is not None:
            log_file.truncate_after(state.step)
    state.say(f"train: resuming from {saved.path} at step {state.step}")


def _document_start(state: TrainState) -> int | None:
    """The token that opens a story when attention stays within stories (train.document_attention)."""
    return state.tokenizer.sos_id if state.cfg.train.document_attention else None


def _start_session(state: TrainState) -> None:
    """The saved config; DDP and compilation around the model; the header line, TensorBoard, the
    clock and the progress display."""
    tc, dist = state.cfg.train, state.dist
    if dist.is_main:
        state.cfg.save(state.out_dir / "config.yaml")
    state.ddp_model = dist_utils.wrap_ddp(state.model, dist, state.device) if dist.enabled else None
    state.run_model = state.ddp_model if state.ddp_model is not None else state.model
    if tc.compile:
        state.run_model = compile_for_training(state.model, state.run_model, tc)
    if tc.document_attention:
        state.run_model = partial(state.run_model, document_start=_document_start(state))
    state.say(
        f"train: {state.model.num_parameters():,} parameters on {state.device}, context "
        f"{state.model.config.context_length}, batch {state.batch_size} x {tc.grad_accum_steps} accumulation "
        f"x {dist.world_size} process(es), {tc.precision}"
        + (", torch.compile" if tc.compile else "")
        + (f", gradient checkpointing ({tc.checkpoint_impl})" if tc.grad_checkpointing else "")
    )
    state.writer = _tensorboard_writer(state.out_dir) if tc.tensorboard and dist.is_main else None
    state.start = time.perf_counter()
    if tc.progress and dist.is_main:
        state.progress = Progress(tc, state.step, state.say)


def _run_steps(state: TrainState) -> TrainResult:
    """Step until max_steps, early stopping or the wall-clock budget, evaluating, logging and saving
    on the way; then the ``last`` checkpoint."""
    tc, dist = state.cfg.train, state.dist
    save_every = tc.save_interval or tc.eval_interval
    by_wall = wall_schedule_enabled(tc)  # like max_minutes, the wall budget counts from this session's start
    for step in range(state.step, tc.max_steps):
        lr = _update(state, step, by_wall)
        elapsed = time.perf_counter() - state.start
        tok_s = state.session_tokens / max(elapsed, 1e-9)
        if state.progress is not None:
            memory = torch.cuda.max_memory_allocated(state.device) / 2**30 if state.device.type == "cuda" else None
            state.progress.update(state.step, state.last_loss, tok_s, elapsed, memory)
        is_last = state.step == tc.max_steps
        out_of_time = tc.max_minutes is not None and elapsed >= tc.max_minutes * 60
        if tc.max_minutes is not None and dist.enabled:  # every rank must stop at the same step
            out_of_time = all_reduce_sum([float(out_of_time)], dist, state.device)[0] > 0
        row = {
            "step": state.step,
            "tokens": state.tokens_seen,
            "lr": f"{lr:.3e}",
            "train_loss": repr(state.last_loss),
            "tokens_per_s": f"{tok_s:.1f}",
            "elapsed_s": f"{elapsed:.2f}",
        }
        if state.writer is not None:
            for name, value in (("train/loss", state.last_loss), ("train/lr", lr), ("train/tokens_per_s", tok_s)):
                state.writer.add_scalar(name, value, state.step)
        evaluate = state.step % tc.eval_interval == 0 or is_last or out_of_time
        if evaluate:
            _evaluate(state, row, tok_s)
        if state.metrics is not None and (evaluate or state.step % tc.log_interval == 0):
            state.metrics.write(row)
        if tc.epochs and state.step % state.train_batches.steps_per_epoch == 0:
            _end_epoch(state, row, elapsed)
        if state.step % save_every == 0 and not is_last:
            save_resumable(state, step_dir_name(state.step), state.best_val)
            if dist.is_main:
                prune_step_checkpoints(state.out_dir / "checkpoints", tc.keep_last)
        if out_of_time:
            state.stopped = "max_minutes"
        if state.stopped != "max_steps":
            break
    _close(state)
    seconds = time.perf_counter() - state.start
    save_resumable(state, "last", state.best_val)
    dist_utils.barrier(dist)
    return TrainResult(
        state.step,
        state.best_val,
        state.last_loss,
        seconds,
        state.session_tokens / max(seconds, 1e-9),
        state.out_dir / "checkpoints",
        state.stopped,
    )


def _update(state: TrainState, step: int, by_wall: bool) -> float:
    """The schedule's learning rate (the same on every rank), forward and backward over this rank's
    micro-batches of ``step``, one optimizer step; a non-finite loss stops before the update."""
    tc, wall_fraction = state.cfg.train, None
    if by_wall:
        wall_fraction = (time.perf_counter() - state.start) / (tc.max_minutes * 60)
        if state.dist.enabled:
            wall_fraction = all_reduce_sum([wall_fraction], state.dist, state.device)[0] / state.dist.world_size
    lr = lr_at(step, tc, wall_fraction)
    for group in state.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups keep their own peak rate
    micro = micro_batches(state.train_batches, step, state.batch_size, tc.grad_accum_steps, state.dist)
    state.last_loss, n_targets = accumulate_gradients(
        state.run_model,
        micro,
        state.device,
        tc.precision,
        state.scaler,
        state.dist,
        state.ddp_model,
        tc.label_smoothing,
    )
    state.epoch_loss_sum += state.last_loss * n_targets
    state.epoch_targets += n_targets
    if not math.isfinite(state.last_loss):
        _close(state)
        raise TinyLMError(
            f"training loss became {state.last_loss} at step {step + 1}; stopped before that update, the last good "
            f"checkpoint is kept in {state.out_dir / 'checkpoints'} (lower train.lr, enable train.grad_clip or use "
            "fp32)"
        )
    if tc.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), tc.grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    if state.ema is not None:
        state.ema.update(state.model)
    step_tokens = sum(x.numel() for x, _ in micro) * state.dist.world_size
    state.tokens_seen += step_tokens
    state.session_tokens += step_tokens
    state.step = step + 1
    return lr


def _evaluate(state: TrainState, row: dict, tok_s: float) -> None:
    """The validation loss into ``row``; the ``best`` checkpoint when it improved; the progress
    line; early stopping after ``early_stopping_patience`` evaluations without improvement."""
    tc = state.cfg.train
    val = validation_loss(
        state.model,
        state.valid_batches,
        state.cfg,
        state.device,
        tc.precision,
        state.dist,
        state.batch_size,
        _document_start(state),
    )
    row.update(val_loss=repr(val), val_ppl=f"{math.exp(min(val, 50)):.3f}")
    improved = val < state.best_val
    state.best_val, state.bad_evals = (val, 0) if improved else (state.best_val, state.bad_evals + 1)
    if state.writer is not None:
        state.writer.add_scalar("valid/loss", val, state.step)
    if improved:
        save_resumable(state, "best", val)
    msg = (
        f"step {state.step}: train {state.last_loss:.4f}, valid {val:.4f} (ppl {math.exp(min(val, 50)):.2f}), "
        f"{tok_s:,.0f} tok/s"
    )
    (state.progress.message if state.progress is not None else state.say)(msg)
    if state.on_evaluate is not None and state.dist.is_main:
        devices = [state.device] if state.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            was_training = state.model.training
            state.model.eval()
            try:
                state.on_evaluate(state.model, state.step, state.tokens_seen)
            finally:
                state.model.train(was_training)
    if tc.early_stopping_patience and state.bad_evals >= tc.early_stopping_patience:
        state.stopped = "early_stopping"
        state.say(
            f"train: early stopping at step {state.step}: no validation improvement in {state.bad_evals} evaluations"
        )


def _end_epoch(state: TrainState, row: dict, elapsed: float) -> None:
    """The epoch's mean training loss and its validation loss into epochs.csv; the sum restarts."""
    tc, epoch = state.cfg.train, state.step // state.train_batches.steps_per_epoch
    val = (
        float(row["val_loss"])
        if "val_loss" in row
        else validation_loss(
            state.model,
            state.valid_batches,
            state.cfg,
            state.device,
            tc.precision,
            state.dist,
            state.batch_size,
            _document_start(state),
        )
    )
    train_mean = state.epoch_loss_sum / max(state.epoch_targets, 1)
    if state.epoch_log is not None:
        state.epoch_log.write(
            {
                "step": state.step,
                "epoch": epoch,
                "train_loss": f"{train_mean:.6f}",
                "val_loss": f"{val:.6f}",
                "train_ppl": f"{math.exp(min(train_mean, 50)):.3f}",
                "val_ppl": f"{math.exp(min(val, 50)):.3f}",
                "elapsed_s": f"{elapsed:.2f}",
            }
        )
    state.say(f"epoch {epoch}/{tc.epochs}: train {train_mean:.4f}, valid {val:.4f}")
    state.epoch_loss_sum, state.epoch_targets = 0.0, 0


def save_resumable(state: TrainState, name: str, val_loss: float) -> None:
    """A resumable checkpoint of the steps done, written by rank 0 (with EMA, the average also as a
    model of its own); a collective call under DDP, which gathers every rank's RNG state."""
    rngs = dist_utils.gather_objects(capture_rng(), state.dist)
    if not state.dist.is_main:
        return
    ckpt_dir = state.out_dir / "checkpoints"
    counters = {
        "step": state.step,
        "data_position": state.step,
        "tokens_seen": state.tokens_seen,
        "best_val": state.best_val,
        "bad_evals": state.bad_evals,
        "world_size": state.dist.world_size,
    }
    tensors, files = state_payload(state.optimizer, state.scaler, rngs, counters)
    meta = {"step": state.step, "val_loss": val_loss, "tokens_seen": state.tokens_seen}
    if state.ema is not None:
        tensors["ema.safetensors"] = state.ema.state_tensors()
        if name != "best":  # the averaged weights as a model of their own: evaluate / generate it
            save_checkpoint(
                ckpt_dir / "ema",
                state.ema.averaged_model(state.model),
                state.tokenizer,
                state.cfg,
                {**meta, "ema_decay": state.cfg.train.ema_decay, "ema_updates": state.ema.updates},
            )
    save_checkpoint(
        ckpt_dir / name, state.model, state.tokenizer, state.cfg, meta, extra_files=files, extra_tensors=tensors
    )


def _close(state: TrainState) -> None:
    for closable in (state.progress, state.writer):
        if closable is not None:
            closable.close()
