"""Configuration as dataclasses: load from YAML/TOML, override with ``section.key=value``.

A run is described by one ``RunConfig`` with a section per pipeline stage, one typed schema:
closed choices are ``Literal``s, numbers declare their range beside the field (``option``), and
rules between fields live in one ``validate()`` per section. ``check_config`` checks it whole
before any work; unknown keys, values of the wrong type or out of range and floats that are not
finite are errors that name the key, never silently ignored.

Presets ship inside the package (``tinylm/presets/*.yaml``), so ``--config tinystories-cpu-1h``
works from any directory and from an installed wheel; a path to a file works too. A preset may
hold a ``quick`` section: with ``--quick`` it is merged over the rest (a smaller model, shorter
runs, the same protocol), without it it is ignored. Every command with a config does it this way.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from tinylm.errors import TinyLMError


# ------------------------------------------------------------------------------------- schema
class ConfigError(TinyLMError):
    """A value the schema refuses; ``key`` names the option, for surfaces that name it their way."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def option(
    default: Any = None,
    help: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    factory: Any = None,
    **extra: Any,
) -> Any:
    """A config field with its help text and the range its number (or each number of a list) must
    lie in; ``extra`` holds what one surface needs beside it (the command line's flag, ...)."""
    meta = {"help": help, "range": (ge, gt, le, lt), **extra}  # extra wins: a field's metadata copied whole
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def like(cls: type, name: str, default: Any = dataclasses.MISSING) -> Any:
    """``cls``'s field ``name`` again (its help, range and default, or another default)."""
    f = cls.__dataclass_fields__[name]
    return option(f.default if default is dataclasses.MISSING else default, **f.metadata)


def describe_range(bounds: tuple) -> str:
    ge, gt, le, lt = bounds
    low = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
    high = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    return next(f"{op} {b:g}" for op, b in zip((">=", ">", "<=", "<"), bounds) if b is not None)


def check_range(key: str, value: Any, bounds: tuple | None) -> None:
    """Refuse a number (or a list holding one) outside ``bounds`` = (ge, gt, le, lt)."""
    if not bounds or all(b is None for b in bounds) or value is None:
        return
    ge, gt, le, lt = bounds
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if (
            (ge is not None and v < ge)
            or (gt is not None and v <= gt)
            or (le is not None and v > le)
            or (lt is not None and v >= lt)
        ):
            raise ConfigError(key, f"{key} must be {describe_range(bounds)} (got {v!r})")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config dataclass (resolving them is slow: decoding checks its
    knobs at every call)."""
    return typing.get_type_hints(cls)


def check_fields(obj: Any, prefix: str = "") -> Any:
    """Each leaf field of a config dataclass checked against its type, closed choices and range."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if not dataclasses.is_dataclass(value):
            value = config_value(key, value, hints[f.name])
            check_range(key, value, f.metadata.get("range"))
            setattr(obj, f.name, value)
    return obj


def check_config(obj: Any, prefix: str = "") -> Any:
    """Every field of a config dataclass (and of its sections) checked against its type, its
    closed choices and its range, then each section's ``validate()`` (the rules that tie fields
    together). Returns ``obj``; the first problem is one TinyLMError naming the key."""
    check_fields(obj, prefix)
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            check_config(getattr(obj, f.name), f"{prefix}{f.name}.")
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except TinyLMError as exc:  # a section's rule may name its fields without the section's prefix
            if str(exc).startswith(prefix):
                raise
            key = prefix + exc.key if isinstance(exc, ConfigError) else prefix.rstrip(".")
            raise ConfigError(key, f"{prefix}{exc}") from None
    return obj


