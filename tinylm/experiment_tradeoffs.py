"""The training trade-off parts of `tinylm experiments`: gradient accumulation and gradient
checkpointing, each a short training run of the same micro-batches through the real trainer.

Times are the trainer's own (the metrics row of the last step, written before that step's
validation and checkpoint saves); every variant runs ``tradeoff_repeats`` times in alternated
rounds after one untimed warm-up step, and the tables give medians plus each run. Activation
memory is measured with the training engine's meter (bytes autograd saves for backward in one
micro-batch step).
"""

from __future__ import annotations

import copy
import csv
import statistics
from typing import TYPE_CHECKING

import torch

from tinylm.config import RunConfig

if TYPE_CHECKING:  # the runner's context; imported for annotations only (no import cycle)
    from tinylm.experiments import Context


def _tradeoff_config(ctx: Context, accum: int, checkpointing: bool) -> RunConfig:
    cfg = copy.deepcopy(ctx.cfg)
    M = ctx.exp.tradeoff_micro_batches
    steps = M // accum
    cfg.train.grad_accum_steps = accum
    cfg.train.max_steps = steps
    cfg.train.max_minutes = None
    cfg.train.warmup_steps = max(1, steps // 10)
    cfg.train.eval_interval = steps  # one validation, at the end
    cfg.train.grad_checkpointing = checkpointing
    cfg.train.early_stopping_patience = 0
    cfg.train.progress = False
    cfg.train.threads = ctx.threads
    return cfg


def _activation_bytes(ctx: Context, cfg: RunConfig, checkpointing: bool) -> int:
    """Peak bytes autograd saves in one forward + backward of one micro-batch (issue 3's meter)."""
    from tinylm.data.tokens import Batches
    from tinylm.training.memory import measure_step_activation_bytes
    from tinylm.training.trainer import build_model

    prepared = ctx.prepared()
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, prepared.tokenizer.vocab_size).train()
    if checkpointing:
        from tinylm.training.grad_checkpoint import enable_grad_checkpointing

        enable_grad_checkpointing(model, cfg.train.checkpoint_impl)
    batches = Batches(prepared.splits["train"], model.config.context_length, cfg.data.batching, seed=cfg.train.seed)
    x, y = batches.get(0, 0, cfg.train.batch_size)
    return int(measure_step_activation_bytes(model, x, y)["peak_activation_bytes"])


def _tradeoff_run(ctx: Context, name: str, accum: int, checkpointing: bool) -> dict:
    from tinylm.training.trainer import train

    cfg = _tradeoff_config(ctx, accum, checkpointing)
    out = ctx.run_dir / "tradeoffs" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.csv").unlink(missing_ok=True)
    prepared = ctx.prepared()
    result = train(cfg, prepared, out, log=lambda *_: None)
    split = prepared.splits["train"]
    if cfg.data.batching == "stories":
        per_epoch = split.n_docs / cfg.train.batch_size
    else:
        per_epoch = split.n_tokens / (cfg.train.batch_size * cfg.model.context_length)
    M = ctx.exp.tradeoff_micro_batches
    # training time only: the metrics row of the last step is written before its validation and saves
    with open(out / "metrics.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    seconds, tok_s = float(last["elapsed_s"]), float(last["tokens_per_s"])
    row = {"name": name, "accum_steps": accum, "grad_checkpointing": checkpointing, "micro_batch": cfg.train.batch_size,
           "effective_batch": cfg.train.batch_size * accum, "optimizer_steps": result.steps, "micro_batches": M,
           "final_train_loss": result.final_train_loss, "final_val_loss": result.best_val_loss,
           "seconds": seconds, "tokens_per_s": tok_s, "seconds_with_eval_and_saves": result.seconds,
           "projected_epoch_seconds": seconds / M * per_epoch, "micro_batches_per_epoch": per_epoch}
    ctx.log(f"{name}: {result.steps} steps x {accum}, final train loss {result.final_train_loss:.4f}, "
            f"{seconds:.1f} s of training")
    return row


def _warm_up_training(ctx: Context) -> None:
    """One untimed step first, so the first timed run does not pay one-time costs (allocator, kernels)."""
    from tinylm.training.trainer import train

    cfg = _tradeoff_config(ctx, 1, False)
    cfg.train.max_steps, cfg.train.eval_interval, cfg.train.eval_batches = 1, 1, 1
    train(cfg, ctx.prepared(), ctx.run_dir / "tradeoffs" / "warmup", log=lambda *_: None)


def _alternated_runs(ctx: Context, variants: list[tuple[str, int, bool]]) -> list[dict]:
    """Train each (name, accumulation, checkpointing) variant ``tradeoff_repeats`` times in rounds
    (A B C .. A B C ..), so load from other jobs hits every variant alike; report medians."""
    _warm_up_training(ctx)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for rep in range(max(1, ctx.exp.tradeoff_repeats)):
        for name, accum, ckpt in variants:
            runs[name].append(_tradeoff_run(ctx, f"{name}_{rep}", accum, ckpt))
    rows = []
    for name, accum, ckpt in variants:
        rs = runs[name]
        row = {**rs[0], "name": name, "runs": len(rs), "seconds_each": [r["seconds"] for r in rs],
               "seconds": statistics.median(r["seconds"] for r in rs),
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs)}
        row["projected_epoch_seconds"] = row["seconds"] / row["micro_batches"] * row["micro_batches_per_epoch"]
        row["peak_activation_bytes"] = _activation_bytes(ctx, _tradeoff_config(ctx, accum, ckpt), ckpt)
        rows.append(row)
    return rows


def part_accumulation(ctx: Context) -> dict:
    torch.set_num_threads(ctx.threads)
    rows = _alternated_runs(ctx, [(f"accum_{k}", k, False) for k in ctx.exp.accum_steps])
    return {"threads": ctx.threads, "repeats": ctx.exp.tradeoff_repeats, "rows": rows}


def part_checkpointing(ctx: Context) -> dict:
    torch.set_num_threads(ctx.threads)
    out: dict = {"threads": ctx.threads, "impl": ctx.cfg.train.checkpoint_impl, "repeats": ctx.exp.tradeoff_repeats,
                 "rows": []}
    out["rows"] = _alternated_runs(ctx, [("plain", 1, False), ("checkpointing", 1, True)])
    plain = out["rows"][0]
    for row in out["rows"]:
        row["time_ratio"] = row["seconds"] / plain["seconds"]
        if row["peak_activation_bytes"] and plain["peak_activation_bytes"]:
            row["memory_ratio"] = row["peak_activation_bytes"] / plain["peak_activation_bytes"]
    return out
