"""Hand-written gradient checkpointing: same gradients as the plain model (dropout on), same RNG
stream afterwards, and far fewer bytes kept for backward."""

import pytest
import torch

from tinylm.config import ModelConfig, TrainConfig, check_config
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT
from tinylm.training.grad_checkpoint import CheckpointedBlock, checkpoint_function, tinylm_checkpoint
from tinylm.training.memory import measure_step_activation_bytes


def _model(dtype=torch.float64, **kw):
    cfg = dict(vocab_size=61, context_length=24, d_model=32, n_layers=3, n_heads=4, dropout=0.2)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg)).to(dtype).train()


def _grads(model, x, y, seed=123, checkpoint_blocks=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    _, loss = model(x, y, checkpoint_blocks=checkpoint_blocks)
    loss.backward()
    rng_after = torch.get_rng_state()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss.item(), rng_after


def _batch(vocab=61, B=3, T=24):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(attention="manual"),
        dict(positions="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2, bias=False),
        dict(value_embeddings="alternate", n_kv_heads=2),
    ],
)
@pytest.mark.parametrize("impl", ["tinylm", "torch"])
def test_checkpointed_gradients_equal_plain_with_dropout(kw, impl):
    model = _model(**kw)
    x, y = _batch()
    plain, loss_plain, rng_plain = _grads(model, x, y)
    ckpt, loss_ckpt, rng_ckpt = _grads(model, x, y, checkpoint_blocks=checkpoint_function(impl))
    assert loss_ckpt == loss_plain
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=1e-12, msg=name)
    if kw.get("value_embeddings"):  # the tables' gradients came through the checkpointed blocks
        assert ckpt["blocks.2.attn.value_embed.weight"].abs().sum() > 0
    # recomputation in backward does not advance the run's random stream
    assert torch.equal(rng_ckpt, rng_plain)


def test_dropout_masks_really_differ_between_seeds():
    """Guard against a vacuous test: with another seed (other dropout masks) gradients change."""
    model = _model()
    x, y = _batch()
    a, _, _ = _grads(model, x, y, seed=1)
    b, _, _ = _grads(model, x, y, seed=2)
    assert (a["blocks.0.attn.qkv.weight"] - b["blocks.0.attn.qkv.weight"]).abs().max() > 1e-6


def test_recompute_without_restoring_rng_would_differ():
    """The RNG restore matters: a Function that recomputes with fresh dropout gets other gradients."""
    model = _model()
    x, y = _batch()
    plain, _, _ = _grads(model, x, y)

    class NoRestore(CheckpointedBlock):
        @staticmethod
        def backward(ctx, grad_out):
            ctx.cpu_rng = torch.get_rng_state()  # pretend: take whatever state the generator has now
            return CheckpointedBlock.backward(ctx, grad_out)

    def no_restore(block, x, rope, mask, idx):
        return NoRestore.apply(block, rope, mask, idx, x, *block.parameters())

    broken, _, _ = _grads(model, x, y, checkpoint_blocks=no_restore)
    assert (broken["blocks.0.ffn.up.weight"] - plain["blocks.0.ffn.up.weight"]).abs().max() > 1e-6


def test_autograd_grad_reaches_block_parameters():
    """Parameters are inputs of the Function, so torch.autograd.grad sees them (not only .grad)."""
    model = _model(dropout=0.0)
    x, y = _batch()
    _, loss = model(x, y, checkpoint_blocks=tinylm_checkpoint)
    w = model.blocks[1].attn.qkv.weight
    (g,) = torch.autograd.grad(loss, [w])
    _, loss = model(x, y)
    (ref,) = torch.autograd.grad(loss, [w])
    torch.testing.assert_close(g, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw", [dict(), dict(value_embeddings="all")])
def test_checkpointing_under_bf16_autocast_matches_plain(kw):
    """The recomputation re-enters autocast, so bf16 checkpointed gradients equal bf16 plain ones."""
    model = _model(dtype=torch.float32, dropout=0.1, **kw)
    x, y = _batch()

    def grads(checkpoint_blocks=None):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y, checkpoint_blocks=checkpoint_blocks)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    ckpt = grads(tinylm_checkpoint)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=0, msg=name)


def test_eval_and_kv_cache_paths_skip_checkpointing():
    model = _model(dropout=0.0)
    x, _ = _batch()

    def refuse(*args):
        raise AssertionError("checkpoint_blocks ran outside training")

    model.eval()
    with torch.no_grad():
        logits, _ = model(x, checkpoint_blocks=refuse)
    assert logits.shape == (3, 24, 61)
    model.train()
    cache = model.new_kv_cache(3)
    with torch.no_grad():
        logits, _ = model(x, kv_cache=cache, checkpoint_blocks=refuse)
    assert logits.shape == (3, 24, 61)


def test_checkpointing_keeps_under_40_percent_of_activation_bytes():
    model = _model(dtype=torch.float32, vocab_size=64, context_length=64, d_model=64, n_layers=4, dropout=0.1)
    x, y = _batch(vocab=64, B=4, T=64)
    plain = measure_step_activation_bytes(model, x, y)["peak_activation_bytes"]
    ckpt = measure_step_activation_bytes(model, x, y, checkpoint_blocks=tinylm_checkpoint)
    assert ckpt["peak_activation_bytes"] <= 0.4 * plain
    # at the end of the forward only block inputs (and the head) are kept; the peak is reached
    # in backward, when one block is recomputed
    assert ckpt["forward_end_bytes"] < ckpt["peak_activation_bytes"]


def test_unknown_impl_is_an_error():
    with pytest.raises(TinyLMError, match="train.checkpoint_impl='fancy' is not one of tinylm, torch"):
        check_config(TrainConfig(checkpoint_impl="fancy"), "train.")