# ------------------------------------------------------------------------------ closed choices
# The choices that code below the schema checks too (a tokenizer, a vector table or an n-gram model
# built without a config), each declared once here; those modules read the values with
# ``typing.get_args``, so a choice added here is accepted everywhere at once.
TokenizerType = Literal["bpe", "char", "word", "word_bpe"]
WordSplitter = Literal["regex", "spacy"]  # spacy is spaCy's rule-based English tokenizer
WordOOV = Literal["unk", "bpe"]  # words out of the vocabulary become unk or character BPE pieces
SpecialsAt = Literal["start", "end"]  # the special tokens' ids before the words or after them
Normalization = Literal["lower_nopunct", "aggressive", "none"]  # word_bpe's text normalisation
EmbeddingKind = Literal["none", "auto", "vec", "bin", "gensim", "train"]
EmbeddingOOV = Literal["subword", "noise"]  # words without a vector: FastText n-grams or noise
StartPadding = Literal["single", "order"]  # n-grams: one <sos> per document (KenLM) or n-1 of them
BleuSmoothing = Literal["method1", "exp", "none"]  # for BLEU-1..4 (tinylm.evaluation.bleu)
BleuSelection = Literal["random", "first"]  # random: stories drawn with a seed; first: file order


# ----------------------------------------------------------------------------------- sections
@dataclass
class CleanOptions:
    """The cleaning steps (tinylm.data.cleaning), each a flag counted in the prepare report."""

    fix_unicode: bool = True
    normalize_whitespace: bool = True
    lowercase: bool = False
    standardize_punctuation: bool = False
    remove_urls: bool = False
    remove_emails: bool = False
    remove_html: bool = False
    remove_repeats: bool = False  # a word or phrase repeated right after itself is kept once
    letters_and_punctuation_only: bool = False  # drop every character but letters, digits, basic punctuation
    collapse_dots: bool = False  # "..", "...", ". . ." and "…" become one "."
    deduplicate: bool = True
    min_chars: int = option(1, ge=0)
    max_chars: int | None = option(None, ge=1)


@dataclass
class DataConfig(CleanOptions):
    """Where the documents come from and how they are split and batched; the cleaning flags
    (``data.fix_unicode`` etc.) come from CleanOptions, so ``cfg.data`` is what the cleaning
    functions take."""

    # TinyStories is a text file, json shard(s) or a hub id; text is .txt/.jsonl
    source: Literal["shakespeare", "tinystories", "text"] = "shakespeare"
    train: str | None = None  # path (or hub id for tinystories); None for shakespeare
    valid: str | None = None  # optional; when None a split is made from train
    test: str | None = None
    hub_story_limit: int | None = option(None, ge=1)  # TinyStories through `datasets`: stream at most this many
    valid_fraction: float = option(0.05, ge=0, lt=1)
    test_fraction: float = option(0.05, ge=0, lt=1)
    split_by: Literal["document", "chunk"] = "document"  # whole plays/stories, or contiguous chunks
    max_documents: int | None = option(None, ge=1)
    # how token batches are formed: packed (nanoGPT stream) or stories (one padded sequence each)
    batching: Literal["packed", "stories"] = "packed"
    # training split only: this fraction of the stories (a fixed seeded draw) gets its quotes,
    # apostrophes and dashes written as UTF-8-read-as-Windows-1252 mojibake ("â€œ"), as the
    # official TinyStories files carry it (tinylm.data.augment)
    mojibake_fraction: float = option(0.0, ge=0, le=1)

    def validate(self) -> None:
        if self.valid_fraction + self.test_fraction >= 1:
            raise TinyLMError("data.valid_fraction and data.test_fraction must be >= 0 and sum to less than 1")
        if self.source == "text" and not self.train:
            raise TinyLMError("data.source=text needs data.train=PATH (a .txt or .jsonl file)")


@dataclass
class TokenizerConfig:
    type: TokenizerType = "bpe"
    vocab_size: int = option(1024, ge=0)
    merges: int | None = option(None, ge=0)  # word_bpe: number of merges (None: as many as make vocab_size)
    normalization: Normalization = "lower_nopunct"  # word_bpe
    lowercase: bool = False  # word-level only
    path: str | None = None  # reuse a saved tokenizer instead of training one
    # word-level: keep only words seen this often (with the vocab_size cap; 0 = no cap)
    min_count: int = option(1, ge=0)
    keep_punctuation: bool = True  # word-level: punctuation marks are tokens (else dropped)
    splitter: WordSplitter = "regex"  # word-level
    # word-level: the order of the special tokens, and whether they come before the words or after them
    special_tokens: list[str] = option(factory=lambda: ["<pad>", "<unk>", "<sos>", "<eos>"])
    specials_at: SpecialsAt = "start"
    oov: WordOOV = "unk"  # word-level
    oov_merges: int = option(1000, ge=0)  # word-level with oov=bpe: merges of the pieces' BPE
    pattern: str = "gpt2"  # bpe pre-tokenisation split: gpt2 | gpt4 | a custom regex


