"""Everything needed to continue a run exactly where a checkpoint left it, stored without pickle.

A resumable checkpoint directory adds three files to the model checkpoint:

    optimizer.safetensors   AdamW moments and step counts, one tensor per (parameter index, name)
    rng.safetensors         every RNG state as a uint8 / int64 tensor (torch CPU and CUDA per rank,
                            NumPy's Mersenne Twister key)
    training_state.json     step (= data position: batches are a function of the step), tokens
                            seen, best validation loss, early-stopping counter, world size,
                            optimizer param groups, gradient-scaler state, Python's RNG state

The learning-rate schedule is a pure function of the step, so the step is its whole state.

``resume_run_config`` decides the configuration of a resumed run: the checkpoint's own config,
changed only by the keys the user asks for; keys that would change the training computation are
refused, and keys in ``FORCE_ALLOWED`` need ``--force``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tinylm.config import (
    RunConfig,
    apply_updates,
    build_config,
    config_from_dict,
    diff_configs,
    load_config_file,
    parse_overrides,
)
from tinylm.errors import TinyLMError
from tinylm.models.checkpoint import REQUIRED_FILES, STEP_PREFIX, checkpoint_model_config, read_checkpoint_meta

STATE_FILES = ("training_state.json", "optimizer.safetensors", "rng.safetensors")
STATE_VERSION = 1

# Keys a resumed run may change with --force: they steer how long to train, what to log or where
# to run, not the arithmetic of an update. (max_steps also stretches the cosine schedule.)
FORCE_ALLOWED = (
    "train.max_steps",
    "train.max_minutes",
    "train.eval_interval",
    "train.eval_batches",
    "train.log_interval",
    "train.save_interval",
    "train.keep_last",
    "train.early_stopping_patience",
    "train.tensorboard",
    "train.progress",
    "train.threads",
    "train.device",
    "train.grad_checkpointing",
    "train.checkpoint_impl",
    "sample.",
)
IGNORED_KEYS = ("out_dir",)


# ------------------------------------------------------------------------------------- RNG state
def capture_rng() -> dict:
    """This process's RNG states: torch CPU and CUDA as uint8 tensors, Python and NumPy."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
    }


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available() and state["torch_cuda"]:
        for i, s in enumerate(state["torch_cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))


# -------------------------------------------------------------------------------- save / load
def _optimizer_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            (tensors if isinstance(value, torch.Tensor) else scalars)[f"{idx}.{name}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def state_payload(optimizer, scaler, rng_per_rank: list[dict], counters: dict) -> tuple[dict, dict]:
    """(extra_tensors, extra_files) for ``save_checkpoint``: the resumable part of a checkpoint."""
    opt_tensors, opt_json = _optimizer_files(optimizer)
    rng_tensors, rng_json = {}, []
    for rank, rng in enumerate(rng_per_rank):
        rng_tensors[f"rank{rank}.torch_cpu"] = rng["torch_cpu"]
        for dev, s in enumerate(rng["torch_cuda"]):
            rng_tensors[f"rank{rank}.torch_cuda.{dev}"] = s
        name, key, pos, has_gauss, cached = rng["numpy"]
        rng_tensors[f"rank{rank}.numpy_key"] = key
        version, internal, gauss = rng["python"]
        rng_json.append(
            {
                "python": [version, list(internal), gauss],
                "numpy": [name, pos, has_gauss, cached],
                "cuda_devices": len(rng["torch_cuda"]),
            }
        )
    state = {
        "version": STATE_VERSION,
        **counters,
        "optimizer": opt_json,
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rng_json,
    }
    files = {"training_state.json": json.dumps(state, indent=1).encode()}
    return {"optimizer.safetensors": opt_tensors, "rng.safetensors": rng_tensors}, files


@dataclasses.dataclass
class ResumeState:
    path: Path
    step: int
    counters: dict
    optimizer_state: dict
    scaler_state: dict
    rng_per_rank: list[dict]
    run_config: dict


def is_resumable(path: Path) -> bool:
    return all((path / f).is_file() for f in (*REQUIRED_FILES, *STATE_FILES))


def find_resume_checkpoint(path: str | Path) -> Path:
    """A resumable checkpoint directory, or the newest one inside a run directory."""
    path = Path(path)
    if not path.exists():
        raise TinyLMError(f"resume: {path} does not exist")
    if is_resumable(path):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    candidates = []
    for d in root.iterdir():
        if d.is_dir() and not d.name.endswith((".tmp", ".old")) and is_resumable(d):
            step = read_training_state(d).get("step")
            step = step if isinstance(step, int) and not isinstance(step, bool) else -1  # corrupt: named on load
            # newest step first; for one step prefer step-N, then last, then best
            rank = 2 if d.name.startswith(STEP_PREFIX) else 1 if d.name == "last" else 0
            candidates.append((step, rank, d))
    if not candidates:
        raise TinyLMError(
            f"resume: {path} holds no complete resumable checkpoint "
            f"(a directory with {', '.join(REQUIRED_FILES + STATE_FILES)})"
        )
    return max(candidates, key=lambda c: (c[0], c[1]))[2]


def run_dir_of(ckpt: Path) -> Path:
    """checkpoints/step-N -> the run directory holding metrics.csv."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def read_training_state(ckpt: Path) -> dict:
    """``training_state.json`` of a resumable checkpoint, as a JSON object; errors name the file."""
    where = ckpt / "training_state.json"
    try:
        state = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise TinyLMError(f"resume: {where} is corrupt ({exc})") from exc
    if not isinstance(state, dict):
        raise TinyLMError(f"resume: {where} is corrupt (a JSON {type(state).__name__}, not an object)")
    return state


COUNTERS = {
    "step": int,
    "tokens_seen": int,
    "best_val": (int, float),
    "bad_evals": int,
    "world_size": int,
    "data_position": int,
}


def load_resume_state(path: str | Path) -> ResumeState:
    ckpt = find_resume_checkpoint(path)
    checkpoint_model_config(*read_checkpoint_meta(ckpt))  # a damaged checkpoint.json: named now, not after training
    state = read_training_state(ckpt)
    try:
        opt_tensors = load_file(str(ckpt / "optimizer.safetensors"))
        rng_tensors = load_file(str(ckpt / "rng.safetensors"))
    except Exception as exc:
        raise TinyLMError(f"resume: the training state in {ckpt} is unreadable ({exc})") from exc
    if state.get("version") != STATE_VERSION:
        raise TinyLMError(f"resume: {ckpt} has training-state version {state.get('version')}, expected {STATE_VERSION}")
    try:  # a damaged file of the three fails here, named, rather than in the middle of training
        opt_json = state["optimizer"]
        entries: dict[int, dict] = {}
        for key, value in [*opt_tensors.items(), *opt_json["scalars"].items()]:
            idx, name = key.split(".", 1)
            entries.setdefault(int(idx), {})[name] = value
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in opt_json["param_groups"]]
        rng_per_rank = []
        for rank, info in enumerate(state["rng"]):
            version, internal, gauss = info["python"]
            name, pos, has_gauss, cached = info["numpy"]
            rng_per_rank.append(
                {
                    "torch_cpu": rng_tensors[f"rank{rank}.torch_cpu"],
                    "torch_cuda": [rng_tensors[f"rank{rank}.torch_cuda.{d}"] for d in range(info["cuda_devices"])],
                    "python": (version, internal, gauss),
                    "numpy": (name, rng_tensors[f"rank{rank}.numpy_key"], pos, has_gauss, cached),
                }
            )
        current = capture_rng()
        try:  # every saved RNG state must be one this process can restore
            for rng in rng_per_rank:
                restore_rng(rng)
        finally:
            restore_rng(current)
        counters = {k: state[k] for k in COUNTERS}
        for k, kind in COUNTERS.items():
            if isinstance(counters[k], bool) or not isinstance(counters[k], kind):
                raise TypeError(f"{k} is {counters[k]!r}")
        if len(rng_per_rank) != counters["world_size"]:
            raise ValueError(f"{len(rng_per_rank)} RNG states for world_size {counters['world_size']}")
        if not isinstance(state.get("scaler", {}), dict):
            raise TypeError(f"scaler is {state['scaler']!r}")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError, OverflowError) as exc:
        raise TinyLMError(
            f"resume: the training state in {ckpt} ({', '.join(STATE_FILES)}) is corrupt ({type(exc).__name__}: {exc})"
        ) from exc
    run_config = load_config_file(ckpt / "config.yaml") if (ckpt / "config.yaml").is_file() else {}
    return ResumeState(
        ckpt,
        state["step"],
        counters,
        {"state": entries, "param_groups": groups},
        state.get("scaler", {}),
        rng_per_rank,
        run_config,
    )


def _same_kind(fresh, saved) -> bool:
    """Whether a saved optimizer setting can stand in for the fresh optimizer's value."""
    if fresh is None:
        return saved is None or isinstance(saved, bool)
    if isinstance(fresh, (bool, str)):
        return type(saved) is type(fresh)
    if isinstance(fresh, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(fresh, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(fresh) and all(map(_same_kind, fresh, saved))
    return True


def restore_optimizer(optimizer: torch.optim.Optimizer, state: ResumeState) -> None:
    """Load the saved optimizer state, checked against this model's parameters and settings first:
    a moment of the wrong shape or a setting of the wrong type would otherwise fail only inside
    a later optimizer step."""
    where = f"resume: the optimizer state in {state.path}"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_count = sum(len(g.get("params", ())) for g in state.optimizer_state["param_groups"])
    if saved_count > len(params):
        # the q, k, v (and SwiGLU's gate, up) matrices became one parameter each: an optimizer state
        # from before holds their moments per part, numbered in the old parameter order
        raise TinyLMError(
            f"{where} is for {saved_count} parameters, the model has {len(params)}: a run saved "
            "before tinylm fused attention's q, k, v (and SwiGLU's gate, up) into one matrix each "
            "cannot resume its optimizer; its checkpoints still load (evaluate, generate, export)"
        )
    for idx, entry in state.optimizer_state["state"].items():
        if not 0 <= idx < len(params):
            raise TinyLMError(f"{where} is for parameter {idx}; the model has {len(params)}")
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != params[idx].shape:
                raise TinyLMError(
                    f"{where} does not fit the model: {idx}.{name} has shape {tuple(value.shape)}, "
                    f"the parameter {tuple(params[idx].shape)}"
                )
    saved_groups = state.optimizer_state["param_groups"]
    for fresh, saved in zip(optimizer.param_groups, saved_groups):
        bad = [k for k, v in fresh.items() if k != "params" and k in saved and not _same_kind(v, saved[k])]
        if bad:
            raise TinyLMError(f"{where} has a bad {bad[0]} ({saved[bad[0]]!r})")
    try:
        optimizer.load_state_dict(state.optimizer_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise TinyLMError(f"{where} does not fit the model ({exc})") from exc


# --------------------------------------------------------------------------------- config check
def _allowed(key: str) -> bool:
    return any(key == a or (a.endswith(".") and key.startswith(a)) for a in FORCE_ALLOWED)


def check_resume_config(saved: dict, requested: dict, force: bool) -> list[str]:
    """Keys that differ (and are allowed with --force); raise for any other difference."""
    differ = [k for k in diff_configs(saved, requested) if k not in IGNORED_KEYS]
    refused = [k for k in differ if not _allowed(k)]
    if refused:
        raise TinyLMError(
            f"resume: the requested config differs from the checkpoint's in {', '.join(refused)}; "
            "these change the training itself and cannot be overridden (start a new run instead)"
        )
    if differ and not force:
        raise TinyLMError(
            f"resume: the requested config differs from the checkpoint's in {', '.join(differ)}; "
            "pass --force to resume with the new values"
        )
    return differ


def _normalise(cfg: RunConfig, saved_model: dict) -> dict:
    """Fill a requested model config's derived fields the way the saved (resolved) one was."""
    model = cfg.model
    if not model.vocab_size and saved_model.get("vocab_size"):
        model = dataclasses.replace(model, vocab_size=saved_model["vocab_size"])
    try:
        model = model.resolved()
    except TinyLMError:
        pass  # the diff will name the key
    return dataclasses.replace(cfg, model=model).to_dict()  # tuples as lists, as the saved YAML holds them


def resume_run_config(
    resume: str | Path, config_path: str | None, overrides: list[str] | None, force: bool = False, quick: bool = False
) -> tuple[RunConfig, Path, list[str]]:
    """(config to run, checkpoint to resume from, keys changed with --force).

    Without ``--config`` the checkpoint's config is the base and ``overrides`` change it; with a
    config file that file (plus overrides) must describe the same training.
    """
    state_dir = find_resume_checkpoint(resume)
    if not (state_dir / "config.yaml").is_file():
        raise TinyLMError(f"resume: {state_dir} has no config.yaml")
    saved = load_config_file(state_dir / "config.yaml")
    missing = [k for k in ("data", "tokenizer", "model", "train") if not isinstance(saved.get(k), dict)]
    if missing:  # else every key would be reported as a change the user asked for
        raise TinyLMError(f"resume: {state_dir / 'config.yaml'} is damaged (no {', '.join(missing)} section)")
    if config_path is not None:
        requested = build_config(config_path, overrides, quick=quick)
    else:
        requested = config_from_dict(saved)
        if overrides:
            apply_updates(requested, parse_overrides(overrides))
    changed = check_resume_config(saved, _normalise(requested, saved.get("model", {})), force)
    requested.out_dir = str(run_dir_of(state_dir))
    return requested, state_dir, changed


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"
