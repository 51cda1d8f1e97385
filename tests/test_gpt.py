import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT, LayerNorm, RMSNorm, state_dict_by_parts


def make(**kw):
    base = dict(vocab_size=61, context_length=24, d_model=32, n_layers=2, n_heads=4)
    base.update(kw)
    return GPT(ModelConfig(**base))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"positions": "sinusoidal"},
        {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False, "n_kv_heads": 2},
    ],
)
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
    # q, k and v as three separate products with the rows of the fused weight
    q, k, v = (
        F.linear(x, w, b).view(2, 10, 4, 8).transpose(1, 2)
        for w, b in zip(attn.qkv.weight.split(32), attn.qkv.bias.split(32))
    )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 32)
    assert torch.allclose(attn(x), attn.out_proj(ref), atol=1e-12)


def test_norms_match_their_formulas():
    x = torch.randn(4, 7, 16, dtype=torch.double) * 3 + 1
    ln = LayerNorm(16).double()
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    x_hat = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    assert torch.allclose(ln(x), x_hat * ln.weight + ln.bias, atol=1e-12)
    no_bias = LayerNorm(16, bias=False).double()
    torch.nn.init.normal_(no_bias.weight)
    assert torch.allclose(no_bias(x), x_hat * no_bias.weight, atol=1e-12)
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
        block = (
            GPT(ModelConfig(vocab_size=50, context_length=8, d_model=16, n_layers=1, n_heads=2, ffn=ffn)).blocks[0].ffn
        )
        expected = block.down(act(block.up(x)))
        assert torch.allclose(block(x), expected, atol=1e-6)


def test_xavier_init_sets_matrices_uniform_in_the_xavier_bound_and_keeps_norms_and_biases():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=500, context_length=8, d_model=64, n_layers=2, n_heads=4, init="xavier"))
    w = model.blocks[0].ffn.up.weight  # (256, 64)
    bound = math.sqrt(6 / (w.shape[0] + w.shape[1]))
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound  # uniform fills the interval
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.01
    # the fused q/k/v weight: each part in its own (64, 64) bound, not the bound of the (192, 64) whole
    bound = math.sqrt(6 / (64 + 64))
    for part in model.blocks[0].attn.qkv.weight.split(64):
        assert part.abs().max() <= bound and part.abs().max() > 0.95 * bound
    gpt2 = GPT(ModelConfig(vocab_size=500, context_length=8, d_model=64, n_layers=2, n_heads=4))
    assert abs(gpt2.blocks[0].ffn.up.weight.std().item() - 0.02) < 0.002
    assert torch.all(model.blocks[0].norm1.weight == 1) and torch.all(model.blocks[0].ffn.up.bias == 0)
    with pytest.raises(TinyLMError, match="model.init"):
        ModelConfig(vocab_size=50, init="kaiming").resolved()


# ------------------------------------------------------------------ fused q/k/v and gate/up weights
def _pre_fusion_state(model: GPT) -> dict:
    """The model's weights as tinylm saved them before q, k, v (and gate, up) were one matrix each,
    split here by hand: attn.q_proj / k_proj / v_proj, ffn.gate / ffn.up, weights and biases."""
    cfg, state = model.config, dict(model.state_dict())
    q_rows, kv_rows = cfg.d_attn, cfg.n_kv_heads * (cfg.d_attn // cfg.n_heads)
    for key in [k for k in state if ".attn.qkv." in k]:
        q, k, v = torch.split(state.pop(key), [q_rows, kv_rows, kv_rows])
        for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            state[key.replace(".qkv.", f".{name}.")] = part.clone()
    for key in [k for k in state if ".ffn.gate_up." in k]:
        gate, up = state.pop(key).chunk(2)
        state[key.replace(".gate_up.", ".gate.")], state[key.replace(".gate_up.", ".up.")] = gate.clone(), up.clone()
    return state


FUSION_SHAPES = {
    "gpt2": {},
    "llama_gqa": dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_kv_heads=2),
    "swiglu_bias_gqa": dict(ffn="swiglu", n_kv_heads=1),
}