@dataclass
class ModelConfig:
    vocab_size: int = option(0, ge=0)  # 0: taken from the tokenizer
    context_length: int = option(128, ge=1)
    d_model: int = option(128, ge=1)
    n_layers: int = option(4, ge=1)
    n_heads: int = option(4, ge=1)
    d_attn: int | None = option(None, ge=1)  # attention width; None means d_model (300 with 8 heads needs 304)
    n_kv_heads: int | None = option(None, ge=1)  # grouped-query attention; None means n_heads
    d_ff: int | None = option(None, ge=1)  # None means 4 * d_model
    dropout: float = option(0.0, ge=0, lt=1)  # on the embeddings and on each block's residual branches
    # on the attention weights; None means `dropout`. On CPU any attention dropout takes SDPA off its
    # fused kernel (the T x T weights are materialised and masked), so 0 here trains much faster.
    attn_dropout: float | None = option(None, ge=0, lt=1)
    positions: Literal["learned", "sinusoidal", "rope", "none"] = "learned"
    rope_theta: float = option(10000.0, gt=0)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = option(1e-5, gt=0)
    ffn: Literal["gelu", "relu", "relu2", "swiglu"] = "gelu"  # gelu is GPT-2's tanh approximation; relu2 relu(x)^2
    init: Literal["gpt2", "xavier"] = "gpt2"  # gpt2: N(0, 0.02), residual projections scaled; xavier: uniform
    bias: bool = True
    tie_weights: bool = True
    d_embed: int | None = option(None, ge=1)  # token embedding width; None = d_model, else a learned projection
    attention: Literal["manual", "sdpa"] = "sdpa"  # manual: matmul, mask, softmax; sdpa: F.scaled_dot_product_attention
    qk_norm: bool = False  # RMS-normalise each head's queries and keys (no gain) before the rotary positions
    # with qk_norm: a learned gain over the head dimension, one for queries and one for keys, and
    # norm_eps as epsilon (Qwen3's q_norm and k_norm, so the model travels as a Qwen3 checkpoint)
    qk_norm_weight: bool = False
    logit_softcap: float | None = option(None, gt=0)  # logits -> cap * tanh(logits / cap); None: off
    zero_init_out: bool = False  # residual output projections (attention out, FFN down) start at zero
    # a per-layer token table added to the attention's values (nanochat, modded-nanogpt): on every
    # other layer counting back from the last ("alternate") or on every layer ("all")
    value_embeddings: Literal["none", "alternate", "all"] = "none"

    def has_value_embedding(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) adds a value-embedding table to its values; with
        "alternate" the last layer always has one."""
        if self.value_embeddings == "alternate":
            return (self.n_layers - 1 - layer) % 2 == 0
        return self.value_embeddings == "all"

    def validate(self) -> None:
        """The shapes fit together (the vocabulary may still come from the tokenizer)."""
        dataclasses.replace(self, vocab_size=self.vocab_size or 1).resolved()

    def resolved(self) -> "ModelConfig":
        """Fill the derived widths and check that the shapes fit together."""
        cfg = dataclasses.replace(self)
        derived = {
            "d_attn": cfg.d_model,
            "n_kv_heads": cfg.n_heads,
            "d_ff": 4 * cfg.d_model,
            "d_embed": cfg.d_model,
            "attn_dropout": cfg.dropout,
        }  # the value of each width or rate left at None
        for name, value in derived.items():
            if getattr(cfg, name) is None:
                setattr(cfg, name, value)
        if cfg.d_embed != cfg.d_model and cfg.tie_weights:
            raise TinyLMError(
                f"model.tie_weights=true needs the embedding width (d_embed={cfg.d_embed}) to equal "
                f"d_model={cfg.d_model}; set model.tie_weights=false (the embedding then goes through "
                f"a learned projection) or model.d_embed={cfg.d_model}"
            )
        check_fields(cfg, "model.")  # a config built in code is checked like a loaded one
        if cfg.vocab_size < 1:
            raise TinyLMError(f"model.vocab_size must be at least 1 (got {cfg.vocab_size})")
        if cfg.d_attn % cfg.n_heads:
            multiple = -(-cfg.d_attn // cfg.n_heads) * cfg.n_heads
            raise TinyLMError(
                f"model.n_heads={cfg.n_heads} does not divide the attention width {cfg.d_attn}; set "
                f"model.d_attn to a multiple of {cfg.n_heads} (e.g. {multiple})"
            )
        if cfg.n_heads % cfg.n_kv_heads:
            raise TinyLMError(f"model.n_kv_heads={cfg.n_kv_heads} must divide model.n_heads={cfg.n_heads}")
        if cfg.qk_norm_weight and not cfg.qk_norm:
            raise TinyLMError("model.qk_norm_weight=true is a gain on QK-norm: set model.qk_norm=true too")
        if cfg.positions == "rope" and (cfg.d_attn // cfg.n_heads) % 2:
            raise TinyLMError("rotary positions need an even head width (d_attn / n_heads)")
        return cfg


@dataclass
class TrainConfig:
    batch_size: int = option(16, ge=1)  # sequences per micro-batch (per process)
    # sequences per optimizer step over all processes and micro-steps; when set, batch_size is
    # derived as global_batch_size / (world size * grad_accum_steps), which must divide evenly
    global_batch_size: int | None = option(None, ge=1)
    grad_accum_steps: int = option(1, ge=1)
    max_steps: int = option(1000, ge=0)
    # passes over the training split instead of max_steps: every story (packed: every context
    # window) once per epoch in a seeded order; one row per epoch in epochs.csv
    epochs: int | None = option(None, ge=1)
    max_minutes: float | None = option(None, ge=0)  # wall-clock budget, checked every step
    # a budget of training tokens instead of max_steps (comparable across machines, unlike
    # max_minutes): the step count becomes ceil(max_tokens / tokens per step), which the schedule follows
    max_tokens: int | None = option(None, ge=1)
    lr: float = option(1e-3, ge=0)
    min_lr: float = option(1e-4, ge=0)
    warmup_steps: int = option(100, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # the decay after warmup
    # what the decay after warmup follows: "steps" (progress = step / max_steps) or "wall" (progress =
    # elapsed / max_minutes, so a wall-clock budget ends at min_lr on any machine; needs max_minutes)
    schedule_clock: Literal["steps", "wall"] = "steps"
    weight_decay: float = option(0.1, ge=0)
    # adamw, or muon: Muon (torch.optim.Muon) for the blocks' weight matrices, AdamW for the rest
    # (embeddings, output head, norm gains, biases) at train.lr
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = option(0.02, gt=0)  # Muon's peak learning rate; the schedule scales it like train.lr
    muon_momentum: float = option(0.95, ge=0, lt=1)
    # exponential moving average of the weights (0: off): updated every step, evaluated at the end
    # and saved as checkpoints/ema; decay d averages over about 1 / (1 - d) steps
    ema_decay: float = option(0.0, ge=0, lt=1)
    beta1: float = option(0.9, ge=0, lt=1)
    beta2: float = option(0.95, ge=0, lt=1)
    grad_clip: float = option(1.0, ge=0)  # 0 disables clipping
    # training targets mixed with the uniform distribution (F.cross_entropy's label_smoothing);
    # validation losses and perplexities are always the plain NLL
    label_smoothing: float = option(0.0, ge=0, lt=1)
    # packed windows: each token attends only to the earlier tokens of its own story, never across
    # an <eos> <sos> boundary (training and validation losses; scoring and decoding see one story)
    document_attention: bool = False
    eval_interval: int = option(100, ge=1)
    eval_batches: int = option(20, ge=0)  # 0: the whole validation split
    log_interval: int = option(10, ge=1)
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # torch.compile forward, loss and backward (each block alone under grad_checkpointing with the
    # tinylm implementation) and use AdamW's fused kernel
    compile: bool = False
    grad_checkpointing: bool = False
    checkpoint_impl: Literal["tinylm", "torch"] = "tinylm"  # our autograd.Function, or torch's as the reference
    # a checkpoint directory whose weights start the run (continued training, fine-tuning): the
    # optimizer, the step count and the schedule start fresh, unlike --resume
    init_from: str | None = None
    keep_last: int = option(2, ge=0)  # resumable step-N checkpoints kept (plus best and last)
    save_interval: int = option(0, ge=0)  # steps between resumable checkpoints; 0: at every evaluation
    early_stopping_patience: int = option(0, ge=0)  # evaluations without improvement; 0 disables
    tensorboard: bool = False
    threads: int | None = option(None, ge=1)  # torch.set_num_threads; None leaves torch's default
    progress: bool = True  # a bar when stderr is a terminal, else a line every log_interval steps

    def validate(self) -> None:
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise TinyLMError(f"train.device={self.device!r} is not one of auto, cpu, cuda, cuda:N, mps")
        if self.epochs and self.max_tokens:
            raise ConfigError("max_tokens", "max_tokens and train.epochs both set the step count: give one of them")
        if self.schedule_clock == "wall" and not self.max_minutes:
            raise TinyLMError("train.schedule_clock=wall needs a wall budget: set train.max_minutes")


# The smallest temperature and repetition penalty accepted: logits divided by less overflow to
# inf (softmax then gives nan), and any value this small is greedy in all but name.
MIN_SCALE = 1e-6


@dataclass
class GenerationConfig:
    """Every decoding knob, declared once: `tinylm generate`'s options, the HTTP request's fields
    and the run config's sample section are made from these fields (see GENERATION_SURFACES)."""

    max_new_tokens: int = option(100, "new tokens at most", ge=0)
    min_new_tokens: int = option(0, "stop tokens are banned until this many were generated", ge=0)
    temperature: float = option(1.0, "0 for greedy", ge=0)
    top_k: int | None = option(None, "keep the k most likely tokens (ties at the k-th value: lower ids win)", ge=1)
    top_p: float | None = option(None, "keep the smallest set of tokens whose probability reaches p", gt=0, le=1)
    min_p: float | None = option(None, "drop tokens less likely than min_p x the most likely one", ge=0, le=1)
    repetition_penalty: float = option(1.0, "divide the logits of seen tokens (CTRL / Hugging Face)", ge=MIN_SCALE)
    no_repeat_ngram_size: int = option(0, "ban tokens that would repeat an n-gram (0: off)", ge=0)
    stop_ids: tuple[int, ...] = option((), "a row ends at any of these token ids (not included in the output)", ge=0)
    stop_strings: tuple[str, ...] = option((), "a row ends when its continuation contains one of these")
    seed: int | None = option(None, "sampling seed (prompt or choice i of a batch draws with seed + i)")
    # False: one generator for the whole batch (draws match HF's batched sampling); True: row i
    # samples from its own stream seeded seed + i, so a batch reproduces single-prompt runs
    seed_per_row: bool = option(False, "row i of a batch samples with seed + i")
    use_cache: bool = option(
        True, "reuse the attention keys and values of earlier tokens (off: recompute the whole context every step)"
    )
    beam_width: int = option(1, "beam search with this many beams (1: sampling or greedy)", ge=1)
    # lengths ** huge exponents overflow to 0 or inf
    length_penalty: float = option(1.0, "beam score = sum log p / length ** penalty (0: none)", ge=-10, le=10)
    num_return_sequences: int = option(1, "beam search: the best hypotheses returned per prompt", ge=1)
    early_stopping: bool = option(False, "beam search: stop once beam_width hypotheses finished (HF's)")
    compile: bool = option(False, "run the decoding step under torch.compile (once per batch shape and process)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> "GenerationConfig":
        """Raise TinyLMError naming the first knob whose value is invalid."""
        check_fields(self)
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(
                "min_new_tokens", f"min_new_tokens must be between 0 and max_new_tokens (got {self.min_new_tokens})"
            )
        if not (self.temperature == 0 or MIN_SCALE <= self.temperature):
            raise ConfigError(
                "temperature",
                f"temperature must be 0 (greedy) or a finite number >= {MIN_SCALE:g} (got {self.temperature!r})",
            )
        if self.num_return_sequences > self.beam_width:
            raise ConfigError(
                "num_return_sequences",
                f"num_return_sequences must be between 1 and beam_width "
                f"({self.beam_width}) (got {self.num_return_sequences})",
            )
        if vocab_size is not None:
            check_range("beam_width", self.beam_width, (1, None, vocab_size, None))
            check_range("stop_ids", self.stop_ids, (0, None, None, vocab_size))
        if any(not s for s in self.stop_strings):
            raise ConfigError(
                "stop_strings", f"stop_strings must be non-empty strings (got {list(self.stop_strings)!r})"
            )
        return self


# Where each decoding knob is reachable besides the sample section: (the command line's flag,
# the HTTP request's field); None where a surface does not offer it, for the reason beside it.
GENERATION_SURFACES: dict[str, tuple[str | None, str | None]] = {
    "max_new_tokens": ("--max-new-tokens", "max_tokens"),  # OpenAI's name
    "min_new_tokens": ("--min-new-tokens", "min_new_tokens"),
    "stop_strings": ("--stop", "stop"),  # OpenAI's name
    "stop_ids": ("--stop-id", "stop_ids"),  # beside the tokenizer's own end-of-text ids
    "num_return_sequences": ("--num-return-sequences", "n"),  # OpenAI's name: choices per prompt
    "use_cache": ("--no-cache", None),  # the server's batched scheduler always decodes with the cache
    "seed_per_row": (None, None),  # always on in both: prompt (choice) i samples with seed + i
    "compile": ("--compile", None),  # one compiled step serves every request; not a per-request choice
}


def knob_names(surface: Literal["cli", "http"]) -> dict[str, str]:
    """Each GenerationConfig knob a surface offers -> its name there (the flag, or the request's field)."""
    side = 0 if surface == "cli" else 1
    names = {
        f.name: GENERATION_SURFACES.get(f.name, ("--" + f.name.replace("_", "-"), f.name))[side]
        for f in dataclasses.fields(GenerationConfig)
    }
    return {knob: name for knob, name in names.items() if name is not None}


@dataclass
class SampleConfig(GenerationConfig):
    """The run's sample continuations: prompt i continued with seed ``seed + i``."""

    prompts: list[str] = option(["ROMEO:"], "prompts continued after training")
    # the prompts continued at every evaluation too (RUN/eval_samples.jsonl; `tinylm serve --runs`
    # shows them): a few seconds per evaluation, counted in the run's time
    every_eval: bool = True
    temperature: float = like(GenerationConfig, "temperature", 0.8)
    top_k: int | None = like(GenerationConfig, "top_k", 50)
    seed: int | None = like(GenerationConfig, "seed", 0)

    def generation(self, stop_ids=()) -> GenerationConfig:
        knobs = {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationConfig)}
        return GenerationConfig(**{**knobs, "stop_ids": tuple(self.stop_ids) + tuple(stop_ids)})


