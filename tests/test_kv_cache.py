"""KV cache: logits with and without the cache agree at every step, for every position scheme."""

import pytest
import torch
from conftest import slow_except

from tinylm.config import ModelConfig
from tinylm.generation import GenerationConfig, generate_many
from tinylm.generation.core import prefill
from tinylm.models.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread

ARCHS = {
    "learned": dict(positions="learned"),
    "sinusoidal": dict(positions="sinusoidal"),
    "rope": dict(positions="rope"),
    "llama_gqa": dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_kv_heads=2, tie_weights=False),
    "value_embeddings": dict(positions="rope", n_kv_heads=2, value_embeddings="all"),
}


def tiny(ctx=256, attention="sdpa", **arch):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, context_length=ctx, d_model=32, n_layers=2, n_heads=4, attention=attention, **arch)
    return GPT(cfg).eval()


@pytest.mark.slow  # ~1 s each; the fast tier keeps the shorter with/without-cache comparisons below
@pytest.mark.parametrize(
    "arch, attention", [(a, "sdpa") for a in ARCHS] + [("learned", "manual"), ("llama_gqa", "manual")]
)
def test_cached_logits_equal_full_recompute_for_200_steps(arch, attention):
    model = tiny(attention=attention, **ARCHS[arch])
    seq = [2, 7, 11, 5, 9]
    with torch.inference_mode():
        cache = model.new_kv_cache(1, 256)
        step_logits, _ = model(torch.tensor([seq]), kv_cache=cache)
        step_logits = step_logits[:, -1]
        buffers = [t.data_ptr() for t in cache.k + cache.v]
        for _ in range(200):
            full, _ = model(torch.tensor([seq]))
            assert torch.allclose(step_logits, full[:, -1], atol=1e-5, rtol=0)
            nxt = int(full[0, -1].argmax())
            assert nxt == int(step_logits[0].argmax())
            seq.append(nxt)
            step_logits = model(torch.tensor([[nxt]]), kv_cache=cache)[0][:, -1]
        # preallocated: the cache never reallocated while growing
        assert [t.data_ptr() for t in cache.k + cache.v] == buffers
        assert cache.length == len(seq)


@pytest.mark.parametrize("arch", slow_except("llama_gqa", list(ARCHS)))  # llama_gqa: rope, GQA, RMSNorm
def test_greedy_outputs_identical_with_and_without_cache(arch):
    model = tiny(**ARCHS[arch])
    prompts = [[2, 4, 8], [2, 30, 31, 32, 33, 34]]
    cached = generate_many(model, prompts, GenerationConfig(max_new_tokens=60, temperature=0))
    full = generate_many(model, prompts, GenerationConfig(max_new_tokens=60, temperature=0, use_cache=False))
    assert [r.tokens for r in cached] == [r.tokens for r in full]
    assert all(len(r.tokens) == 60 for r in cached)


@pytest.mark.parametrize("arch", ["learned", "rope", "value_embeddings"])
def test_left_padded_prefill_matches_each_row_alone(arch):
    model = tiny(**ARCHS[arch])
    rows = [[2, 5, 6, 7, 8, 9, 10], [2, 3], [2, 40, 41, 42]]
    with torch.inference_mode():
        cache, last, positions = prefill(model, rows, 32)
        assert positions.tolist() == [7, 2, 4]
        assert cache.key_mask[1, :5].tolist() == [False] * 5 and cache.key_mask[1, 5:].all()
        for r, row in enumerate(rows):
            alone = model(torch.tensor([row]))[0][0, -1]
            assert torch.allclose(last[r], alone, atol=1e-5, rtol=0)
        # one decoding step keeps them equal
        nxt = last.argmax(-1)
        step = model(nxt[:, None], kv_cache=cache, position_ids=positions[:, None])[0][:, -1]
        for r, row in enumerate(rows):
            alone = model(torch.tensor([row + [int(nxt[r])]]))[0][0, -1]
            assert torch.allclose(step[r], alone, atol=1e-5, rtol=0)


def test_reorder_copies_rows_in_place_and_resizes():
    model = tiny(ctx=16)
    with torch.inference_mode():
        cache = model.new_kv_cache(3, 16)
        model(torch.tensor([[1, 2], [3, 4], [5, 6]]), kv_cache=cache)
        before = [t.clone() for t in cache.k]
        ptr = cache.k[0].data_ptr()
        cache.reorder(torch.tensor([2, 2, 0]))
        assert cache.k[0].data_ptr() == ptr  # same size: in place
        assert torch.equal(cache.k[1][0], before[1][2]) and torch.equal(cache.k[1][2], before[1][0])
        cache.reorder(torch.tensor([0, 0, 1, 1, 2, 2]))  # expand to beams
        assert cache.batch_size == 6 and torch.equal(cache.k[0][5, :, :2], before[0][0, :, :2])


def test_context_overflow_slides_window_and_matches_a_fresh_prefill():
    """Past the context the cache is re-filled with the last context//2 tokens (documented)."""
    model = tiny(ctx=16)
    prompt = [2, 9, 10, 11]
    out = generate_many(model, [prompt], GenerationConfig(max_new_tokens=40, temperature=0))[0].tokens
    assert len(out) == 40
    # 4 prompt slots + 12 fed tokens fill the 16 slots; new token 14 (out[13]) is predicted from a
    # re-prefill of the last 8 tokens, and later ones continue from that window's cache
    seq = prompt + out
    with torch.inference_mode():
        for i in (13, 14, 20):
            window = seq[: len(prompt) + i][-8:] if i == 13 else seq[len(prompt) + 13 - 8 : len(prompt) + i]
            assert out[i] == int(model(torch.tensor([window]))[0][0, -1].argmax())
    nocache = generate_many(model, [prompt], GenerationConfig(max_new_tokens=40, temperature=0, use_cache=False))
    assert len(nocache[0].tokens) == 40  # the no-cache path keeps the last 16 tokens instead


def test_inference_weight_cache_follows_weight_updates():
    """The fused, transposed inference weights are rebuilt when a parameter changes in place."""
    model = tiny(**ARCHS["llama_gqa"])
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(x)[0]
    with torch.no_grad():
        attn = model.blocks[0].attn
        attn.qkv.weight[attn.qkv.split_sizes[0] : sum(attn.qkv.split_sizes[:2])].mul_(1.5)  # the k rows
        model.blocks[1].ffn.gate_up.weight[: model.config.d_ff].add_(0.01)  # the gate rows
        model.lm_head.weight.mul_(0.5)
    model.train()
    reference = model(x)[0].detach()  # the training path reads the parameters directly
    model.eval()
    with torch.inference_mode():
        after = model(x)[0]
    assert not torch.allclose(before, after)
    assert torch.allclose(after, reference, atol=1e-5, rtol=0)
