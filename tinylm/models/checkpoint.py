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
from tinylm.config import ModelConfig, apply_updates
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
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tinylm_version": __version__,
        "model_config": asdict(model.config),
        "tokenizer": "tokenizer.json",
        **(info or {}),
    }
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


def _step_dirs(root: Path) -> list[Path]:
    """The step-N directories under ``root``, oldest first."""
    steps = (d for d in root.glob(f"{STEP_PREFIX}*") if d.is_dir() and d.name[len(STEP_PREFIX) :].isdigit())
    return sorted(steps, key=lambda d: int(d.name[len(STEP_PREFIX) :]))


def prune_step_checkpoints(ckpt_root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` step-N checkpoints (``best`` and ``last`` are separate)."""
    if keep_last < 1:
        return []
    removed = _step_dirs(Path(ckpt_root))[:-keep_last]
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
        steps = [d for d in _step_dirs(root) if (d / "checkpoint.json").is_file()]
        if steps:
            return steps[-1]
    raise TinyLMError(f"{path} is not a tinylm checkpoint directory (no checkpoint.json)")


def read_checkpoint_meta(path: str | Path) -> tuple[Path, dict]:
    ckpt = resolve_checkpoint_dir(path)
    missing = [f for f in REQUIRED_FILES if not (ckpt / f).is_file()]
    if missing:
        raise TinyLMError(
            f"checkpoint {ckpt} is missing {', '.join(missing)}; it is incomplete or not a tinylm checkpoint"
        )
    try:
        meta = json.loads((ckpt / "checkpoint.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise TinyLMError(f"{ckpt / 'checkpoint.json'} is corrupt ({exc})") from exc
    if not isinstance(meta, dict):
        raise TinyLMError(f"{ckpt / 'checkpoint.json'} is corrupt (a JSON {type(meta).__name__}, not an object)")
    if meta.get("format") != FORMAT_NAME:
        raise TinyLMError(f"{ckpt} was not written by tinylm (format {meta.get('format')!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise TinyLMError(
            f"checkpoint {ckpt} has format version {meta.get('version')}, this tinylm reads version "
            f"{FORMAT_VERSION}; re-save it with a matching tinylm"
        )
    return ckpt, meta


def checkpoint_model_config(ckpt: Path, meta: dict) -> ModelConfig:
    """The ``model_config`` of a checkpoint.json, every key type-checked and the shapes resolved."""
    where = ckpt / "checkpoint.json"
    raw = meta.get("model_config")
    if not isinstance(raw, dict):
        raise TinyLMError(f'{where} is corrupt (no "model_config" object)')
    cfg = ModelConfig()
    try:
        apply_updates(cfg, {k: v for k, v in raw.items() if k in ModelConfig.__dataclass_fields__}, "model_config.")
        return cfg.resolved()
    except TinyLMError as exc:
        raise TinyLMError(f"{where} is corrupt: {exc}") from exc


def _approx_size(cfg: ModelConfig) -> int:
    """Roughly the values a GPT of ``cfg`` allocates (weights and position tables), from above."""
    head = cfg.d_attn // cfg.n_heads
    per_layer = 2 * cfg.d_model * cfg.d_attn + 2 * cfg.d_model * head * cfg.n_kv_heads + 3 * cfg.d_model * cfg.d_ff
    positions = {"learned": cfg.d_model, "sinusoidal": cfg.d_model, "rope": head}.get(cfg.positions, 0)
    value_tables = sum(map(cfg.has_value_embedding, range(cfg.n_layers))) * cfg.vocab_size * head * cfg.n_kv_heads
    return (
        2 * cfg.vocab_size * max(cfg.d_embed, cfg.d_model)
        + cfg.context_length * positions
        + cfg.n_layers * per_layer
        + value_tables
    )


def read_model_state(ckpt: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights in ``ckpt/model.safetensors``, checked against ``cfg`` (names, shapes, finite
    values) before a model is built from them: a damaged file or config is named, never allocated."""
    where = ckpt / "model.safetensors"
    try:
        state = load_file(str(where))
    except Exception as exc:
        raise TinyLMError(f"{where} is corrupt or unreadable ({exc})") from exc
    stored = sum(t.numel() for t in state.values())
    if _approx_size(cfg) > 4 * stored + (1 << 26):
        raise TinyLMError(
            f"checkpoint {ckpt}: its model config describes a model far larger than the "
            f"{stored:,} values in {where.name}; checkpoint.json or {where.name} is corrupt"
        )
    if cfg.tie_weights and "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TinyLMError(
                f"{where} holds non-finite values (nan/inf) in {name}; the run diverged or the file is corrupt"
            )
    return state


def load_model_state(model: torch.nn.Module, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)``, with a mismatch named as a damaged checkpoint."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # size mismatches; the first lines name the tensors
        reason = "; ".join(line.strip() for line in str(exc).splitlines()[1:3])
        raise TinyLMError(f"checkpoint {ckpt}: model.safetensors does not match its model config ({reason})") from exc
    if missing or unexpected:
        raise TinyLMError(
            f"checkpoint {ckpt}: model.safetensors does not match its model config (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]})"
        )


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer, dict]:
    """(model in eval mode, tokenizer, checkpoint.json contents)."""
    ckpt, meta = read_checkpoint_meta(path)
    cfg = checkpoint_model_config(ckpt, meta)
    state = read_model_state(ckpt, cfg)
    model = GPT(cfg)
    load_model_state(model, ckpt, state)
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    if tokenizer.vocab_size > cfg.vocab_size:  # its ids would index past the embedding
        raise TinyLMError(
            f"checkpoint {ckpt}: tokenizer.json has {tokenizer.vocab_size} pieces but the model's "
            f"vocabulary has {cfg.vocab_size}; one of the two files is damaged"
        )
    model.to(device).eval()
    return model, tokenizer, meta
