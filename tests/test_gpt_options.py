"""The speedrun-era block options (QK-norm, ReLU^2, logit soft-capping, zero-initialised output
projections, value embeddings): each changes what it should and nothing else, on the training,
inference and KV-cache paths alike."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tinylm.config import ModelConfig, build_config
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT

BASE = ModelConfig(
    vocab_size=61,
    context_length=24,
    d_model=32,
    n_layers=2,
    n_heads=4,
    positions="rope",
    norm="rmsnorm",
    ffn="swiglu",
    bias=False,
)


def _pair(**change):
    """The base model and a variant with the same weights (every option here adds no parameter)."""
    torch.manual_seed(0)
    base = GPT(BASE)
    variant = GPT(dataclasses.replace(BASE, **change))
    variant.load_state_dict(base.state_dict())
    return base.eval(), variant.eval()


def _logits(model, x):
    with torch.no_grad():
        return model(x)[0]


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    base, normed = _pair(qk_norm=True)
    x = torch.randint(0, 61, (2, 20))
    assert not torch.allclose(_logits(base, x), _logits(normed, x), atol=1e-3)
    before = _logits(normed, x)
    with torch.no_grad():
        for block in normed.blocks:
            q_rows, k_rows, _ = block.attn.qkv.weight.split(block.attn.qkv.split_sizes)
            q_rows.mul_(7.0)
            k_rows.mul_(3.0)
        for block in base.blocks:
            block.attn.qkv.weight[: block.attn.qkv.split_sizes[0]].mul_(7.0)
    torch.testing.assert_close(_logits(normed, x), before, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(_logits(base, x), _logits(_pair()[0], x), atol=1e-3)  # without it, scale matters


def test_qk_norm_same_logits_on_every_path():
    _, model = _pair(qk_norm=True)
    x = torch.randint(0, 61, (2, 20))
    fast = _logits(model, x)  # eval + no grad: the fused inference path
    with torch.enable_grad():
        slow = model(x)[0].detach()
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        steps = [model(x[:, :12], kv_cache=cache)[0]] + [
            model(x[:, t : t + 1], kv_cache=cache)[0] for t in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), fast, rtol=1e-5, atol=1e-5)


def test_qk_norm_weight_is_a_gain_per_head_dimension_on_every_path():
    """Gains of ones are QK-norm at epsilon norm_eps; a gain scales each query's and key's dimension
    (a query gain of 2 doubles the attention logits), the same with and without the cache."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(BASE, qk_norm=True, qk_norm_weight=True, norm_eps=1e-6)
    gained, plain = GPT(cfg).eval(), GPT(dataclasses.replace(cfg, qk_norm_weight=False)).eval()
    assert {n for n, _ in gained.named_parameters()} - {n for n, _ in plain.named_parameters()} == {
        f"blocks.{i}.attn.{g}" for i in range(2) for g in ("q_norm", "k_norm")
    }
    plain.load_state_dict({k: v for k, v in gained.state_dict().items() if not k.endswith("_norm")})
    x = torch.randint(0, 61, (2, 20))
    torch.testing.assert_close(_logits(gained, x), _logits(plain, x), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        for block in gained.blocks:
            block.attn.q_norm.copy_(torch.linspace(0.5, 2.0, 8))
    changed = _logits(gained, x)
    assert not torch.allclose(changed, _logits(plain, x), atol=1e-3)
    cache = gained.new_kv_cache(2)
    with torch.no_grad():
        steps = [gained(x[:, :12], kv_cache=cache)[0]] + [
            gained(x[:, t : t + 1], kv_cache=cache)[0] for t in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), changed, rtol=1e-5, atol=1e-5)
    with pytest.raises(TinyLMError, match="qk_norm_weight=true is a gain on QK-norm"):
        dataclasses.replace(BASE, qk_norm_weight=True).resolved()


def test_relu_squared_feed_forward():
    cfg = dataclasses.replace(BASE, ffn="relu2", d_ff=48)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    ffn = model.blocks[0].ffn
    assert not hasattr(ffn, "gate_up")  # two matrices, like the GELU MLP
    h = torch.randn(3, 5, 32)
    expected = F.linear(F.relu(F.linear(h, ffn.up.weight)) ** 2, ffn.down.weight)
    with torch.no_grad():
        torch.testing.assert_close(ffn(h), expected)  # inference path
    with torch.enable_grad():
        torch.testing.assert_close(ffn(h).detach(), expected)  # training path


def test_logit_softcap_bounds_the_logits_and_keeps_their_order():
    base, capped = _pair(logit_softcap=2.0)
    with torch.no_grad():
        base.lm_head.weight.mul_(8.0)  # tied: also the embedding; large logits
        capped.lm_head.weight.mul_(8.0)
    x = torch.randint(0, 61, (2, 20))
    raw, soft = _logits(base, x), _logits(capped, x)
    assert raw.abs().max() > 4.0 and soft.abs().max() <= 2.0
    torch.testing.assert_close(soft, 2.0 * torch.tanh(raw / 2.0), rtol=1e-5, atol=1e-5)
    assert torch.equal(raw.argmax(-1), soft.argmax(-1))  # greedy decoding unchanged
    with torch.enable_grad():
        _, loss = capped(x, x)
    assert torch.isfinite(loss)


