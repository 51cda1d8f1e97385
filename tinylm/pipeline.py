"""The whole path in one place: prepare -> train -> evaluate -> sample -> report.

`tinylm demo` and `tinylm train` both run it; each stage writes its files into the run
directory, so every number in the report is read back from disk.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tinylm.config import RunConfig, SampleConfig
from tinylm.data.prepare import prepare
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_split
from tinylm.evaluation.plots import plot_curves
from tinylm.evaluation.report import write_run_report
from tinylm.generation.generate import complete
from tinylm.models.checkpoint import load_checkpoint
from tinylm.training import distributed
from tinylm.training.metrics import EVAL_SAMPLES
from tinylm.training.trainer import train

log = logging.getLogger(__name__)


def sample_prompts(model, tokenizer, sample: SampleConfig) -> list[dict]:
    """The configured prompts continued one by one (prompt i with seed ``sample.seed + i``)."""
    cfg = sample.generation(stop_ids=tokenizer.stop_ids)
    return [
        {"prompt": c.prompt, "continuation": c.continuation(tokenizer), "new_tokens": len(c.results[0].tokens)}
        for c in complete(model, tokenizer, sample.prompts, cfg)
    ]


def eval_sampler(cfg: RunConfig, tokenizer, out_dir: Path, fresh: bool):
    """What the trainer calls after each evaluation: the sample prompts continued by the model of
    that step, one JSON line per evaluation in ``RUN/eval_samples.jsonl`` (a resumed run appends;
    a reader keeps the last line of each step)."""
    path = out_dir / EVAL_SAMPLES
    if fresh:
        path.unlink(missing_ok=True)

    def write(model, step: int, tokens: int) -> None:
        row = {"step": step, "tokens": tokens, "samples": sample_prompts(model, tokenizer, cfg.sample)}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    return write


def result_checkpoint(checkpoint_dir: Path) -> str:
    """The checkpoint that is a run's result: the weight average when the run kept one, else the best raw weights."""
    return "ema" if (checkpoint_dir / "ema").is_dir() else "best"


def run_pipeline(cfg: RunConfig, out_dir: str | Path, *, resume=None, force: bool = False) -> dict:
    """``resume``: a checkpoint or run directory to continue training from (``force``: allow the
    --force keys to differ). Under torchrun rank 0 prepares first, all ranks train, rank 0 evaluates."""
    dist = distributed.setup_distributed(cfg.train.device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with distributed.main_process_first(dist):  # the other ranks then reuse rank 0's token cache
        prepared = prepare(cfg, out_dir)
    t_prepare = time.perf_counter() - t0
    for name in ("train", "valid"):
        if name not in prepared.splits:
            raise TinyLMError(f"no {name} split was prepared")
        n = prepared.splits[name].n_tokens
        if n < cfg.model.context_length + 1:
            raise TinyLMError(
                f"the {name} split has {n} tokens, fewer than one context window "
                f"({cfg.model.context_length + 1}); use more data, a larger data.valid_fraction, or a "
                "smaller model.context_length"
            )
    on_evaluate = (
        eval_sampler(cfg, prepared.tokenizer, out_dir, resume is None and dist.is_main)
        if cfg.sample.every_eval
        else None
    )
    result = train(cfg, prepared, out_dir, resume=resume, force=force, on_evaluate=on_evaluate)
    distributed.cleanup(dist)
    if not dist.is_main:
        return {}
    chosen = result_checkpoint(result.checkpoint_dir)  # the best raw weights are scored too
    evals, evals_best = {}, {}
    for ckpt in dict.fromkeys(("best", chosen)):  # the chosen one last: it writes the samples below
        model, tokenizer, meta = load_checkpoint(result.checkpoint_dir / ckpt)
        for name in ("valid", "test"):
            if name in prepared.splits and (ckpt == chosen or name == "valid"):
                m = evaluate_split(model, prepared.splits[name], eos_id=tokenizer.eos_id)
                (evals if ckpt == chosen else evals_best)[name] = m
                log.info(
                    f"{name} ({ckpt}): token perplexity {m['token_ppl']:.3f}, bits per byte {m['bpb']:.4f}, "
                    f"word perplexity {m['word_ppl']:.2f} ({m['tokens']:,} tokens)"
                )
    samples = sample_prompts(model, tokenizer, cfg.sample)
    for s in samples:
        log.info(f"--- {s['prompt']!r}\n{s['prompt']}{s['continuation']}")
    summary = {
        "parameters": model.num_parameters(),
        "steps": result.steps,
        "train_seconds": round(result.seconds, 2),
        "prepare_seconds": round(t_prepare, 2),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "best_val_loss": result.best_val_loss,
        "final_train_loss": result.final_train_loss,
        "stopped_because": result.stopped_because,
        "checkpoint": f"checkpoints/{chosen}",
        "eval": evals,
        **({"eval_best": evals_best} if evals_best else {}),
        "total_seconds": round(time.perf_counter() - t0, 2),
    }
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "samples.json").write_text(json.dumps(samples, indent=2, ensure_ascii=False))
    (out_dir / "samples.txt").write_text(
        "\n\n".join(f"### {s['prompt']}\n{s['prompt']}{s['continuation']}" for s in samples) + "\n", encoding="utf-8"
    )
    plot_curves(out_dir / "metrics.csv", out_dir / "curves.png", title=out_dir.name)  # shown in the report
    write_run_report(out_dir)
    return summary
