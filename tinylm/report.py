"""`report.md` for a run directory. Every number is read from the run's files; a missing part is
shown as missing, never filled in."""

from __future__ import annotations

import csv
import json
import platform
from pathlib import Path

import torch
import yaml


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(v, digits=4):
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_run_report(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    lines = [f"# tinylm run: {run.name}", ""]
    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else None
    prep = _read_json(run / "prepare.json")
    ev = _read_json(run / "eval.json")
    samples = _read_json(run / "samples.json")

    lines += ["## Configuration", ""]
    if cfg:
        m, t = cfg["model"], cfg["train"]
        rows = [("data source", cfg["data"]["source"]), ("tokenizer", f"{cfg['tokenizer']['type']}"),
                ("vocabulary", m["vocab_size"]), ("context length", m["context_length"]),
                ("d_model / d_attn / d_ff", f"{m['d_model']} / {m['d_attn']} / {m['d_ff']}"),
                ("layers / heads", f"{m['n_layers']} / {m['n_heads']}"), ("positions", m["positions"]),
                ("dropout", m["dropout"]), ("batch x accumulation", f"{t['batch_size']} x {t['grad_accum_steps']}"),
                ("learning rate", f"{t['lr']} (warmup {t['warmup_steps']}, {t['schedule']} to {t['min_lr']})")]
        if ev:
            rows.append(("parameters", ev["parameters"]))
        lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows] + [""]
    else:
        lines += ["(missing: no config.yaml)", ""]

    lines += ["## Data", ""]
    if prep:
        lines += ["| split | documents | tokens | bytes |", "|---|---|---|---|"]
        lines += [f"| {s} | {_fmt(prep['documents'][s])} | {_fmt(prep['tokens'][s])} | {_fmt(prep['bytes'][s])} |"
                  for s in prep["splits"]] + [""]
    else:
        lines += ["(missing: no prepare.json)", ""]

    lines += ["## Training", ""]
    metrics_path = run / "metrics.csv"
    if ev:
        lines += [f"{_fmt(ev['steps'])} steps in {ev['train_seconds']:.1f} s ({_fmt(ev['tokens_per_s'], 0)} tokens/s), "
                  f"stopped by {ev['stopped_because']}; best validation loss {ev['best_val_loss']:.4f}.", ""]
    if metrics_path.is_file():
        with open(metrics_path) as f:
            evals = [r for r in csv.DictReader(f) if r.get("val_loss")]
        if evals:
            lines += ["| step | train loss | valid loss | valid ppl |", "|---|---|---|---|"]
            lines += [f"| {r['step']} | {r['train_loss']} | {r['val_loss']} | {r['val_ppl']} |" for r in evals] + [""]
    else:
        lines += ["(missing: no metrics.csv)", ""]

    lines += ["## Evaluation (best checkpoint, each document scored from `<sos>`)", ""]
    if ev and ev.get("eval"):
        lines += ["| split | token ppl | bits per byte | word ppl | tokens |", "|---|---|---|---|---|"]
        lines += [f"| {s} | {m['token_ppl']:.3f} | {m['bpb']:.4f} | {m['word_ppl']:.2f} | {_fmt(m['tokens'])} |"
                  for s, m in ev["eval"].items()] + [""]
    else:
        lines += ["(missing: no eval.json)", ""]

    lines += ["## Samples", ""]
    if samples:
        for s in samples:
            lines += [f"**{s['prompt']}**", "", "```", f"{s['prompt']}{s['continuation']}", "```", ""]
    else:
        lines += ["(missing: no samples.json)", ""]

    lines += ["## Machine", "", f"{platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, CUDA {'yes' if torch.cuda.is_available() else 'no'}", ""]
    path = run / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