def test_zero_init_out_zeroes_only_the_residual_output_projections():
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, zero_init_out=True))
    zero = {n for n, p in model.named_parameters() if p.dim() == 2 and not p.any()}
    assert zero == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.out_proj", "ffn.down")}
    x = torch.randint(0, 61, (2, 10))
    with torch.no_grad():  # every block is the identity at init: logits = head(norm(embedding))
        expected = model.lm_head(model.norm_f(model.tok_emb(x)))
        torch.testing.assert_close(model.eval()(x)[0], expected)


def test_bad_softcap_is_named():
    with pytest.raises(TinyLMError, match="logit_softcap"):
        GPT(dataclasses.replace(BASE, logit_softcap=0.0))


# ---------------------------------------------------------------------------------- value embeddings
def _tables(model) -> dict[int, torch.Tensor]:
    return {i: b.attn.value_embed.weight for i, b in enumerate(model.blocks) if b.attn.value_embed is not None}


@pytest.mark.parametrize(
    "mode, n_layers, layers",
    [("alternate", 3, [0, 2]), ("alternate", 4, [1, 3]), ("alternate", 1, [0]), ("all", 3, [0, 1, 2])],
)
def test_value_embedding_tables_sit_on_the_right_layers_and_add_their_parameters(mode, n_layers, layers):
    cfg = dataclasses.replace(BASE, n_layers=n_layers, n_kv_heads=2)  # kv width 2 heads x 8 = 16
    torch.manual_seed(0)
    plain, model = GPT(cfg), GPT(dataclasses.replace(cfg, value_embeddings=mode))
    tables = _tables(model)
    assert sorted(tables) == layers and all(t.shape == (61, 16) for t in tables.values())
    assert model.num_parameters() - plain.num_parameters() == len(layers) * 61 * 16
    # initialised like the other matrices: N(0, 0.02)
    values = torch.cat([t.detach().flatten() for t in tables.values()])
    assert abs(values.std().item() - 0.02) < 0.002 and abs(values.mean().item()) < 0.002


@pytest.mark.parametrize("mode", ["alternate", "all"])
def test_value_embeddings_change_the_logits_only_through_their_tables(mode):
    torch.manual_seed(0)
    base = GPT(dataclasses.replace(BASE, n_layers=3, n_kv_heads=2)).eval()
    model = GPT(dataclasses.replace(base.config, value_embeddings=mode)).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert sorted(missing) == [f"blocks.{i}.attn.value_embed.weight" for i in sorted(_tables(model))] and not unexpected
    x = torch.randint(0, 61, (2, 20))
    assert not torch.allclose(_logits(model, x), _logits(base, x), atol=1e-3)
    with torch.no_grad():
        for table in _tables(model).values():
            table.zero_()
    torch.testing.assert_close(_logits(model, x), _logits(base, x), rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_value_embeddings_same_logits_with_and_without_the_kv_cache(attention):
    torch.manual_seed(0)
    model = GPT(
        dataclasses.replace(BASE, n_layers=3, n_kv_heads=2, value_embeddings="alternate", attention=attention)
    ).eval()
    x = torch.randint(0, 61, (2, 20))
    full = _logits(model, x)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        steps = [model(x[:, :12], kv_cache=cache)[0]] + [
            model(x[:, t : t + 1], kv_cache=cache)[0] for t in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_value_embeddings_outside_the_choices_are_refused_by_name():
    with pytest.raises(TinyLMError, match=r"^model\.value_embeddings='odd' is not one of none, alternate, all$"):
        build_config(None, ["model.value_embeddings=odd"])


# ------------------------------------------------------------------------------ document attention
SOS = 2


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_document_attention_scores_each_packed_story_as_if_it_stood_alone(attention):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(BASE, attention=attention)).eval()
    tail, first, second = (torch.randint(4, 61, (1, n)) for n in (3, 8, 9))
    sos = torch.tensor([[SOS]])
    window = torch.cat([tail, sos, first, sos, second], 1)  # a story's end, then two whole stories
    with torch.no_grad():
        packed = model(window, document_start=SOS)[0]
        plain = model(window)[0]
        alone = [model(part)[0] for part in (tail, torch.cat([sos, first], 1), torch.cat([sos, second], 1))]
    # rotary positions are relative: a story's logits do not depend on where the window put it
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
    # without the option the second story sees the first, so its logits change (the tail's cannot)
    torch.testing.assert_close(plain[:, :3], packed[:, :3], rtol=1e-5, atol=1e-5)
    assert (plain[:, 3:] - packed[:, 3:]).abs().amax() > 1e-3


def test_document_attention_refuses_a_kv_cache_by_name():
    model = GPT(BASE).eval()
    with pytest.raises(ValueError, match="document_start .* not a KV cache"):
        model(torch.tensor([[SOS, 5, 6]]), kv_cache=model.new_kv_cache(1), document_start=SOS)
