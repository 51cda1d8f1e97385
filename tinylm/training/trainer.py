"""The training loop: teacher forcing, AdamW, warmup + cosine, clipping, token-weighted gradient
accumulation, gradient checkpointing, mixed precision, DistributedDataParallel under torchrun,
periodic validation with early stopping, resumable checkpoints (exact resume), metrics CSV and
TensorBoard, a progress bar.

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
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tinylm.config import RunConfig
from tinylm.constants import IGNORE_INDEX
from tinylm.data.prepare import Prepared
from tinylm.data.tokens import Batches
from tinylm.errors import TinyLMError
from tinylm.models.checkpoint import load_model_state, prune_step_checkpoints, read_model_state, save_checkpoint
from tinylm.models.embeddings import apply_pretrained_embeddings
from tinylm.models.gpt import GPT, eval_mode
from tinylm.training import distributed as dist_utils
from tinylm.training.distributed import DistContext, all_reduce_sum, shard_rows
from tinylm.training.ema import EMA
from tinylm.training.grad_checkpoint import compiled_tinylm_checkpoint, enable_grad_checkpointing, make_checkpoint_fn
from tinylm.training.metrics import EPOCH_COLUMNS, MetricsLog
from tinylm.training.optim import lr_at, make_optimizer, wall_schedule_enabled
from tinylm.training.precision import autocast, check_precision, make_grad_scaler
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
    if tc.grad_accum_steps < 1:
        raise TinyLMError(f"train.grad_accum_steps must be >= 1 (got {tc.grad_accum_steps})")
    if tc.global_batch_size is None:
        if tc.batch_size < 1:
            raise TinyLMError(f"train.batch_size must be >= 1 (got {tc.batch_size})")
        return tc.batch_size
    parts = world_size * tc.grad_accum_steps
    if tc.global_batch_size < 1 or tc.global_batch_size % parts:
        raise TinyLMError(
            f"train.global_batch_size={tc.global_batch_size} is not divisible by world size {world_size} x "
            f"train.grad_accum_steps {tc.grad_accum_steps} = {parts}; use a multiple of {parts}")
    return tc.global_batch_size // parts


def check_batch_fits(split, rows_per_step: int, context_length: int, mode: str) -> None:
    """A step's global batch must not ask for more data than the training split holds."""
    if mode == "stories" and rows_per_step > split.n_docs:
        raise TinyLMError(f"the global batch of {rows_per_step} sequences is larger than the train split's "
                          f"{split.n_docs} documents; lower train.batch_size or train.grad_accum_steps")
    if mode == "packed" and rows_per_step * context_length > split.n_tokens:
        raise TinyLMError(
            f"the global batch of {rows_per_step} x {context_length} = {rows_per_step * context_length:,} tokens is "
            f"larger than the train split's {split.n_tokens:,} tokens; lower train.batch_size or train.grad_accum_steps")


def micro_batches(batches: Batches, step: int, batch_size: int, accum: int, ctx: DistContext) -> list:
    """This rank's micro-batches of ``step``: rows (m * world + rank) * B .. + B of the global batch."""
    return [batches.get(step, *shard_rows(m, ctx.rank, ctx.world_size, batch_size)) for m in range(accum)]