@dataclass
class EmbeddingsConfig:
    """Pretrained / FastText-trained token embeddings (see tinylm/models/embeddings.py)."""

    # gensim: a saved gensim model; train: gensim FastText on the train split; auto: by the file's suffix
    kind: EmbeddingKind = "none"
    path: str | None = None  # the .vec / .bin / gensim file (not for none/train)
    freeze: bool = False  # no gradient into the embedding matrix
    oov: EmbeddingOOV = "subword"  # FastText n-grams only when the vectors bring them
    noise_std: float | None = option(None, ge=0)  # None: the std of the vectors found
    seed: int = 0
    train_epochs: int = option(5, ge=1)  # kind=train only
    train_window: int = option(5, ge=1)
    train_min_count: int = option(1, ge=1)

    def validate(self) -> None:
        if self.kind in ("none", "train") and self.path:
            raise TinyLMError(
                f"embeddings.kind={self.kind!r} does not read a file; choose one of auto, vec, bin, gensim"
            )
        if self.kind in ("auto", "vec", "bin", "gensim") and not self.path:
            raise TinyLMError(f"embeddings.kind={self.kind} needs embeddings.path")


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)

    def validate(self) -> None:
        if self.embeddings.freeze and self.model.tie_weights and self.embeddings.kind != "none":
            raise TinyLMError(
                "embeddings.freeze=true with model.tie_weights=true would freeze the output layer too; "
                "set model.tie_weights=false"
            )
        if self.train.document_attention and self.data.batching != "packed":
            raise TinyLMError(
                "train.document_attention=true is for data.batching=packed: with stories batching each "
                "row already holds one story"
            )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples as lists, as YAML and JSON read back

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# ------------------------------------------------------------------------------ reading values
def config_value(key: str, value: Any, annotation: Any) -> Any:
    """Check (and for strings from the command line, convert) a value against a field type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        raise ConfigError(key, f"{key}={value!r} is not one of {', '.join(map(str, args))}")
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return config_value(key, value, arg)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if errors else ConfigError(key, f"{key}: bad value {value!r}")
    if origin in (list, tuple):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [value]
            except RecursionError:
                raise ConfigError(key, f"{key}: the list {value[:20]}... is nested too deeply") from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"{key} expects a list, got {value!r}")
        return origin(config_value(key, v, args[0]) for v in value) if args else origin(value)
    if annotation in _EXPECTS:
        result = _scalar(annotation, value)
        if result is None:
            raise ConfigError(key, f"{key} expects {_EXPECTS[annotation]}, got {value!r}")
        if annotation is float and not math.isfinite(result):
            raise ConfigError(key, f"{key} must be a finite number, got {value!r}")
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
        return (
            annotation(value.replace("_", "") if isinstance(value, str) else value)
            if isinstance(value, (str, int, float))
            else None
        )
    except (ValueError, OverflowError):  # OverflowError: an int too large for a float
        return None


def apply_updates(obj: Any, updates: dict[str, Any], prefix: str = "") -> None:
    """Set a (nested) dict of values on a config dataclass, checking every key and type."""
    hints = field_types(type(obj))
    for key, value in updates.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in hints:
            close = [n for n in hints if isinstance(key, str) and key and n.startswith(key[:3])]
            hint = f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""
            raise TinyLMError(f"unknown config key {full}{hint}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise TinyLMError(f"config key {full} is a section; give keys like {full}.name=value")
            apply_updates(current, value, prefix=f"{full}.")
        else:  # ranges and the rules between fields are check_config's, once every value is set
            setattr(obj, key, config_value(full, value, hints[key]))


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
    """The mapping in a YAML/TOML file, or in the preset of that name (``tinystories-cpu-1h``), over
    the one its ``extends:`` names."""
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
    parent = data.pop("extends", None)  # a preset or file this one changes, section by section
    if parent is not None:
        if not isinstance(parent, str) or Path(parent).name == p.name.removesuffix(".yaml"):
            raise TinyLMError(f"config file {p}: extends must name another preset or file (got {parent!r})")
        data = merge_dicts(load_config_file(parent), data)
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


def build_config(path: str | Path | None = None, overrides: list[str] | None = None, quick: bool = False) -> RunConfig:
    """Defaults <- the file (or preset) at ``path`` (its quick section too with ``quick``) <-
    command-line ``overrides``."""
    cfg = RunConfig()
    apply_updates(cfg, read_config(path, quick))
    if overrides:
        apply_updates(cfg, parse_overrides(overrides))
    return check_config(cfg)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    apply_updates(cfg, data)
    return check_config(cfg)


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
