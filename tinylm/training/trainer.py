"""The training loop: teacher forcing, AdamW, warmup + cosine, clipping, token-weighted gradient
accumulation, periodic validation, best/last checkpoints, metrics CSV, a progress bar."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinylm.config import RunConfig
from tinylm.data.prepare import Prepared
from tinylm.data.tokens import Batches
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT, IGNORE_INDEX
from tinylm.training.checkpoint import save_checkpoint, unwrap
from tinylm.training.optim import lr_at, make_optimizer

METRICS_COLUMNS = ["step", "tokens", "lr", "train_loss", "val_loss", "val_ppl", "tokens_per_s", "elapsed_s"]


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


def autocast_context(device: torch.device, precision: str):
    """Autocast for bf16/fp16; fp16 needs CUDA (its gradient scaler is CUDA-only here)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise TinyLMError("train.precision=fp16 needs a CUDA device; on CPU use bf16 or fp32")
    if precision not in ("bf16", "fp16"):
        raise TinyLMError(f"train.precision={precision!r} is not one of fp32, bf16, fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: RunConfig, vocab_size: int) -> GPT:
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size)
    if model_cfg.vocab_size < vocab_size:
        raise TinyLMError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
    return GPT(model_cfg)


@torch.no_grad()
def validation_loss(model, batches: Batches, cfg: RunConfig, device, amp) -> float:
    """Mean token NLL over ``eval_batches`` fixed batches (the same every time), or the whole split."""
    model.eval()
    total, count = 0.0, 0
    if cfg.train.eval_batches > 0:
        source = (batches.get(step=i, row_start=0, n_rows=cfg.train.batch_size) for i in range(cfg.train.eval_batches))
    else:
        source = batches.sequential(cfg.train.batch_size)
    for x, y in source:
        with amp:
            _, loss = model(x.to(device), y.to(device), loss_reduction="sum")
        total += float(loss)
        count += int((y != IGNORE_INDEX).sum())
    model.train()
    return total / max(count, 1)


class MetricsLog:
    def __init__(self, path: Path, columns=METRICS_COLUMNS):
        self.path, self.columns = path, columns
        if not path.exists():
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(columns)

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow(["" if row.get(c) is None else row[c] for c in self.columns])


def train(cfg: RunConfig, prepared: Prepared, out_dir: str | Path, log=print) -> TrainResult:
    tc = cfg.train
    if tc.grad_accum_steps < 1:
        raise TinyLMError(f"train.grad_accum_steps must be >= 1 (got {tc.grad_accum_steps})")
    if tc.batch_size < 1:
        raise TinyLMError(f"train.batch_size must be >= 1 (got {tc.batch_size})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    seed_everything(tc.seed)
    device = resolve_device(tc.device)
    amp = autocast_context(device, tc.precision)

    tokenizer = prepared.tokenizer
    model = build_model(cfg, tokenizer.vocab_size).to(device)
    cfg = dataclasses.replace(cfg, model=model.config)  # the resolved model config goes on disk
    cfg.save(out_dir / "config.yaml")
    T = model.config.context_length
    train_batches = Batches(prepared.splits["train"], T, cfg.data.batching, seed=tc.seed)
    if "valid" not in prepared.splits:
        raise TinyLMError("no validation split was prepared")
    valid_batches = Batches(prepared.splits["valid"], T, cfg.data.batching, seed=tc.seed + 1)
    optimizer = make_optimizer(model, tc)
    run_model = torch.compile(model) if tc.compile else model
    log(f"train: {model.num_parameters():,} parameters on {device}, context {T}, "
        f"batch {tc.batch_size} x {tc.grad_accum_steps} accumulation")

    metrics = MetricsLog(out_dir / "metrics.csv")
    ckpt_dir = out_dir / "checkpoints"
    best_val, bad_evals, last_loss = math.inf, 0, math.nan
    tokens_seen, start = 0, time.perf_counter()
    stopped = "max_steps"
    progress = None
    if tc.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=tc.max_steps, desc="train", unit="step", dynamic_ncols=True, leave=False,
                        disable=None)  # None: off when stderr is not a terminal (CI logs)

    def save(name: str, step: int, val_loss: float) -> None:
        save_checkpoint(ckpt_dir / name, model, tokenizer, cfg,
                        {"step": step, "val_loss": val_loss, "tokens_seen": tokens_seen})

    step = 0
    for step in range(tc.max_steps):
        lr = lr_at(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = [train_batches.get(step, m * tc.batch_size, tc.batch_size) for m in range(tc.grad_accum_steps)]
        n_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
        step_loss = 0.0
        for x, y in micro:
            with amp:
                _, loss_sum = run_model(x.to(device), y.to(device), loss_reduction="sum")
            # weight by tokens, not by micro-batch: the sum over micro-batches is the big batch's mean
            (loss_sum / n_targets).backward()
            step_loss += float(loss_sum.detach())
        last_loss = step_loss / n_targets
        if not math.isfinite(last_loss):
            raise TinyLMError(f"training loss became {last_loss} at step {step}; nothing was saved from this step, the last good checkpoint is kept "
                              f"in {ckpt_dir} (lower train.lr or enable train.grad_clip)")
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += sum(x.numel() for x, _ in micro)
        elapsed = time.perf_counter() - start
        tok_s = tokens_seen / max(elapsed, 1e-9)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tok_s:,.0f}")

        is_last = step == tc.max_steps - 1
        out_of_time = tc.max_minutes is not None and elapsed >= tc.max_minutes * 60
        row = None
        if (step + 1) % tc.log_interval == 0:
            row = {"step": step + 1, "tokens": tokens_seen, "lr": f"{lr:.3e}", "train_loss": f"{last_loss:.5f}",
                   "tokens_per_s": f"{tok_s:.1f}", "elapsed_s": f"{elapsed:.2f}"}
        if (step + 1) % tc.eval_interval == 0 or is_last or out_of_time:
            val = validation_loss(model, valid_batches, cfg, device, amp)
            row = row or {"step": step + 1, "tokens": tokens_seen, "lr": f"{lr:.3e}", "train_loss": f"{last_loss:.5f}",
                          "tokens_per_s": f"{tok_s:.1f}", "elapsed_s": f"{elapsed:.2f}"}
            row.update(val_loss=f"{val:.5f}", val_ppl=f"{math.exp(min(val, 50)):.3f}")
            if val < best_val:
                best_val, bad_evals = val, 0
                save("best", step + 1, val)
            else:
                bad_evals += 1
            msg = f"step {step + 1}: train {last_loss:.4f}, valid {val:.4f} (ppl {math.exp(min(val, 50)):.2f}), {tok_s:,.0f} tok/s"
            (progress.write if progress is not None else log)(msg)
            if tc.early_stopping_patience and bad_evals >= tc.early_stopping_patience:
                stopped = "early_stopping"
        if row is not None:
            metrics.write(row)
        if out_of_time:
            stopped = "max_minutes"
        if stopped != "max_steps":
            break
    if progress is not None:
        progress.close()
    seconds = time.perf_counter() - start
    save("last", step + 1, best_val)
    return TrainResult(step + 1, best_val, last_loss, seconds, tokens_seen / max(seconds, 1e-9), ckpt_dir, stopped)