def accumulate_gradients(run_model, micro: list, device, precision: str = "fp32", scaler=None,
                         ctx: DistContext | None = None, ddp_model=None,
                         label_smoothing: float = 0.0) -> tuple[float, int]:
    """Forward and backward over the micro-batches; returns (mean loss per target token, targets).

    The gradient equals that of one batch holding every micro-batch of every rank: each summed
    loss is divided by the global number of target tokens (weighting by tokens, not by
    micro-batch), times the world size because DDP averages gradients over ranks. Gradients are
    synchronised only on the last micro-batch.
    """
    ctx = ctx or DistContext()
    local_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
    (n_targets,) = all_reduce_sum([local_targets], ctx, device)
    n_targets = max(int(n_targets), 1)
    step_loss = 0.0
    # only when asked for: a reference model wrapped by the benchmarks takes no such argument
    smoothing = {"label_smoothing": label_smoothing} if label_smoothing else {}
    for m, (x, y) in enumerate(micro):
        no_sync = ddp_model is not None and ctx.enabled and m < len(micro) - 1
        with ddp_model.no_sync() if no_sync else contextlib.nullcontext():
            with autocast(device, precision):
                _, loss_sum = run_model(x.to(device), y.to(device), loss_reduction="sum", **smoothing)
            loss = loss_sum * ctx.world_size / n_targets
            (scaler.scale(loss) if scaler is not None else loss).backward()
        step_loss += float(loss_sum.detach())
    (total,) = all_reduce_sum([step_loss], ctx, device)
    return total / n_targets, n_targets


@torch.no_grad()
def validation_loss(model, batches: Batches, cfg: RunConfig, device, precision: str = "fp32",
                    ctx: DistContext | None = None, batch_size: int | None = None) -> float:
    """Mean token NLL over ``eval_batches`` fixed batches (the same every time), or the whole split.

    An evaluation batch holds ``batch_size * world_size`` rows; under DDP each rank scores its own
    rows (or whole batches of the sequential pass) and the sums are all-reduced, so N ranks report
    the loss one process with N times the batch would."""
    ctx = ctx or DistContext()
    batch_size = batch_size or cfg.train.batch_size
    with eval_mode(model):
        total, count = 0.0, 0
        if cfg.train.eval_batches > 0:
            rows = shard_rows(0, ctx.rank, ctx.world_size, batch_size)
            source = (batches.get(i, *rows) for i in range(cfg.train.eval_batches))
        else:
            source = (xy for i, xy in enumerate(batches.sequential(batch_size * ctx.world_size))
                      if i % ctx.world_size == ctx.rank)
        for x, y in source:
            with autocast(device, precision):
                _, loss = model(x.to(device), y.to(device), loss_reduction="sum")
            total += float(loss)
            count += int((y != IGNORE_INDEX).sum())
        total, count = all_reduce_sum([total, count], ctx, device)
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


def _restore_ema(ema: EMA, ckpt: Path) -> None:
    """The average saved with a resumable checkpoint (a run resumed with EMA must have saved one)."""
    where = ckpt / "ema.safetensors"
    try:
        ema.load_state_tensors(load_file(str(where)))
    except Exception as exc:  # missing, unreadable or not this model's average
        raise TinyLMError(f"resume: the weight average {where} is unusable ({exc})") from exc


