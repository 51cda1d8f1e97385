"""Shared fixtures: a small corpus written by the tests, tiny configs, seeded torch."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tinylm.config import ModelConfig, RunConfig

STORIES = [
    "Once upon a time there was a little cat. The cat liked to play in the sun.",
    "Tom had a red ball. He threw the ball to his dog, and the dog ran fast.",
    "Lily saw a big tree. She wanted to climb it, but her mom said no.",
    "The sun was shining and the birds were singing. Ben went to the park.",
    "One day, a little boy found a box. Inside the box was a shiny key.",
    "The dog and the cat were friends. They shared their food every day.",
]


def make_stories(n: int = 60, seed: int = 0) -> list[str]:
    """Deterministic story-like documents, all different."""
    rng = random.Random(seed)
    return [f"{rng.choice(STORIES)} {rng.choice(STORIES)} Story number {i}." for i in range(n)]


SLOW_MODULE = re.compile(r"^pytestmark = \[?pytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """Under `-m "not slow"` (make test-fast) a module marked slow as a whole is not even imported,
    so the fast tier does not pay for the libraries only it needs (transformers: several seconds)."""
    if (
        FAST_TIER
        and collection_path.suffix == ".py"
        and SLOW_MODULE.search(collection_path.read_text(encoding="utf-8"))
    ):
        return True
    return None


FAST_TIER = False  # set by pytest_configure under -m "not slow", before any test module is imported


def pytest_configure(config):
    global FAST_TIER
    FAST_TIER = (config.option.markexpr or "").split() == ["not", "slow"]


def examples(n: int) -> int:
    """Hypothesis max_examples: n in the full suite, a quarter (at least 10) in the fast tier."""
    return max(10, n // 4) if FAST_TIER else n


def slow_except(fast, values):
    """Parametrize over values with all but `fast` marked slow: the fast tier runs one representative."""
    return [v if v == fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


@pytest.fixture(autouse=True, scope="session")
def _one_thread_everywhere():
    """Like one_thread, for every test: the tests' models are tiny, and on a shared 2-core machine a
    second torch thread mostly waits (a tiny forward/backward measured 50x slower with 2 threads than
    with 1 while another process held a core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    # the CPU generator: torch.manual_seed also queues lazy CUDA/XPU/MTIA seeds, each with a formatted
    # stack trace (~1.5 ms a call under pytest's deep stack, before every test)
    torch.default_generator.manual_seed(0)
    random.seed(0)


@pytest.fixture
def one_thread():
    """Token-by-token decoding is many small ops; on a shared 2-core machine one thread is both
    faster and steadier (decoding tests opt in with pytestmark)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def stories_file(tmp_path):
    """A TinyStories-format text file (stories separated by <|endoftext|> lines)."""
    path = tmp_path / "stories.txt"
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories()), encoding="utf-8")
    return path


@pytest.fixture
def tiny_model_config():
    return ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4)


def tiny_run_config(out_dir, train_file, **train_overrides) -> RunConfig:
    cfg = RunConfig(out_dir=str(out_dir))
    cfg.data.source = "tinystories"
    cfg.data.train = str(train_file)
    cfg.data.valid_fraction = 0.2
    cfg.data.test_fraction = 0.1
    cfg.tokenizer.type = "bpe"
    cfg.tokenizer.vocab_size = 300
    cfg.model = ModelConfig(context_length=32, d_model=32, n_layers=2, n_heads=4)
    cfg.train.batch_size = 4
    cfg.train.max_steps = 10
    cfg.train.warmup_steps = 2
    cfg.train.eval_interval = 5
    cfg.train.eval_batches = 2
    cfg.train.progress = False
    for k, v in train_overrides.items():
        setattr(cfg.train, k, v)
    return cfg


def prepared_stories_run(root, **train_overrides):
    """(config, PreparedData) for a tiny run on ``make_stories()`` written under ``root``: the shared
    start of the trainer tests' module-scoped fixtures."""
    from tinylm.data.prepare import prepare

    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories()), encoding="utf-8")
    cfg = tiny_run_config(root / "prep", data, **train_overrides)
    return cfg, prepare(cfg, root / "prep")


def with_overrides(base: RunConfig, model: dict | None = None, **train) -> RunConfig:
    """A deep copy of ``base`` with these train (and model) fields set."""
    import copy

    cfg = copy.deepcopy(base)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    for k, v in (model or {}).items():
        setattr(cfg.model, k, v)
    return cfg
