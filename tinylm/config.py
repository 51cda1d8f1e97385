"""Configuration as dataclasses: load from YAML/TOML, override with ``section.key=value``.

A run is described by one ``RunConfig`` with a section per pipeline stage. Unknown keys, values
of the wrong type and floats that are not finite are errors that name the key, never silently
ignored.

Presets ship inside the package (``tinylm/presets/*.yaml``), so ``--config tinystories-cpu-1h``
works from any directory and from an installed wheel; a path to a file works too. A preset may
hold a ``quick`` section: with ``--quick`` it is merged over the rest (a smaller model, shorter
runs, the same protocol), without it it is ignored. Every command with a config does it this way.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tinylm.data.cleaning import CleanOptions
from tinylm.errors import TinyLMError


@dataclass
class DataConfig(CleanOptions):
    """Where the documents come from and how they are split and batched; the cleaning flags
    (``data.fix_unicode`` etc., each counted in the prepare report) come from CleanOptions, so
    ``cfg.data`` is what the cleaning functions take."""

    # source: "shakespeare", "tinystories" (text file, json shard(s) or hub id), or "text" (.txt/.jsonl)
    source: str = "shakespeare"
    train: str | None = None  # path (or hub id for tinystories); None for shakespeare
    valid: str | None = None  # optional; when None a split is made from train
    test: str | None = None
    hub_story_limit: int | None = None  # TinyStories through `datasets`: stream at most this many
    valid_fraction: float = 0.05
    test_fraction: float = 0.05
    split_by: str = "document"  # "document" (whole plays/stories) or "chunk" (contiguous chunks)
    max_documents: int | None = None
    # how token batches are formed: "packed" (nanoGPT stream) or "stories" (one padded sequence each)
    batching: str = "packed"
    # training split only: this fraction of the stories (a fixed seeded draw) gets its quotes,
    # apostrophes and dashes written as UTF-8-read-as-Windows-1252 mojibake ("â€œ"), as the
    # official TinyStories files carry it (tinylm.data.augment)
    mojibake_fraction: float = 0.0


@dataclass
class TokenizerConfig:
    type: str = "bpe"  # bpe | char | word | word_bpe
    vocab_size: int = 1024
    merges: int | None = None  # word_bpe: number of merges (None: as many as make vocab_size)
    normalization: str = "lower_nopunct"  # word_bpe: lower_nopunct | aggressive | none
    lowercase: bool = False  # word-level only
    path: str | None = None  # reuse a saved tokenizer instead of training one
    min_count: int = 1  # word-level: keep only words seen this often (with the vocab_size cap; 0 = no cap)
    keep_punctuation: bool = True  # word-level: punctuation marks are tokens (else dropped)
    splitter: str = "regex"  # word-level: regex | spacy (spaCy's rule-based English tokenizer)
    # word-level: the order of the special tokens, and whether they come before the words or after them
    special_tokens: list[str] = field(default_factory=lambda: ["<pad>", "<unk>", "<sos>", "<eos>"])
    specials_at: str = "start"  # start | end
    oov: str = "unk"  # word-level: words out of the vocabulary become unk | bpe (character BPE pieces)
    oov_merges: int = 1000  # word-level with oov=bpe: merges of the pieces' BPE
    pattern: str = "gpt2"  # bpe pre-tokenisation split: gpt2 | gpt4 | a custom regex


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: taken from the tokenizer
    context_length: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_attn: int | None = None  # attention width; None means d_model (300 with 8 heads needs 304)
    n_kv_heads: int | None = None  # grouped-query attention; None means n_heads
    d_ff: int | None = None  # None means 4 * d_model
    dropout: float = 0.0  # on the embeddings and on each block's residual branches
    # on the attention weights; None means `dropout`. On CPU any attention dropout takes SDPA off its
    # fused kernel (the T x T weights are materialised and masked), so 0 here trains much faster.
    attn_dropout: float | None = None
    positions: str = "learned"  # learned | sinusoidal | rope | none
    rope_theta: float = 10000.0
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    ffn: str = "gelu"  # gelu (GPT-2's tanh approximation) | relu | relu2 (relu(x)^2) | swiglu
    init: str = "gpt2"  # gpt2: N(0, 0.02), residual projections scaled | xavier: Xavier-uniform matrices
    bias: bool = True
    tie_weights: bool = True
    d_embed: int | None = None  # token embedding width; None = d_model, else a learned projection to d_model
    attention: str = "sdpa"  # manual (matmul, mask, softmax) | sdpa (F.scaled_dot_product_attention)
    qk_norm: bool = False  # RMS-normalise each head's queries and keys (no gain) before the rotary positions
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap); None: off
    zero_init_out: bool = False  # residual output projections (attention out, FFN down) start at zero

    def resolved(self) -> "ModelConfig":
        """Fill the derived widths and check that the shapes fit together."""
        cfg = dataclasses.replace(self)
        if cfg.d_attn is None:
            cfg.d_attn = cfg.d_model
        if cfg.n_kv_heads is None:
            cfg.n_kv_heads = cfg.n_heads
        if cfg.d_ff is None:
            cfg.d_ff = 4 * cfg.d_model
        if cfg.d_embed is None:
            cfg.d_embed = cfg.d_model
        if cfg.attn_dropout is None:
            cfg.attn_dropout = cfg.dropout
        if cfg.d_embed != cfg.d_model and cfg.tie_weights:
            raise TinyLMError(
                f"model.tie_weights=true needs the embedding width (d_embed={cfg.d_embed}) to equal "
                f"d_model={cfg.d_model}; set model.tie_weights=false (the embedding then goes through a "
                f"learned projection) or model.d_embed={cfg.d_model}"
            )
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_attn", "n_kv_heads", "d_ff",
                     "d_embed"):
            if getattr(cfg, name) < 1:
                raise TinyLMError(f"model.{name} must be at least 1 (got {getattr(cfg, name)})")
        if cfg.d_attn % cfg.n_heads:
            raise TinyLMError(
                f"model.n_heads={cfg.n_heads} does not divide the attention width {cfg.d_attn}; "
                f"set model.d_attn to a multiple of {cfg.n_heads} (e.g. "
                f"{-(-cfg.d_attn // cfg.n_heads) * cfg.n_heads})"
            )
        if cfg.n_heads % cfg.n_kv_heads:
            raise TinyLMError(
                f"model.n_kv_heads={cfg.n_kv_heads} must divide model.n_heads={cfg.n_heads}"
            )
        if cfg.positions == "rope" and (cfg.d_attn // cfg.n_heads) % 2:
            raise TinyLMError("rotary positions need an even head width (d_attn / n_heads)")
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(cfg, name) < 1.0:
                raise TinyLMError(f"model.{name} must be in [0, 1) (got {getattr(cfg, name)})")
        _check_choice("model.positions", cfg.positions, ("learned", "sinusoidal", "rope", "none"))
        _check_choice("model.norm", cfg.norm, ("layernorm", "rmsnorm"))
        _check_choice("model.ffn", cfg.ffn, ("gelu", "relu", "relu2", "swiglu"))
        if cfg.logit_softcap is not None and cfg.logit_softcap <= 0:
            raise TinyLMError(f"model.logit_softcap must be positive or null (got {cfg.logit_softcap})")
        _check_choice("model.init", cfg.init, ("gpt2", "xavier"))
        _check_choice("model.attention", cfg.attention, ("manual", "sdpa"))
        return cfg


@dataclass
class TrainConfig:
    batch_size: int = 16  # sequences per micro-batch (per process)
    # sequences per optimizer step over all processes and micro-steps; when set, batch_size is
    # derived as global_batch_size / (world size * grad_accum_steps), which must divide evenly
    global_batch_size: int | None = None
    grad_accum_steps: int = 1
    max_steps: int = 1000
    # passes over the training split instead of max_steps: every story (packed: every context
    # window) once per epoch in a seeded order; one row per epoch in epochs.csv
    epochs: int | None = None
    max_minutes: float | None = None  # wall-clock budget, checked every step
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    # what the decay after warmup follows: "steps" (progress = step / max_steps) or "wall" (progress =
    # elapsed / max_minutes, so a wall-clock budget ends at min_lr on any machine; needs max_minutes)
    schedule_clock: str = "steps"
    weight_decay: float = 0.1
    # adamw, or muon: Muon (torch.optim.Muon) for the blocks' weight matrices, AdamW for the rest
    # (embeddings, output head, norm gains, biases) at train.lr
    optimizer: str = "adamw"
    muon_lr: float = 0.02  # Muon's peak learning rate; the schedule scales it like train.lr
    muon_momentum: float = 0.95
    # exponential moving average of the weights (0: off): updated every step, evaluated at the end
    # and saved as checkpoints/ema; decay d averages over about 1 / (1 - d) steps
    ema_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    # training targets mixed with the uniform distribution (F.cross_entropy's label_smoothing);
    # validation losses and perplexities are always the plain NLL
    label_smoothing: float = 0.0
    eval_interval: int = 100
    eval_batches: int = 20  # 0: the whole validation split
    log_interval: int = 10
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    precision: str = "fp32"  # fp32 | bf16 | fp16
    # torch.compile forward, loss and backward (each block alone under grad_checkpointing with the
    # tinylm implementation) and use AdamW's fused kernel
    compile: bool = False
    grad_checkpointing: bool = False
    checkpoint_impl: str = "tinylm"  # tinylm (our autograd.Function) | torch (reference)
    keep_last: int = 2  # resumable step-N checkpoints kept (plus best and last)
    save_interval: int = 0  # steps between resumable checkpoints; 0: at every evaluation
    early_stopping_patience: int = 0  # evaluations without improvement; 0 disables
    tensorboard: bool = False
    threads: int | None = None  # torch.set_num_threads; None leaves torch's default
    progress: bool = True


@dataclass
class SampleConfig:
    prompts: list[str] = field(default_factory=lambda: ["ROMEO:"])
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = None
    seed: int = 0


@dataclass
class EmbeddingsConfig:
    """Pretrained / FastText-trained token embeddings (see tinylm/embeddings.py)."""

    kind: str = "none"  # none | auto | vec | bin | gensim | train (gensim FastText on the train split)
    path: str | None = None  # the .vec / .bin / gensim file (not for none/train)
    freeze: bool = False  # no gradient into the embedding matrix
    oov: str = "subword"  # words without a vector: subword (FastText n-grams, when available) | noise
    noise_std: float | None = None  # None: the std of the vectors found
    seed: int = 0
    train_epochs: int = 5  # kind=train only
    train_window: int = 5
    train_min_count: int = 1


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TinyLMError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check (and for strings from the command line, convert) a value against a field type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except TinyLMError as exc:
                errors.append(str(exc))
        raise TinyLMError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is list:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [value]
            except RecursionError:
                raise TinyLMError(f"config key {key}: the list {value[:20]}... is nested too deeply") from None
        if not isinstance(value, list):
            raise TinyLMError(f"config key {key} expects a list, got {value!r}")
        return [_coerce(key, v, args[0]) for v in value] if args else value
    if annotation in _EXPECTS:
        result = _scalar(annotation, value)
        if result is None:
            raise TinyLMError(f"config key {key} expects {_EXPECTS[annotation]}, got {value!r}")
        if annotation is float and not math.isfinite(result):
            raise TinyLMError(f"config key {key} must be a finite number, got {value!r}")
        return result
    return value


_EXPECTS = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
_BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


def _scalar(annotation: type, value: Any) -> Any:
    """``value`` as a bool, int, float or str (strings from the command line converted), or None."""
    if annotation is bool:
        return value if isinstance(value, bool) else _BOOL_WORDS.get(value.lower()) if isinstance(value, str) else None
    if isinstance(value, bool):  # true/false is no number and no string here
        return None
    if annotation is str:
        return str(value) if isinstance(value, (str, int, float)) else None
    if annotation is int and isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return annotation(value.replace("_", "") if isinstance(value, str) else value) \
            if isinstance(value, (str, int, float)) else None
    except (ValueError, OverflowError):  # OverflowError: an int too large for a float
        return None


def apply_updates(obj: Any, updates: dict[str, Any], prefix: str = "") -> None:
    """Set a (nested) dict of values on a config dataclass, checking every key and type."""
    hints = _field_types(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in updates.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in names:
            close = [n for n in names if isinstance(key, str) and key and n.startswith(key[:3])]
            hint = f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""
            raise TinyLMError(f"unknown config key {full}{hint}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise TinyLMError(f"config key {full} is a section; give keys like {full}.name=value")
            apply_updates(current, value, prefix=f"{full}.")
        else:
            setattr(obj, key, _coerce(full, value, hints[key]))


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["model.d_model=64", "out_dir=x"]`` -> nested dict. Values stay strings; types are checked later."""
    nested: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise TinyLMError(f"override {pair!r} is not of the form section.key=value")
        key, value = pair.split("=", 1)
        parts = key.strip().split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


