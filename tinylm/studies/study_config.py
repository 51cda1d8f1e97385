"""The settings of `tinylm study shakespeare`: StudyConfig, a section per stage, checked at load.

YAML reads ``bigram: {lrs: [1e-3], max_steps: 3000}``, the command line ``bigram.max_steps=100``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tinylm.config import (
    DataConfig,
    Normalization,
    StartPadding,
    apply_updates,
    check_config,
    option,
    parse_overrides,
    read_config,
)
from tinylm.errors import TinyLMError


@dataclass
class StudyTokenizers:
    """Task 1. bpe: byte-level; word_bpe: the report's (characters of words, an end-of-word token)."""

    bpe_type: Literal["bpe", "word_bpe"] = "bpe"
    bpe_merges: list[int] = option([1000, 2000, 3000], ge=1)
    # word_bpe: one tokenizer per normalisation and merge count; the models use the first
    normalizations: list[Normalization] = option(["lower_nopunct"])
    model_merges: list[int] | None = None  # merge counts that go on to stages 2-4 (None: all)
    char: bool = True
    word: bool = True
    word_vocab: int = option(8000, "words beyond the most frequent become <unk>", ge=1)
    overlap_sample: int = option(100, "lines sampled per split pair for the verbatim overlap check", ge=0)

    def validate(self) -> None:
        if self.model_merges is not None and set(self.model_merges) - set(self.bpe_merges):
            raise TinyLMError(f"model_merges {self.model_merges} must be among bpe_merges {self.bpe_merges}")
        if self.bpe_type == "word_bpe" and not self.normalizations:
            raise TinyLMError("normalizations: word_bpe needs at least one (lower_nopunct, aggressive, none)")
        if not (self.bpe_merges or self.char or self.word):
            raise TinyLMError("bpe_merges is empty and char and word are off: the study has no tokenizer")


@dataclass
class StudyNGram:
    """Task 2. start_padding: one <sos> (KenLM) or n-1 of them (the report)."""

    orders: list[int] = option([1, 2, 3, 4], ge=1)
    smoothings: list[Literal["laplace", "add_0.1", "interpolated", "interpolated_fixed", "kneser_ney"]] = option(
        ["laplace", "add_0.1", "interpolated", "kneser_ney"]
    )
    start_padding: StartPadding = "single"
    fixed_weights: list[float] = option([0.01, 0.1, 0.2, 0.3, 0.4], "uniform, 1-gram, 2-gram, ...", ge=0)

    def validate(self) -> None:
        needed = max(self.orders, default=0) + 1
        if "interpolated_fixed" in self.smoothings and len(self.fixed_weights) < needed:
            raise TinyLMError(f"fixed_weights needs {needed} weights (uniform, unigram, ...) for order {needed - 1}")


@dataclass
class StudyBigram:
    """Task 3: a learning-rate sweep (at lr_d_embed, no decay), then d_embeds x weight_decays at grid_lr."""

    lrs: list[float] = option([], gt=0)
    lr_d_embed: int = option(64, ge=1)
    d_embeds: list[int] = option([32, 128], ge=1)
    weight_decays: list[float] = option([0.0, 0.1], ge=0)
    grid_lr: float = option(1e-2, gt=0)
    batch_size: int = option(2048, ge=1)
    mode: Literal["auto", "counts", "pairs"] = "auto"  # counts: full-batch pair counts; pairs: minibatches
    schedule: Literal["cosine", "constant"] = "cosine"  # cosine: warmup, decay to lr/10
    # adamw: decoupled decay (weights shrink by lr x weight_decay per step, tiny at the report's 1e-5 and
    # 1e-4); adam_l2: the report's Adam with weight_decay x w added to the gradient
    optimizer: Literal["adamw", "adam_l2"] = "adamw"
    max_steps: int = option(3000, ge=1)
    max_seconds: float = option(60.0, "safety cap per run: a run stopped by it is marked not converged", gt=0)
    eval_interval: int | None = option(None, "None: max_steps / 30", ge=1)
    patience: int = option(4, "evaluations without improvement (0: no early stopping)", ge=0)
    sweep_on: Literal["first", "all"] = "first"  # first: its best setting for the other tokenizers

    def validate(self) -> None:
        if not self.lrs and not (self.d_embeds and self.weight_decays):
            raise TinyLMError("lrs is empty and so is d_embeds x weight_decays: the bigram stage has no run")


def parse_size(spec: str) -> tuple[str, int, int, int]:
    """``"small=6x256x8"`` -> ("small", layers, d_model, heads)."""
    try:
        name, dims = spec.split("=")
        layers, d_model, heads = (int(v) for v in dims.lower().split("x"))
    except ValueError:
        raise TinyLMError(
            f"sizes: {spec!r} is not of the form name=LAYERSxD_MODELxHEADS (e.g. small=6x256x8)"
        ) from None
    if min(layers, d_model, heads) < 1 or d_model % heads:
        raise TinyLMError(f"sizes: {spec!r}: layers, d_model and heads must be >= 1, d_model a multiple of heads")
    return name, layers, d_model, heads


