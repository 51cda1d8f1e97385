"""Checkpoints: a directory with weights in safetensors and everything else in JSON/YAML.

    model.safetensors   the (unwrapped) model's weights; a tied output head is stored once
    checkpoint.json     format version, model config, step, metrics, the tokenizer's file name
    tokenizer.json      the tokenizer, so a checkpoint directory is self-contained
    config.yaml         the full resolved run config

Loading never unpickles anything. Directories are written under a temporary name and renamed
into place, so an interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tinylm import __version__
from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT
from tinylm.tokenizers import Tokenizer, load_tokenizer

FORMAT_NAME = "tinylm-checkpoint"
FORMAT_VERSION = 1
REQUIRED_FILES = ("model.safetensors", "checkpoint.json", "tokenizer.json")
STEP_PREFIX = "step-"  # periodic checkpoints: checkpoints/step-0000100, the last ``keep_last`` kept


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile / DistributedDataParallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = unwrap(model)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_weights", False):
        state.pop("lm_head.weight", None)  # the same tensor as tok_emb.weight
    return state


def _fsync_dir_files(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    run_config=None,
    info: dict | None = None,
    extra_files: dict[str, bytes] | None = None,
    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write a checkpoint directory atomically. ``extra_tensors`` maps file names to tensor dicts
    (saved as safetensors, e.g. optimizer state); ``extra_files`` maps file names to raw bytes."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model = unwrap(model)
    save_file(model_state(model), str(tmp / "model.safetensors"))
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "tinylm_version": __version__,
            "model_config": asdict(model.config), "tokenizer": "tokenizer.json", **(info or {})}
    (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=2))
    tokenizer.save(tmp / "tokenizer.json")
    if run_config is not None:
        run_config.save(tmp / "config.yaml")
    for name, tensors in (extra_tensors or {}).items():
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / name))
    for name, payload in (extra_files or {}).items():
        (tmp / name).write_bytes(payload)
    _fsync_dir_files(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)
    return path


def prune_step_checkpoints(ckpt_root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` step-N checkpoints (``best`` and ``last`` are separate)."""
    root = Path(ckpt_root)
    if keep_last < 1 or not root.is_dir():
        return []
    steps = sorted((d for d in root.iterdir() if d.is_dir() and d.name.startswith(STEP_PREFIX)
                    and d.name[len(STEP_PREFIX):].isdigit()), key=lambda d: int(d.name[len(STEP_PREFIX):]))
    removed = steps[:-keep_last]
    for d in removed:
        shutil.rmtree(d)
    return removed


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory (then its best, else last, checkpoint)."""
    path = Path(path)
    old = path.with_name(path.name + ".old")  # a save interrupted between its two renames
    if not path.exists() and (old / "checkpoint.json").is_file():
        return old
    if not path.exists():
        raise TinyLMError(f"checkpoint {path} does not exist")
    if (path / "checkpoint.json").is_file():
        return path
    for sub in ("checkpoints/best", "checkpoints/last", "best", "last"):
        if (path / sub / "checkpoint.json").is_file():
            return path / sub
    for root in (path / "checkpoints", path):  # a run cut short before best/last: its newest step-N
        steps = sorted((d for d in root.glob(f"{STEP_PREFIX}*") if (d / "checkpoint.json").is_file()
                        and d.name[len(STEP_PREFIX):].isdigit()), key=lambda d: int(d.name[len(STEP_PREFIX):]))
        if steps:
            return steps[-1]
    raise TinyLMError(f"{path} is not a tinylm checkpoint directory (no checkpoint.json)")


def read_checkpoint_meta(path: str | Path) -> tuple[Path, dict]:
    ckpt = resolve_checkpoint_dir(path)
    missing = [f for f in REQUIRED_FILES if not (ckpt / f).is_file()]
    if missing:
        raise TinyLMError(f"checkpoint {ckpt} is missing {', '.join(missing)}; it is incomplete or not a tinylm checkpoint")
    try:
        meta = json.loads((ckpt / "checkpoint.json").read_text())
    except json.JSONDecodeError as exc:
        raise TinyLMError(f"{ckpt / 'checkpoint.json'} is corrupt ({exc})") from exc
    if meta.get("format") != FORMAT_NAME:
        raise TinyLMError(f"{ckpt} was not written by tinylm (format {meta.get('format')!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise TinyLMError(
            f"checkpoint {ckpt} has format version {meta.get('version')}, this tinylm reads version "
            f"{FORMAT_VERSION}; re-save it with a matching tinylm"
        )
    return ckpt, meta


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer, dict]:
    """(model in eval mode, tokenizer, checkpoint.json contents)."""
    ckpt, meta = read_checkpoint_meta(path)
    known = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in known})
    model = GPT(cfg)
    try:
        state = load_file(str(ckpt / "model.safetensors"))
    except Exception as exc:
        raise TinyLMError(f"{ckpt / 'model.safetensors'} is corrupt or unreadable ({exc})") from exc
    if cfg.tie_weights:
        state["lm_head.weight"] = state["tok_emb.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TinyLMError(f"checkpoint {ckpt} does not match its model config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    model.to(device).eval()
    return model, tokenizer, meta