PRESETS = resources.files("tinylm") / "presets"


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in PRESETS.iterdir() if p.name.endswith(".yaml"))


def load_config_file(spec: str | Path) -> dict[str, Any]:
    """The mapping in a YAML/TOML file, or in the preset of that name (``tinystories-cpu-1h``)."""
    p = Path(spec)
    if p.is_file():
        text, where = p.read_text(encoding="utf-8", errors="replace"), p
    else:
        preset = PRESETS / (p.name if p.name.endswith(".yaml") else f"{p.name}.yaml")
        if p.parent != Path(".") or not preset.is_file():
            raise TinyLMError(f"config file {p} does not exist (presets: {', '.join(preset_names())})")
        text, where = preset.read_text(encoding="utf-8"), p
    try:
        if where.suffix == ".toml":
            import tomllib  # Python >= 3.11 only, and only needed for TOML files

            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as exc:  # yaml/toml parse errors have long messages; keep the first line
        raise TinyLMError(f"config file {p} is not valid: {str(exc).splitlines()[0]}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TinyLMError(f"config file {p} must hold a mapping of sections")
    return data


def merge_dicts(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, section by section (neither is changed)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_config(spec: str | Path | None, quick: bool = False) -> dict[str, Any]:
    """The file's (or preset's) mapping, with its ``quick`` section merged in when ``quick``."""
    raw = load_config_file(spec) if spec is not None else {}
    quick_section = raw.pop("quick", None) or {}
    if not isinstance(quick_section, dict):
        raise TinyLMError(f"the quick section of {spec} must be a mapping of sections")
    if quick and not quick_section:
        raise TinyLMError(f"--quick: {spec or 'the default configuration'} has no quick section")
    return merge_dicts(raw, quick_section) if quick else raw


def build_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    quick: bool = False,
) -> RunConfig:
    """Defaults <- the file (or preset) at ``path`` (its quick section too with ``quick``) <-
    command-line ``overrides``."""
    cfg = RunConfig()
    apply_updates(cfg, read_config(path, quick))
    if overrides:
        apply_updates(cfg, parse_overrides(overrides))
    return cfg


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    apply_updates(cfg, data)
    return cfg


def diff_configs(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys (dotted) whose values differ between two nested config dicts."""
    keys = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += diff_configs(va, vb, f"{prefix}{k}.")
        elif va != vb:
            keys.append(f"{prefix}{k}")
    return keys
