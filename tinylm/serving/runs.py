"""``tinylm serve --runs DIR``: the run directories under DIR, for the playground's "Runs" view.

Routes (all under /v1, so the API key guards them too):
  ``GET /v1/tinylm/runs``                    every run under DIR (a directory holding metrics.csv)
  ``GET /v1/tinylm/runs/detail?run=&since=``  a run's metrics rows from row ``since`` on (the page
                                             polls with the count it holds, so a training run's
                                             curves grow without a reload), its config, checkpoints,
                                             eval summary, its samples at each
                                             evaluation and at the end
  ``POST /v1/tinylm/runs/load``              serve one of a run's checkpoints from now on
  ``POST /v1/tinylm/runs/samples``           continue the run's sample prompts with one checkpoint

A run is named by its path under DIR; only names found by listing DIR are opened, so a request
cannot reach outside it. A file being written by the trainer is read up to its last whole line.
"""

from __future__ import annotations

import asyncio
import csv
import io
import time
from pathlib import Path

import yaml
from fastapi import APIRouter
from pydantic import Field

from tinylm.config import SampleConfig, check_fields
from tinylm.errors import TinyLMError
from tinylm.evaluation.report import read_json
from tinylm.generation.generate import complete
from tinylm.interop.loading import load_any_checkpoint
from tinylm.serving.completions import APIError, bad
from tinylm.serving.models import ModelSpec, unique_name
from tinylm.serving.schemas import Strict
from tinylm.serving.state import RunsRoot, ServerState, StateDep
from tinylm.training.metrics import EVAL_SAMPLES, parse_metrics_row, read_eval_samples

router = APIRouter()
MAX_DEPTH = 3  # runs/<study>/<stage>/metrics.csv is as deep as tinylm writes them
LIVE_SECONDS = 600  # a run whose metrics.csv changed this recently (and that has no last checkpoint) is training
RETRY_SECONDS = 0.5  # a checkpoint read that failed is tried again after this (see with_retry)
MAX_LOADED = 8  # checkpoints loaded from runs at most (each is a model in memory with its own thread)


# ------------------------------------------------------------------------------------ reading runs
def find_runs(root: Path) -> dict[str, Path]:
    """Run name (its path under ``root``, with /) -> directory, for each directory holding metrics.csv."""
    found, level = {}, [root]
    for _ in range(MAX_DEPTH + 1):
        below = []
        for d in level:
            if (d / "metrics.csv").is_file():
                found[d.relative_to(root).as_posix() if d != root else d.name] = d
            below += sorted(
                c
                for c in d.iterdir()
                if c.is_dir() and c.name not in ("checkpoints", "data") and not c.name.startswith(".")
            )
        level = below
    return dict(sorted(found.items()))


def read_rows(path: Path) -> list[dict]:
    """metrics.csv's rows up to its last complete line (the trainer may be writing the next one),
    read as ``training.metrics.read_metrics`` reads them."""
    text = path.read_text(encoding="utf-8", errors="replace")
    text = text[: text.rfind("\n") + 1]
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        try:
            rows.append(parse_metrics_row(row))
        except ValueError:  # a damaged line: the curves go on without it
            continue
    return rows


def run_checkpoints(run: Path) -> list[dict]:
    """The run's checkpoints (a directory with checkpoint.json), with the step and losses they record."""
    root = run / "checkpoints"
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        meta = read_json(d / "checkpoint.json") if d.is_dir() and not d.name.endswith((".tmp", ".old")) else None
        if isinstance(meta, dict):  # an EMA checkpoint records the raw weights' validation loss: not its own
            out.append(
                {
                    "name": d.name,
                    "step": meta.get("step"),
                    "val_loss": None if "ema_decay" in meta else meta.get("val_loss"),
                    "modified": int((d / "checkpoint.json").stat().st_mtime),
                }
            )
    return sorted(out, key=lambda c: (c["step"] is None, c["step"] or 0, c["name"]))


