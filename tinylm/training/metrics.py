"""`metrics.csv`: one row per logged training step; the validation columns are filled on the steps
that ran a validation only. The trainer writes it through ``MetricsLog``; the report, the curves and
the studies read it through ``read_metrics``.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from tinylm.errors import TinyLMError

METRICS_COLUMNS = ["step", "tokens", "lr", "train_loss", "val_loss", "val_ppl", "tokens_per_s", "elapsed_s"]
# epochs.csv (train.epochs): the reports' per-epoch table; train_loss is the epoch's token-weighted mean
EPOCH_COLUMNS = ["step", "epoch", "train_loss", "val_loss", "train_ppl", "val_ppl", "elapsed_s"]
# the sample prompts continued at each evaluation: one JSON object per line ({"step", "tokens", "samples"})
EVAL_SAMPLES = "eval_samples.jsonl"


class MetricsLog:
    """``fresh``: a new run starts a new file (a resumed run keeps the rows up to its step)."""

    def __init__(self, path: Path, columns=METRICS_COLUMNS, fresh: bool = True):
        self.path, self.columns = path, columns
        if fresh or not path.exists():
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(columns)

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow(["" if row.get(c) is None else row[c] for c in self.columns])

    def truncate_after(self, step: int) -> int:
        """Drop rows logged after ``step`` (a resumed run writes them again); returns rows dropped."""
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            return 0
        keep = [rows[0]] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(keep)
        os.replace(tmp, self.path)
        return len(rows) - len(keep)


def parse_metrics_row(row: dict) -> dict:
    """A metrics.csv row (csv.DictReader's) with its numbers as int or float and an empty cell as None."""
    return {k: None if v in (None, "") else int(v) if v.isdigit() else float(v) for k, v in row.items()}


def read_metrics(path: str | Path) -> list[dict]:
    """Every row of a metrics.csv, as ``parse_metrics_row`` reads it."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"no metrics file {path}: this run has not logged any training step")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        return [parse_metrics_row(row) for row in rows]
    except ValueError as exc:
        raise TinyLMError(f"{path} holds a cell that is not a number ({exc})") from exc


def read_eval_samples(path: Path) -> list[dict]:
    """The rows of ``eval_samples.jsonl`` by step, the last written for a step (a resumed run
    writes its steps again); a line being written or damaged is left out."""
    by_step = {}
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    for line in text.splitlines():
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[k] for k in sorted(by_step)]
