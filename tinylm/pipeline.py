"""The whole path in one place: prepare -> train -> evaluate -> sample -> report.

`tinylm demo` and `tinylm train` both run it; each stage writes its files into the run
directory, so every number in the report is read back from disk.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tinylm.config import RunConfig
from tinylm.data.prepare import prepare
from tinylm.evaluation.perplexity import evaluate_split
from tinylm.generation.generate import generate
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import EOS_ID, SOS_ID
from tinylm.training.checkpoint import load_checkpoint
from tinylm.training.trainer import train


def sample_prompts(model, tokenizer, cfg: RunConfig) -> list[dict]:
    out = []
    for i, prompt in enumerate(cfg.sample.prompts):
        ids = tokenizer.encode(prompt)
        if not ids:
            raise TinyLMError(f"prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
        new = generate(model, [SOS_ID, *ids], cfg.sample.max_new_tokens, cfg.sample.temperature,
                       cfg.sample.top_k, cfg.sample.top_p, eos_id=EOS_ID, seed=cfg.sample.seed + i)
        out.append({"prompt": prompt, "continuation": tokenizer.decode_continuation(ids, new), "new_tokens": len(new)})
    return out


def run_pipeline(cfg: RunConfig, out_dir: str | Path, log=print, *, resume=None, force: bool = False) -> dict:
    """``resume``: a checkpoint or run directory to continue training from (``force``: allow the
    --force keys to differ). Under torchrun rank 0 prepares first, all ranks train, rank 0 evaluates."""
    from tinylm.training import distributed

    ctx = distributed.setup_distributed(cfg.train.device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with distributed.main_process_first(ctx):  # the other ranks then reuse rank 0's token cache
        prepared = prepare(cfg, out_dir, log=log if ctx.is_main else (lambda *a: None))
    t_prepare = time.perf_counter() - t0
    for name in ("train", "valid"):
        if name not in prepared.splits:
            raise TinyLMError(f"no {name} split was prepared")
        n = prepared.splits[name].n_tokens
        if n < cfg.model.context_length + 1:
            raise TinyLMError(
                f"the {name} split has {n} tokens, fewer than one context window ({cfg.model.context_length + 1}); "
                "use more data, a larger data.valid_fraction, or a smaller model.context_length"
            )
    result = train(cfg, prepared, out_dir, log=log, resume=resume, force=force)
    distributed.cleanup(ctx)
    if not ctx.is_main:
        return {}
    model, tokenizer, meta = load_checkpoint(result.checkpoint_dir / "best")
    model.to(torch.device("cpu"))
    evals = {}
    for name in ("valid", "test"):
        if name in prepared.splits:
            evals[name] = evaluate_split(model, prepared.splits[name])
            m = evals[name]
            log(f"{name}: token perplexity {m['token_ppl']:.3f}, bits per byte {m['bpb']:.4f}, "
                f"word perplexity {m['word_ppl']:.2f} ({m['tokens']:,} tokens)")
    samples = sample_prompts(model, tokenizer, cfg)
    for s in samples:
        log(f"--- {s['prompt']!r}\n{s['prompt']}{s['continuation']}")
    summary = {
        "parameters": model.num_parameters(),
        "steps": result.steps,
        "train_seconds": round(result.seconds, 2),
        "prepare_seconds": round(t_prepare, 2),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "best_val_loss": result.best_val_loss,
        "final_train_loss": result.final_train_loss,
        "stopped_because": result.stopped_because,
        "checkpoint": "checkpoints/best",
        "eval": evals,
        "total_seconds": round(time.perf_counter() - t0, 2),
    }
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "samples.json").write_text(json.dumps(samples, indent=2, ensure_ascii=False))
    (out_dir / "samples.txt").write_text(
        "\n\n".join(f"### {s['prompt']}\n{s['prompt']}{s['continuation']}" for s in samples) + "\n", encoding="utf-8")
    from tinylm.report import write_run_report

    write_run_report(out_dir)
    return summary