def run_summary(name: str, run: Path) -> dict:
    rows = read_rows(run / "metrics.csv")
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    modified = (run / "metrics.csv").stat().st_mtime
    return {
        "run": name,
        "rows": len(rows),
        "step": rows[-1].get("step") if rows else None,
        "best_val_loss": min(vals) if vals else None,
        "modified": int(modified),
        "live": time.time() - modified < LIVE_SECONDS and not (run / "checkpoints" / "last").is_dir(),
        "checkpoints": [c["name"] for c in run_checkpoints(run)],
    }


def run_detail(name: str, run: Path, since: int) -> dict:
    """Rows from ``since`` on (all of them, with ``reset``, when the file now holds fewer: a resumed
    run rewrote it), and everything else the view shows about the run."""
    rows = read_rows(run / "metrics.csv")
    reset = since > len(rows)
    config = run / "config.yaml"
    samples = read_json(run / "samples.json")
    evaluation = read_json(run / "eval.json")
    return {
        **run_summary(name, run),
        "since": 0 if reset else since,
        "reset": reset,
        "metrics": rows if reset else rows[since:],
        "total": len(rows),
        "config": config.read_text(encoding="utf-8", errors="replace") if config.is_file() else None,
        "checkpoints": run_checkpoints(run),
        "samples": samples if isinstance(samples, list) else [],
        "eval_samples": read_eval_samples(run / EVAL_SAMPLES),
        "eval": evaluation.get("eval") if isinstance(evaluation, dict) else None,
    }


def sample_config(run: Path, max_tokens: int) -> SampleConfig:
    """The run's sample section (its prompts, temperature, seed), ``max_tokens`` new tokens."""
    config = run / "config.yaml"
    try:
        section = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("sample") if config.is_file() else {}
    except yaml.YAMLError as exc:
        raise TinyLMError(f"{config} is not YAML ({exc})") from exc
    known = {k: v for k, v in (section or {}).items() if k in SampleConfig.__dataclass_fields__}
    try:
        cfg = SampleConfig(**known)
        cfg.max_new_tokens, cfg.min_new_tokens = max_tokens, 0
        cfg.stop_ids, cfg.stop_strings = tuple(cfg.stop_ids), tuple(cfg.stop_strings)
        return check_fields(cfg)
    except (TypeError, TinyLMError) as exc:
        raise TinyLMError(f"{config}: its sample section is unusable ({exc})") from exc


def checkpoint_samples(run: Path, checkpoint: str, max_tokens: int) -> list[dict]:
    """The run's sample prompts continued by one of its checkpoints, prompt i with seed ``seed + i``
    (so checkpoints of one run are compared on the same draws)."""
    model, tokenizer, _ = load_any_checkpoint(run / "checkpoints" / checkpoint)
    cfg = sample_config(run, max_tokens)
    done = complete(model.eval(), tokenizer, cfg.prompts, cfg.generation(stop_ids=tokenizer.stop_ids))
    # the shape of the samples.json that `tinylm train` writes at the end of a run
    return [
        {"prompt": c.prompt, "continuation": c.continuation(tokenizer), "new_tokens": len(c.results[0].tokens)}
        for c in done
    ]


# ------------------------------------------------------------------------------------------ routes
class RunCheckpoint(Strict):
    run: str = Field(description="the run's name, as /v1/tinylm/runs lists it")
    checkpoint: str = Field(description="one of the run's checkpoints, e.g. best, ema, last, step_000500")


class SamplesRequest(RunCheckpoint):
    max_tokens: int = Field(48, ge=1, le=256, description="new tokens per prompt")


def runs_root(state: ServerState) -> RunsRoot:
    runs = state.runs
    if runs is None:
        raise APIError(404, "this server shows no runs: start it with `tinylm serve --runs DIR`", None, "no_runs")
    return runs


def find_run(runs: RunsRoot, name: str) -> Path:
    found = find_runs(runs.root)
    if name not in found:
        raise APIError(
            404, f"no run '{name}' under the runs directory; runs: {', '.join(found) or 'none'}", "run", "run_not_found"
        )
    return found[name]