@pytest.mark.parametrize("shape", FUSION_SHAPES)
def test_a_state_dict_from_before_the_fusion_loads_with_equal_logits(shape):
    torch.manual_seed(0)
    model = make(**FUSION_SHAPES[shape]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # biases and gains away from their 0 / 1 init
    old = _pre_fusion_state(model)
    assert not any(".qkv." in k or ".gate_up." in k for k in old)
    torch.manual_seed(1)
    loaded = make(**FUSION_SHAPES[shape]).eval()
    assert loaded.load_state_dict(old, strict=True)  # the pre-hook joins the parts
    x = torch.randint(0, 50, (2, 12))
    assert torch.equal(loaded(x)[0], model(x)[0])
    assert set(old) == set(state_dict_by_parts(loaded)) and all(
        torch.equal(old[k], v) for k, v in state_dict_by_parts(loaded).items()
    )


def test_a_state_dict_with_only_some_parts_is_refused_naming_them():
    model = make()
    old = _pre_fusion_state(model)
    del old["blocks.0.attn.v_proj.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks\.0\.attn\.qkv\.weight"') as err:
        make().load_state_dict(old, strict=True)
    assert '"blocks.0.attn.q_proj.weight", "blocks.0.attn.k_proj.weight"' in str(err.value)  # left as they were


def test_fused_qkv_with_grouped_query_heads_is_the_three_separate_projections():
    torch.manual_seed(0)
    model = make(n_kv_heads=2, attention="manual").double().eval()
    attn = model.blocks[0].attn
    assert attn.qkv.split_sizes == (32, 16, 16)  # q: 4 heads of 8, k and v: 2 heads of 8
    x = torch.randn(2, 10, 32, dtype=torch.double)
    wq, wk, wv = attn.qkv.weight.split((32, 16, 16))
    bq, bk, bv = attn.qkv.bias.split((32, 16, 16))
    q = F.linear(x, wq, bq).view(2, 10, 4, 8).transpose(1, 2)
    k, v = (
        F.linear(x, w, b).view(2, 10, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1) for w, b in ((wk, bk), (wv, bv))
    )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 32)
    torch.testing.assert_close(attn(x), attn.out_proj(ref), rtol=0, atol=1e-12)


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN")


class OpsCalled(TorchDispatchMode):
    """The names of the torch ops run inside it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@needs_onednn
@pytest.mark.parametrize("rows, blocked", [(1, False), (15, False), (16, True), (33, True)])
def test_the_decoding_layout_s_blocked_product_is_the_plain_one(rows, blocked):
    """From 16 rows on (BLOCKED_MIN_ROWS), a projection's decoding product is oneDNN's on its
    blocked copy of the weights, the tanh GELU inside the up projection's; fewer rows stay MKL's.
    Both equal F.linear to float32 rounding."""
    torch.manual_seed(0)
    model = make(d_model=48, d_ff=96).eval()
    model.prepare_for_decoding()
    ffn = model.blocks[0].ffn
    layout = ffn.up.decode_layout
    assert layout.blocked is not None and torch.equal(layout.weight_t, ffn.up.weight.t())
    x = torch.randn(rows, 48)
    with torch.inference_mode(), OpsCalled() as called:
        up, gelu, step = ffn.up(x), layout.product(x, gelu_tanh=True), ffn(x)
    plain = F.linear(x, ffn.up.weight, ffn.up.bias)
    torch.testing.assert_close(up, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gelu, F.gelu(plain, approximate="tanh"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, ffn(x[None])[0].detach(), atol=1e-5, rtol=1e-5)  # the forward's rows
    products = ("mkldnn._linear_pointwise", "aten.addmm", "aten.gelu")
    # up; up with its GELU; the feed-forward's up with its GELU, then down
    mkl = ["aten.addmm", "aten.addmm", "aten.gelu", "aten.addmm", "aten.gelu", "aten.addmm"]
    assert [n for n in called.names if n in products] == (["mkldnn._linear_pointwise"] * 4 if blocked else mkl)


def test_a_model_not_in_float32_has_no_blocked_weights_and_decodes_with_torch_s_product():
    model = make().double().eval()
    model.prepare_for_decoding()
    layout = model.blocks[0].attn.qkv.decode_layout
    assert layout.blocked is None
    x = torch.randn(16, 32, dtype=torch.float64)
    with torch.inference_mode():
        torch.testing.assert_close(model.blocks[0].attn.qkv(x), F.linear(x, layout.weight_t.t(), layout.bias))


def test_a_copy_of_a_model_prepared_for_decoding_decodes_with_its_own_weights():
    """A deep copy (the EMA twin) leaves the decoding layouts behind and makes its own."""
    model = make().eval()
    model.prepare_for_decoding()
    twin = copy.deepcopy(model)
    assert twin.blocks[0].attn.qkv.decode_layout is None
    with torch.no_grad():
        twin.blocks[0].attn.qkv.weight.mul_(2)
    twin.prepare_for_decoding()
    layout = twin.blocks[0].attn.qkv.decode_layout
    assert torch.equal(layout.weight_t, twin.blocks[0].attn.qkv.weight.t())
    assert not torch.equal(layout.weight_t, model.blocks[0].attn.qkv.decode_layout.weight_t)


@needs_onednn
def test_warming_the_blocked_products_runs_each_once_per_row_count():
    model = make(d_model=48, d_ff=96).eval()
    with OpsCalled() as called:
        model.warm_blocked_products(20)
    blocked = [m for m in model.modules() if getattr(m, "decode_layout", None) is not None]
    assert all(m.decode_layout.blocked is not None for m in blocked)
    assert called.names.count("mkldnn._linear_pointwise") == len(blocked) * 5  # 16 to 20 rows
    assert "aten.gelu" not in called.names and "aten.addmm" not in called.names
