import math

import pytest
import torch
import torch.nn.functional as F

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT, LayerNorm, RMSNorm


def make(**kw):
    base = dict(vocab_size=61, context_length=24, d_model=32, n_layers=2, n_heads=4)
    base.update(kw)
    return GPT(ModelConfig(**base))


@pytest.mark.parametrize("kw", [{}, {"positions": "sinusoidal"}, {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu",
                                                                  "bias": False, "n_kv_heads": 2}])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_causality(kw, attention):
    model = make(attention=attention, **kw).eval()
    x = torch.randint(0, 61, (2, 20))
    logits, _ = model(x)
    x2 = x.clone()
    x2[:, 12:] = torch.randint(0, 61, (2, 8))
    logits2, _ = model(x2)
    assert torch.allclose(logits[:, :12], logits2[:, :12], atol=1e-6)
    assert not torch.allclose(logits[:, 12:], logits2[:, 12:])


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2, "positions": "rope"}, {"d_model": 30, "d_attn": 32}])
def test_manual_attention_equals_sdpa_outputs_and_gradients(kw):
    torch.manual_seed(0)
    manual = make(attention="manual", **kw).double()
    sdpa = make(attention="sdpa", **kw).double()
    sdpa.load_state_dict(manual.state_dict())
    x = torch.randint(0, 61, (3, 24))
    y = torch.randint(0, 61, (3, 24))
    lm, loss_m = manual(x, y)
    ls, loss_s = sdpa(x, y)
    assert torch.allclose(lm, ls, atol=1e-10)
    loss_m.backward()
    loss_s.backward()
    for (name, pm), ps in zip(manual.named_parameters(), sdpa.parameters()):
        assert torch.allclose(pm.grad, ps.grad, atol=1e-10), name


def test_attention_equals_torch_reference_directly():
    """Our hand-written attention layer against F.scaled_dot_product_attention on its own q, k, v."""
    model = make(attention="manual").double().eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 10, 32, dtype=torch.double)
    q = attn.q_proj(x).view(2, 10, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 10, 4, 8).transpose(1, 2)
    v = attn.v_proj(x).view(2, 10, 4, 8).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 32)
    assert torch.allclose(attn(x), attn.out_proj(ref), atol=1e-12)


def test_norms_match_torch():
    x = torch.randn(4, 7, 16, dtype=torch.double)
    ln = LayerNorm(16).double()
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    assert torch.allclose(ln(x), F.layer_norm(x, (16,), ln.weight, ln.bias, 1e-5), atol=1e-12)
    rms = RMSNorm(16).double()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(rms(x), ref, atol=1e-12)


def test_initial_loss_is_about_ln_vocab():
    model = make(vocab_size=500)
    x = torch.randint(0, 500, (8, 24))
    _, loss = model(x, torch.randint(0, 500, (8, 24)))
    assert abs(loss.item() - math.log(500)) < 0.15


@pytest.mark.slow  # 150 training steps
def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = make(dropout=0.0)
    x = torch.randint(0, 61, (4, 24))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_padding_targets_are_ignored():
    model = make().eval()
    x = torch.randint(0, 61, (1, 10))
    y = torch.randint(0, 61, (1, 10))
    y_pad = y.clone()
    y_pad[0, 6:] = -100
    logits, loss = model(x, y_pad)
    ref = F.cross_entropy(logits[0, :6], y[0, :6])
    assert torch.allclose(loss, ref)


def test_weight_tying_and_parameter_count():
    tied, untied = make(tie_weights=True), make(tie_weights=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == 61 * 32


def test_sequence_longer_than_context_is_rejected():
    with pytest.raises(ValueError, match="exceeds the context length 24"):
        make()(torch.zeros(1, 25, dtype=torch.long))


def test_kv_cache_prefill_then_steps_equals_full_forward():
    model = make(positions="rope", n_kv_heads=2).eval()
    x = torch.randint(0, 61, (2, 20))
    full, _ = model(x)
    cache = model.new_kv_cache(2)
    first, _ = model(x[:, :12], kv_cache=cache)
    steps = [model(x[:, t : t + 1], kv_cache=cache)[0] for t in range(12, 20)]
    assert torch.allclose(torch.cat([first, *steps], 1), full, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_attn_dropout_zero_leaves_the_attention_weights_alone(attention):
    """dropout on the residual branches, none on the attention weights (HF GPT-2's attn_pdrop)."""
    from tinylm.models.gpt import CausalSelfAttention

    torch.manual_seed(0)
    kw = dict(vocab_size=16, context_length=8, d_model=16, n_layers=1, n_heads=2, attention=attention)
    x = torch.randn(2, 8, 16)
    split = CausalSelfAttention(ModelConfig(dropout=0.5, attn_dropout=0.0, **kw).resolved())
    split.resid_dropout = torch.nn.Identity()  # leave only the dropout on the weights in play
    split.train()
    train_out = split(x)
    split.eval()
    assert torch.allclose(train_out, split(x), atol=1e-6)
    both = CausalSelfAttention(ModelConfig(dropout=0.5, **kw).resolved())  # attn_dropout defaults to dropout
    both.load_state_dict(split.state_dict())
    both.resid_dropout = torch.nn.Identity()
    both.train()
    assert not torch.allclose(both(x), train_out, atol=1e-3)  # the negative control: weights were dropped
    with pytest.raises(Exception, match="model.attn_dropout"):
        ModelConfig(attn_dropout=1.0, **kw).resolved()


def test_relu_feed_forward_is_relu_and_gelu_is_gpt2s_tanh_gelu():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    for ffn, act in (("relu", torch.relu), ("gelu", lambda h: torch.nn.functional.gelu(h, approximate="tanh"))):
        block = GPT(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=1, n_heads=2, ffn=ffn)).blocks[0].ffn
        expected = block.down(act(block.up(x)))
        assert torch.allclose(block(x), expected, atol=1e-6)


def test_xavier_init_sets_matrices_uniform_in_the_xavier_bound_and_keeps_norms_and_biases():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=500, context_length=8, d_model=64, n_layers=2, n_heads=4, init="xavier"))
    w = model.blocks[0].ffn.up.weight  # (256, 64)
    bound = math.sqrt(6 / (w.shape[0] + w.shape[1]))
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound  # uniform fills the interval
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.01
    gpt2 = GPT(ModelConfig(vocab_size=500, context_length=8, d_model=64, n_layers=2, n_heads=4))
    assert abs(gpt2.blocks[0].ffn.up.weight.std().item() - 0.02) < 0.002
    assert torch.all(model.blocks[0].norm1.weight == 1) and torch.all(model.blocks[0].ffn.up.bias == 0)
    with pytest.raises(TinyLMError, match="model.init"):
        ModelConfig(vocab_size=50, init="kaiming").resolved()