def find_checkpoint(run: Path, name: str, checkpoint: str) -> Path:
    names = [c["name"] for c in run_checkpoints(run)]
    if checkpoint not in names:
        raise APIError(
            404,
            f"run '{name}' has no checkpoint '{checkpoint}'; it has: {', '.join(names) or 'none yet'}",
            "checkpoint",
            "checkpoint_not_found",
        )
    return run / "checkpoints" / checkpoint


async def with_retry(fn, *args):
    """``await fn(*args)``, tried a second time after a moment if it fails: a training run replaces
    a checkpoint by renaming directories, and a read can fall between the renames."""
    try:
        return await fn(*args)
    except (TinyLMError, OSError):
        await asyncio.sleep(RETRY_SECONDS)
        return await fn(*args)


@router.get("/v1/tinylm/runs")
async def list_runs(state: StateDep):
    runs = runs_root(state)
    summaries = await asyncio.to_thread(lambda: [run_summary(name, d) for name, d in find_runs(runs.root).items()])
    return {"root": runs.root.name, "runs": summaries}


@router.get("/v1/tinylm/runs/detail")
async def detail(state: StateDep, run: str, since: int = 0):
    if since < 0:
        raise bad("since", f"must be >= 0 (got {since})")
    d = find_run(runs_root(state), run)
    return await asyncio.to_thread(run_detail, run, d, since)


def served_name(run: str, checkpoint: str, taken: set[str]) -> str:
    """``stories`` + ``best`` -> stories-best (a run's path under DIR joined by -), unique among ``taken``
    (several checkpoints of one run are served side by side, so the checkpoint is part of the name)."""
    return unique_name(f"{run.replace('/', '-')}-{checkpoint}", taken)


@router.post("/v1/tinylm/runs/load")
async def load(body: RunCheckpoint, state: StateDep):
    """Serve a run's checkpoint. Loading it again reloads it (``best`` and ``ema`` change while a run
    trains): the new weights replace the old under the same name, and the old model's scheduler is
    closed once the swap is done (requests already decoding with it end with an error)."""
    runs = runs_root(state)
    path = find_checkpoint(find_run(runs, body.run), body.run, body.checkpoint)
    key = str(path.resolve())
    async with runs.lock:  # one load at a time: two clicks must not load the same checkpoint twice
        name = runs.loaded.get(key)
        if name is None and len(runs.loaded) >= MAX_LOADED:
            raise APIError(
                400,
                f"{MAX_LOADED} checkpoints are loaded from runs already (each holds memory); restart "
                "the server to load others",
                "checkpoint",
                "too_many_models",
            )
        name = name or served_name(body.run, body.checkpoint, set(state.models))
        try:
            served = await with_retry(state.engine.load, ModelSpec(str(path), None, runs.max_batch), name)
        except (TinyLMError, OSError) as exc:  # e.g. the trainer replaced the checkpoint while it was read
            raise bad("checkpoint", f"{body.run}/{body.checkpoint} could not be loaded ({exc}); try again") from exc
        old = state.models.get(name)
        state.models[name], runs.loaded[key] = served, name
    if old is not None:
        await asyncio.to_thread(old.scheduler.close)
    return {"model": name, "reloaded": old is not None, "step": (served.source.get("meta") or {}).get("step")}


@router.post("/v1/tinylm/runs/samples")
async def samples(body: SamplesRequest, state: StateDep):
    run = find_run(runs_root(state), body.run)
    find_checkpoint(run, body.run, body.checkpoint)
    try:
        done = await with_retry(state.engine.run, checkpoint_samples, run, body.checkpoint, body.max_tokens)
    except (TinyLMError, OSError) as exc:
        raise bad("checkpoint", f"{body.run}/{body.checkpoint}: {exc}") from exc
    return {"run": body.run, "checkpoint": body.checkpoint, "samples": done}