def _tensorboard_writer(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter  # deferred: optional, and slow to import
    except ImportError as exc:
        raise TinyLMError("train.tensorboard=true needs the tensorboard package (pip install tensorboard)") from exc
    return SummaryWriter(log_dir=str(out_dir / "tensorboard"))


def train(cfg: RunConfig, prepared: Prepared, out_dir: str | Path, *,
          resume: str | Path | None = None, force: bool = False) -> TrainResult:
    """Train (or, with ``resume``, continue training) and write checkpoints into ``out_dir``.

    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 logs and writes files.
    """
    ctx = dist_utils.setup_distributed(cfg.train.device)
    try:
        say = log.info if ctx.is_main else (lambda *a, **k: None)
        return _train(cfg, prepared, Path(out_dir), say, resume, force, ctx)
    finally:
        dist_utils.cleanup(ctx)


def _train(cfg: RunConfig, prepared: Prepared, out_dir: Path, say, resume, force: bool, ctx: DistContext) -> TrainResult:
    tc = cfg.train
    batch_size = per_rank_batch_size(tc, ctx.world_size)
    make_checkpoint_fn(tc.checkpoint_impl)  # an unknown implementation is an error even when unused
    if not 0.0 <= tc.label_smoothing < 1.0:
        raise TinyLMError(f"train.label_smoothing must be in [0, 1) (got {tc.label_smoothing})")
    if tc.epochs is not None and tc.epochs < 1:
        raise TinyLMError(f"train.epochs must be at least 1 (got {tc.epochs})")
    if not 0.0 <= tc.ema_decay < 1.0:
        raise TinyLMError(f"train.ema_decay must be in [0, 1) (got {tc.ema_decay}; 0 turns the average off)")
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    seed_everything(tc.seed)
    device = dist_utils.rank_device(ctx, resolve_device(tc.device))
    check_precision(device, tc.precision)
    scaler = make_grad_scaler(device, tc.precision)

    tokenizer = prepared.tokenizer
    model = build_model(cfg, tokenizer.vocab_size).to(device)  # the same initial weights on every rank
    if getattr(cfg, "embeddings", None) is not None and cfg.embeddings.kind != "none":
        apply_pretrained_embeddings(model, tokenizer, cfg.embeddings, prepared.splits["train"].ids,
                                    out_dir if ctx.is_main else None, cache_dir=prepared.data_dir)
    if ctx.rank:
        torch.manual_seed(tc.seed + 1_000_003 * ctx.rank)  # ranks draw different dropout masks
    cfg = dataclasses.replace(cfg, model=model.config)  # the resolved model config goes on disk
    T = model.config.context_length
    if "valid" not in prepared.splits:
        raise TinyLMError("no validation split was prepared")
    rows_per_step = batch_size * tc.grad_accum_steps * ctx.world_size
    check_batch_fits(prepared.splits["train"], rows_per_step, T, cfg.data.batching)
    train_batches = Batches(prepared.splits["train"], T, cfg.data.batching, seed=tc.seed,
                            epoch_rows=rows_per_step if tc.epochs else None)
    steps_per_epoch = train_batches.steps_per_epoch
    if tc.epochs:  # the step count follows from the data: the schedule and the saved config use it
        tc = dataclasses.replace(tc, max_steps=tc.epochs * steps_per_epoch)
        cfg = dataclasses.replace(cfg, train=tc)
        say(f"train: {tc.epochs} epoch(s) of {steps_per_epoch} steps ({rows_per_step} rows each) = "
            f"{tc.max_steps} steps")
    valid_batches = Batches(prepared.splits["valid"], T, cfg.data.batching, seed=tc.seed + 1)
    optimizer = make_optimizer(model, tc)
    ema = EMA(model, tc.ema_decay) if tc.ema_decay else None
    if tc.grad_checkpointing:
        enable_grad_checkpointing(model, tc.checkpoint_impl)

    start_step, tokens_seen, best_val, bad_evals = 0, 0, math.inf, 0
    metrics = MetricsLog(out_dir / "metrics.csv", fresh=resume is None) if ctx.is_main else None
    epoch_log = (MetricsLog(out_dir / "epochs.csv", EPOCH_COLUMNS, fresh=resume is None)
                 if ctx.is_main and tc.epochs else None)
    if resume is not None:
        state = load_resume_state(resume)
        check_resume_config(state.run_config, cfg.to_dict(), force)
        if state.counters["world_size"] != ctx.world_size:
            raise TinyLMError(f"resume: {state.path} was written by {state.counters['world_size']} process(es) and "
                              f"this run has {ctx.world_size}; resume with the same number of processes")
        load_model_state(model, state.path, read_model_state(state.path, model.config))
        restore_optimizer(optimizer, state)
        if ema is not None:
            _restore_ema(ema, state.path)
        if state.scaler_state:
            scaler.load_state_dict(state.scaler_state)
        start_step = state.step
        tokens_seen, best_val, bad_evals = (state.counters["tokens_seen"], float(state.counters["best_val"]),
                                            state.counters["bad_evals"])
        restore_rng(state.rng_per_rank[ctx.rank])  # last: nothing below draws random numbers before step 1
        if metrics is not None:
            metrics.truncate_after(start_step)
        if epoch_log is not None:
            epoch_log.truncate_after(start_step)
        say(f"train: resuming from {state.path} at step {start_step}")
    if ctx.is_main:
        cfg.save(out_dir / "config.yaml")

    ddp_model = dist_utils.wrap_ddp(model, ctx, device) if ctx.enabled else None
    run_model = ddp_model if ddp_model is not None else model
    if tc.compile:
        run_model = compile_for_training(model, run_model, tc)
    say(f"train: {model.num_parameters():,} parameters on {device}, context {T}, batch {batch_size} x "
        f"{tc.grad_accum_steps} accumulation x {ctx.world_size} process(es), {tc.precision}"
        + (", torch.compile" if tc.compile else "")
        + (f", gradient checkpointing ({tc.checkpoint_impl})" if tc.grad_checkpointing else ""))

    ckpt_dir = out_dir / "checkpoints"
    save_every = tc.save_interval or tc.eval_interval
    writer = _tensorboard_writer(out_dir) if tc.tensorboard and ctx.is_main else None
    last_loss, stopped = math.nan, "max_steps"
    epoch_loss_sum, epoch_targets = 0.0, 0  # the running epoch (a resumed run restarts the sum)
    session_tokens, start = 0, time.perf_counter()
    progress = None
    if tc.progress and ctx.is_main:
        from tqdm.auto import tqdm  # deferred: only runs with a progress bar need it

        progress = tqdm(total=tc.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        leave=False, disable=None)  # None: off when stderr is not a terminal (CI logs)

    def save(name: str, step_done: int, val_loss: float) -> None:
        """A resumable checkpoint; a collective call under DDP (every rank's RNG state is gathered)."""
        rngs = dist_utils.gather_objects(capture_rng(), ctx)
        if not ctx.is_main:
            return
        counters = {"step": step_done, "data_position": step_done, "tokens_seen": tokens_seen,
                    "best_val": best_val, "bad_evals": bad_evals, "world_size": ctx.world_size}
        tensors, files = state_payload(optimizer, scaler, rngs, counters)
        meta = {"step": step_done, "val_loss": val_loss, "tokens_seen": tokens_seen}
        if ema is not None:
            tensors["ema.safetensors"] = ema.state_tensors()
            if name != "best":  # the averaged weights as a model of their own: evaluate / generate it
                save_checkpoint(ckpt_dir / "ema", ema.averaged_model(model), tokenizer, cfg,
                                {**meta, "ema_decay": tc.ema_decay, "ema_updates": ema.updates})
        save_checkpoint(ckpt_dir / name, model, tokenizer, cfg, meta, extra_files=files, extra_tensors=tensors)

    def close() -> None:
        if progress is not None:
            progress.close()
        if writer is not None:
            writer.close()

    step = start_step - 1
    by_wall = wall_schedule_enabled(tc)  # like max_minutes, the wall budget counts from this session's start
    for step in range(start_step, tc.max_steps):
        wall_fraction = None
        if by_wall:
            wall_fraction = (time.perf_counter() - start) / (tc.max_minutes * 60)
            if ctx.enabled:  # every rank must use the same learning rate
                wall_fraction = all_reduce_sum([wall_fraction], ctx, device)[0] / ctx.world_size
        lr = lr_at(step, tc, wall_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups keep their own peak rate
        micro = micro_batches(train_batches, step, batch_size, tc.grad_accum_steps, ctx)
        last_loss, n_targets = accumulate_gradients(run_model, micro, device, tc.precision, scaler, ctx, ddp_model,
                                                    tc.label_smoothing)
        epoch_loss_sum, epoch_targets = epoch_loss_sum + last_loss * n_targets, epoch_targets + n_targets
        if not math.isfinite(last_loss):
            close()
            raise TinyLMError(
                f"training loss became {last_loss} at step {step + 1}; stopped before that update, the last good "
                f"checkpoint is kept in {ckpt_dir} (lower train.lr, enable train.grad_clip or use fp32)")
        if tc.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(model)
        step_tokens = sum(x.numel() for x, _ in micro) * ctx.world_size
        tokens_seen += step_tokens
        session_tokens += step_tokens
        elapsed = time.perf_counter() - start
        tok_s = session_tokens / max(elapsed, 1e-9)
        if progress is not None:
            postfix = {"loss": f"{last_loss:.3f}", "tok_s": f"{tok_s:,.0f}"}
            if device.type == "cuda":
                postfix["mem"] = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}G"
            progress.update(1)
            progress.set_postfix(postfix)

        is_last = step == tc.max_steps - 1
        out_of_time = tc.max_minutes is not None and elapsed >= tc.max_minutes * 60
        if tc.max_minutes is not None and ctx.enabled:  # every rank must stop at the same step
            out_of_time = all_reduce_sum([float(out_of_time)], ctx, device)[0] > 0
        row = {"step": step + 1, "tokens": tokens_seen, "lr": f"{lr:.3e}", "train_loss": repr(last_loss),
               "tokens_per_s": f"{tok_s:.1f}", "elapsed_s": f"{elapsed:.2f}"}
        log_row = (step + 1) % tc.log_interval == 0
        if writer is not None:
            writer.add_scalar("train/loss", last_loss, step + 1)
            writer.add_scalar("train/lr", lr, step + 1)
            writer.add_scalar("train/tokens_per_s", tok_s, step + 1)
        if (step + 1) % tc.eval_interval == 0 or is_last or out_of_time:
            val = validation_loss(model, valid_batches, cfg, device, tc.precision, ctx, batch_size)
            row.update(val_loss=repr(val), val_ppl=f"{math.exp(min(val, 50)):.3f}")
            log_row = True
            improved = val < best_val
            if improved:
                best_val, bad_evals = val, 0
            else:
                bad_evals += 1
            if writer is not None:
                writer.add_scalar("valid/loss", val, step + 1)
            if improved:
                save("best", step + 1, val)
            msg = (f"step {step + 1}: train {last_loss:.4f}, valid {val:.4f} (ppl {math.exp(min(val, 50)):.2f}), "
                   f"{tok_s:,.0f} tok/s")
            if progress is not None:  # above the bar, on stderr with it
                progress.write(msg, file=sys.stderr)
            else:
                say(msg)
            if tc.early_stopping_patience and bad_evals >= tc.early_stopping_patience:
                stopped = "early_stopping"
                say(f"train: early stopping at step {step + 1}: no validation improvement in {bad_evals} evaluations")
        if log_row and metrics is not None:
            metrics.write(row)
        if tc.epochs and (step + 1) % steps_per_epoch == 0:
            val = float(row["val_loss"]) if "val_loss" in row else validation_loss(
                model, valid_batches, cfg, device, tc.precision, ctx, batch_size)
            train_mean = epoch_loss_sum / max(epoch_targets, 1)
            if epoch_log is not None:
                epoch_log.write({"step": step + 1, "epoch": (step + 1) // steps_per_epoch,
                                 "train_loss": f"{train_mean:.6f}", "val_loss": f"{val:.6f}",
                                 "train_ppl": f"{math.exp(min(train_mean, 50)):.3f}",
                                 "val_ppl": f"{math.exp(min(val, 50)):.3f}", "elapsed_s": f"{elapsed:.2f}"})
            say(f"epoch {(step + 1) // steps_per_epoch}/{tc.epochs}: train {train_mean:.4f}, valid {val:.4f}")
            epoch_loss_sum, epoch_targets = 0.0, 0
        if (step + 1) % save_every == 0 and not is_last:
            save(step_dir_name(step + 1), step + 1, best_val)
            if ctx.is_main:
                prune_step_checkpoints(ckpt_dir, tc.keep_last)
        if out_of_time:
            stopped = "max_minutes"
        if stopped != "max_steps":
            break
    close()
    seconds = time.perf_counter() - start
    save("last", step + 1, best_val)
    dist_utils.barrier(ctx)
    return TrainResult(step + 1, best_val, last_loss, seconds, session_tokens / max(seconds, 1e-9), ckpt_dir, stopped)