@dataclass
class StudyGPT:
    """Task 4: GPTs of each size (name=LAYERSxD_MODELxHEADS) on the first data_fraction of each split."""

    enabled: bool = True
    sizes: list[str] = option(["base=4x192x6"])
    tokenizers: list[str] | None = None  # tokenizer names that get GPTs (None: every modelled one)
    data_fraction: float = option(1.0, gt=0, le=1)
    context_length: int = option(128, ge=1)
    dropout: float = option(0.1, ge=0, lt=1)
    batch_size: int = option(32, ge=1)
    max_steps: int = option(3000, "a cap; the cosine ends here or at the wall-clock cap, whichever comes first", ge=1)
    patience: int = option(
        4, "evaluations without improvement before stopping (0: none); the best checkpoint is scored", ge=0
    )
    minutes: float = option(
        30.0,
        "wall-clock cap per GPT (0: none); the cosine follows it, and a GPT it stops is marked not converged",
        ge=0,
    )
    lr: float = option(2e-3, gt=0)
    eval_interval: int = option(50, ge=1)
    eval_batches: int = option(20, ge=1)
    # each GPT's run config <- these (e.g. "model.positions=rope", "train.optimizer=muon"): the training
    # recipe's options, checked like the command line's
    run_overrides: list[str] = option([])

    def validate(self) -> None:
        for size in self.sizes:
            parse_size(size)
        for item in self.run_overrides:
            if not item.startswith(("model.", "train.")) or "=" not in item:
                raise TinyLMError(f"gpt.run_overrides: {item!r} is not model.KEY=VALUE or train.KEY=VALUE")


@dataclass
class StudySampling:
    prompts: list[str] = option(["ROMEO:", "To be, or not to be", "KING HENRY.\nOnce more"])
    max_new_tokens: int = option(60, ge=1)
    temperature: float = option(0.8, ge=0)


@dataclass
class TokenizerSpec:
    name: str
    kind: str
    vocab_size: int = 0
    merges: int | None = None
    normalization: str = "lower_nopunct"
    modelled: bool = True  # goes on to stages 2-4


@dataclass
class StudyConfig:
    out_dir: str = "runs/study-shakespeare"
    # the run config's data section; the study splits each play into chunks
    data: DataConfig = field(
        default_factory=lambda: DataConfig(valid_fraction=0.1, test_fraction=0.1, split_by="chunk")
    )
    tokenizers: StudyTokenizers = field(default_factory=StudyTokenizers)
    ngram: StudyNGram = field(default_factory=StudyNGram)
    bigram: StudyBigram = field(default_factory=StudyBigram)
    gpt: StudyGPT = field(default_factory=StudyGPT)
    sampling: StudySampling = field(default_factory=StudySampling)
    threads: int = option(1, "torch threads; 1 is the fastest on a CPU shared with other jobs", ge=1)
    seed: int = 1337
    compare_with: str | None = None  # another study's directory, for the summary's "tinylm best" column

    def validate(self) -> None:
        modelled = {s.name for s in tokenizer_specs(self) if s.modelled}
        unknown = set(self.gpt.tokenizers or []) - modelled
        if self.gpt.enabled and unknown:
            raise TinyLMError(f"gpt.tokenizers {sorted(unknown)} are not modelled tokenizers of this study")


def tokenizer_specs(cfg: StudyConfig) -> list[TokenizerSpec]:
    """Every tokenizer of the study, the modelled ones first."""
    t = cfg.tokenizers
    modelled = t.bpe_merges if t.model_merges is None else t.model_merges
    if t.bpe_type == "bpe":
        specs = [TokenizerSpec(f"bpe-{m}", "bpe", 260 + m, modelled=m in modelled) for m in t.bpe_merges]
    else:
        specs = [
            TokenizerSpec(
                f"word_bpe-{m}" + ("" if i == 0 else f"-{norm}"),
                "word_bpe",
                merges=m,
                normalization=norm,
                modelled=i == 0 and m in modelled,
            )
            for i, norm in enumerate(t.normalizations)
            for m in t.bpe_merges
        ]
    specs += [TokenizerSpec("char", "char")] if t.char else []
    specs += [TokenizerSpec("word", "word", t.word_vocab)] if t.word else []
    return sorted(specs, key=lambda s: not s.modelled)


def study_config(*layers: dict) -> StudyConfig:
    """StudyConfig defaults <- each mapping in turn (a preset's, the command line's), checked whole."""
    cfg = StudyConfig()
    for raw in layers:
        apply_updates(cfg, raw)
    return check_config(cfg)


def load_study_config(
    spec: str | None = "shakespeare-study", overrides: list[str] | None = None, quick: bool = False
) -> StudyConfig:
    """The file or preset (its quick section too with ``quick``) <- ``key=value`` overrides."""
    return study_config(read_config(spec, quick), parse_overrides(overrides or []))
