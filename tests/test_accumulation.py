"""Gradient accumulation: N micro-batches give the update of one batch N times larger, also when
the micro-batches hold different numbers of real (non-padding) tokens."""

import dataclasses
import random

import pytest
import torch
from conftest import tiny_run_config

from tinylm.config import ModelConfig, check_config
from tinylm.constants import IGNORE_INDEX
from tinylm.data.prepare import prepare
from tinylm.data.tokens import Batches, encode_split
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT
from tinylm.tokenizers import new_tokenizer
from tinylm.training.distributed import DistContext
from tinylm.training.optim import make_optimizer
from tinylm.training.trainer import accumulate_gradients, micro_batches, per_rank_batch_size, train


@pytest.fixture(scope="module")
def short_docs_split(tmp_path_factory):
    """Documents of 3..30 characters with a context of 32: every row is padded differently."""
    rng = random.Random(0)
    words = "the cat sat on a mat and ran to see big red ball".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(80)]
    tok = new_tokenizer("char").train(docs, 64)
    return encode_split("train", docs, tok, tmp_path_factory.mktemp("split")), tok.vocab_size


def _one_step(model, micro, train_cfg):
    opt = make_optimizer(model, train_cfg)
    loss, n = accumulate_gradients(model, micro, torch.device("cpu"))
    torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
    opt.step()
    return loss, n


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_step_equals_big_batch_float64(short_docs_split, accum):
    split, vocab = short_docs_split
    cfg = tiny_run_config("unused", "unused").train
    cfg.lr, cfg.grad_clip = 1e-2, 1.0
    batches = Batches(split, 32, "stories", seed=3)
    torch.manual_seed(0)
    base = GPT(ModelConfig(vocab_size=vocab, context_length=32, d_model=32, n_layers=2, n_heads=4)).double()
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    big_model, acc_model = base, GPT(base.config).double()
    acc_model.load_state_dict(initial)
    B = 8 // accum
    big = micro_batches(batches, step=0, batch_size=8, accum=1, dist=DistContext())
    micro = micro_batches(batches, step=0, batch_size=B, accum=accum, dist=DistContext())
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in micro]
    assert len(set(counts)) > 1, "micro-batches should hold different numbers of real tokens"
    loss_big, n_big = _one_step(big_model, big, cfg)
    loss_acc, n_acc = _one_step(acc_model, micro, cfg)
    assert n_big == n_acc == sum(counts)
    assert loss_acc == pytest.approx(loss_big, abs=1e-12)
    for (name, p), q in zip(big_model.named_parameters(), acc_model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=name)
    # the step really moved the weights (by ~lr), far more than the 1e-6 tolerance
    assert (big_model.state_dict()["tok_emb.weight"] - initial["tok_emb.weight"]).abs().max() > 1e-3


def test_averaging_per_micro_batch_would_be_wrong(short_docs_split):
    """The naive mean of micro-batch means differs from the big batch when token counts differ."""
    split, vocab = short_docs_split
    batches = Batches(split, 32, "stories", seed=3)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=vocab, context_length=32, d_model=32, n_layers=2, n_heads=4)).double()
    micro = micro_batches(batches, 0, 2, 4, DistContext())
    accumulate_gradients(model, micro, torch.device("cpu"))
    right = model.tok_emb.weight.grad.clone()
    model.zero_grad()
    for x, y in micro:
        _, loss = model(x, y)
        (loss / len(micro)).backward()
    assert (model.tok_emb.weight.grad - right).abs().max() > 1e-6


@pytest.mark.slow  # two training runs; the step-level equality above is the fast check
def test_trainer_with_accumulation_matches_big_batch(tmp_path, stories_file):
    """End to end through train(): 1 step of 2 x 4 equals 1 step of 8 x 1 (float32)."""
    cfg = tiny_run_config(tmp_path / "prep", stories_file, max_steps=1, eval_interval=1, threads=1)
    cfg.data.batching = "stories"
    prepared = prepare(cfg, tmp_path / "prep")
    states = []
    for batch, accum in ((8, 1), (2, 4)):
        run_train = dataclasses.replace(cfg.train, batch_size=batch, grad_accum_steps=accum)
        run_cfg = dataclasses.replace(cfg, train=run_train)
        train(run_cfg, prepared, tmp_path / f"run{accum}")
        from safetensors.torch import load_file

        states.append(load_file(str(tmp_path / f"run{accum}" / "checkpoints/last/model.safetensors")))
    initial = GPT(dataclasses.replace(cfg.model, vocab_size=prepared.tokenizer.vocab_size))
    for name in states[0]:
        torch.testing.assert_close(states[1][name], states[0][name], rtol=0, atol=1e-5, msg=name)
    assert not torch.equal(states[0]["blocks.0.attn.qkv.weight"], initial.state_dict()["blocks.0.attn.qkv.weight"])


def test_bad_accumulation_and_batch_inputs(tmp_path, stories_file):
    cfg = tiny_run_config(tmp_path, stories_file)
    cfg.train.grad_accum_steps = 0
    with pytest.raises(TinyLMError, match=r"train.grad_accum_steps must be >= 1 \(got 0\)"):
        check_config(cfg)
    cfg.train.grad_accum_steps, cfg.train.global_batch_size = 2, 10
    with pytest.raises(
        TinyLMError, match=r"global_batch_size=10 is not divisible by world size 4 x train.grad_accum_steps 2"
    ):
        per_rank_batch_size(cfg.train, 4)
    assert per_rank_batch_size(cfg.train, 5) == 1
    prepared = prepare(cfg, tmp_path)
    big = tiny_run_config(tmp_path, stories_file, batch_size=10_000)
    with pytest.raises(TinyLMError, match="larger than the train split"):
        train(big, prepared, tmp_path / "big")
    big.data.batching = "stories"
    with pytest.raises(TinyLMError, match="larger than the train split's .* documents"):
        train(big, prepared, tmp_path / "big")
