"""`tinylm check`: the references, the mistakes it names, and the student's process.

Most tests judge an adapter in this process (``child.answer`` is what the student's process runs
per part), so that the ~50 mistakes cost milliseconds each; the slow ones go through the real
sandboxed process and the command line. A student's adapter is tests/fixtures_check/
student_adapter.py (torch primitives, no tinylm) with one wrong definition appended.
"""

from __future__ import annotations

import functools
import json
import math
import types
from pathlib import Path

import pytest
import torch

from tinylm.cli import main
from tinylm.courses import adapter_template, reference_adapter
from tinylm.courses import mistakes as wrong
from tinylm.courses.check import PartResult, check_adapter, explained, judge, make_case, mismatch
from tinylm.courses.child import answer
from tinylm.courses.parts import PARTS, PARTS_BY_NAME, Tolerance, random_weights

STUDENT = Path(__file__).parent / "fixtures_check" / "student_adapter.py"


@functools.cache
def case_of(name: str):
    return make_case(PARTS_BY_NAME[name])


def load(source: str, name: str = "adapter.py") -> types.ModuleType:
    module = types.ModuleType("adapter")
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def student(*overrides: str) -> types.ModuleType:
    """The student's adapter with ``overrides`` appended (each replaces a definition)."""
    return load("\n\n".join([STUDENT.read_text(encoding="utf-8"), *overrides]))


def verdict(module, name: str, adapter: str = "adapter.py") -> PartResult:
    """The part's verdict on ``module``, judged in this process (``adapter``: the file whose lines
    an exception's report names)."""
    part = PARTS_BY_NAME[name]
    return judge(part, case_of(name), answer(module, case_of(name).request, adapter))


# ---------------------------------------------------------------------------------- the contract
def test_the_template_holds_one_function_per_adapter_function_and_each_is_not_implemented():
    functions = {n for n in dir(adapter_template) if n.startswith("run_")}
    assert functions == {part.function for part in PARTS}
    assert functions == {n for n in dir(reference_adapter) if n.startswith("run_")}
    for part in PARTS:
        assert verdict(adapter_template, part.name).status == "not implemented"


def test_the_template_names_every_weight_the_checker_passes():
    """The weight names come from tinylm's state dicts; the docstrings must list each of them."""
    gen = torch.Generator().manual_seed(0)
    modules = {
        "run_multihead_attention": reference_adapter.attention_module(16, 4),
        "run_block": reference_adapter.block_module(16, 4, 32),
        "run_feed_forward": reference_adapter.feed_forward_module(16, 32, "gelu"),
    }
    for function, module in modules.items():
        doc = getattr(adapter_template, function).__doc__
        missing = [name for name in random_weights(module, gen) if f"``{name}``" not in doc]
        assert not missing, f"{function}'s docstring does not name {missing}"
    swiglu = random_weights(reference_adapter.feed_forward_module(16, 32, "swiglu", bias=False), gen)
    assert sorted(swiglu) == ["down.weight", "gate.weight", "up.weight"]


def test_parts_have_distinct_names_and_justified_tolerances():
    assert len(PARTS_BY_NAME) == len(PARTS) == 31
    for part in PARTS:
        assert part.tolerance.why and part.tolerance.atol <= 1e-4
        assert len({m.key for m in part.mistakes}) == len(part.mistakes)


# ----------------------------------------------------------------------------------- comparing
def test_mismatch_reads_nan_and_inf_and_names_the_worst_place():
    tol = Tolerance(1e-6, 0.0, "test")
    inf = math.inf
    assert mismatch(torch.tensor([1.0, -inf, math.nan]), torch.tensor([1.0, -inf, math.nan]), tol) is None
    found = mismatch({"w": torch.tensor([[0.0, 1.0], [2.0, 3.5]])}, {"w": torch.tensor([[0.0, 1.0], [2.0, 3.0]])}, tol)
    assert found.max_error == 0.5 and "output['w'][1, 1]" in found.message and "yours 3.5" in found.message
    assert math.isinf(mismatch(torch.zeros(2), torch.zeros(3), tol).max_error)
    assert "missing" in mismatch([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], tol).message


# --------------------------------------------------------------------------------- the references
def test_a_student_adapter_from_primitives_passes_every_part():
    module = student()
    failed = [verdict(module, part.name) for part in PARTS]
    assert [r.line() for r in failed if r.status != "ok"] == []


CORRECT_BY_HAND = {  # each mistake's function with every switch at its default: tinylm's result
    "linear": wrong.linear,
    "softmax": wrong.softmax,
    "scaled_dot_product_attention": wrong.attention,
    "multihead_attention": wrong.multihead,
    "multihead_attention_rope": wrong.multihead,
    "layernorm": wrong.normalize,
    "rmsnorm": lambda x, weight, eps: wrong.normalize(x, weight, None, eps, center=False),
    "feed_forward_gelu": wrong.feed_forward,
    "feed_forward_relu": wrong.feed_forward,
    "feed_forward_swiglu": wrong.feed_forward,
    "block": wrong.block,
    "cross_entropy": wrong.cross_entropy,
    "adamw_step": wrong.adamw,
    "top_p_filter": wrong.top_p,
    "transformer_lm": wrong.lm_logits,
    "grouped_query_attention": wrong.grouped_query_attention,
    "gradient_accumulation": wrong.accumulated_gradients,
    "kv_cache": wrong.kv_cached_logits,
    "greedy_decode": wrong.greedy_decode,
    "beam_search": wrong.beam_search,
    "bpe_train": wrong.train_bpe,
    "bpe_encode": wrong.bpe_encode,
    "word_vocab": wrong.word_encode,
    "ngram_add_k": wrong.ngram_probs,
    "ngram_kneser_ney": wrong.ngram_probs,
}


@pytest.mark.parametrize("name", sorted(CORRECT_BY_HAND))
def test_each_mistake_function_with_its_switches_off_equals_the_reference(name):
    result = verdict(types.SimpleNamespace(**{PARTS_BY_NAME[name].function: CORRECT_BY_HAND[name]}), name)
    assert result.status == "ok", result.line()


MISTAKES = [(part.name, m) for part in PARTS for m in part.mistakes]


@pytest.mark.parametrize("name, mistake", MISTAKES, ids=[f"{n}-{m.key}" for n, m in MISTAKES])
def test_each_mistake_is_named_as_itself_and_differs_from_the_reference(name, mistake):
    """No mistake equals tinylm's part, and none equals an earlier one on these inputs."""
    result = verdict(types.SimpleNamespace(**{PARTS_BY_NAME[name].function: mistake.fn}), name)
    assert (result.status, result.mistake) == ("differs", mistake.key), result.line()
    assert result.max_error > PARTS_BY_NAME[name].tolerance.atol
    assert result.detail.startswith("yours equals ")


# ------------------------------------------------------------------- mistakes as a student writes them
AS_WRITTEN = {
    ("linear", "weight_not_transposed"): """
def run_linear(x, weight, bias):
    return x @ weight + bias
""",
    ("linear", "no_bias"): """
def run_linear(x, weight, bias):
    return x @ weight.T
""",
    ("softmax", "ignores_dim"): """
def run_softmax(x, dim):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)
""",
    ("softmax", "first_axis"): """
def run_softmax(x, dim):
    e = torch.exp(x - x.amax(0, keepdim=True))
    return e / e.sum(0, keepdim=True)
""",
    ("softmax", "no_max_subtracted"): """
def run_softmax(x, dim):
    return torch.exp(x) / torch.exp(x).sum(dim=dim, keepdim=True)
""",
    ("scaled_dot_product_attention", "no_scale"): """
def attention_scores(q, k):
    return q @ k.transpose(-2, -1)
""",
    ("scaled_dot_product_attention", "scale_by_d"): """
def attention_scores(q, k):
    return q @ k.transpose(-2, -1) / q.shape[-1]
""",
    ("scaled_dot_product_attention", "sees_next"): """
def causal_mask(t):
    return torch.ones(t, t, dtype=torch.bool).tril(1)
""",
    ("scaled_dot_product_attention", "no_mask"): """
def run_scaled_dot_product_attention(q, k, v, causal):
    return run_softmax(attention_scores(q, k), -1) @ v
""",
    ("scaled_dot_product_attention", "softmax_over_queries"): """
def run_scaled_dot_product_attention(q, k, v, causal):
    scores = attention_scores(q, k).masked_fill(~causal_mask(q.shape[-2]), float("-inf"))
    return run_softmax(scores, -2) @ v
""",
    ("multihead_attention", "heads_by_view"): """
def split_heads(t, n_heads):
    b, n, c = t.shape
    return t.reshape(b, n_heads, n, c // n_heads)

def merge_heads(t):
    b, h, n, d = t.shape
    return t.reshape(b, n, h * d)
""",
    ("multihead_attention_rope", "rope_halves"): """
def rotate(x):
    n, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
""",
    ("multihead_attention_rope", "rope_queries_only"): """
def rotate_queries_and_keys(q, k):
    return rotate(q), k
""",
    ("multihead_attention_rope", "no_rope"): """
def rotate_queries_and_keys(q, k):
    return q, k
""",
    ("layernorm", "unbiased_variance"): """
def run_layernorm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(x.var(-1, keepdim=True) + eps) * weight + bias
""",
    ("layernorm", "eps_outside_sqrt"): """
def run_layernorm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    std = ((x - mean) ** 2).mean(-1, keepdim=True).sqrt()
    return (x - mean) / (std + eps) * weight + bias
""",
    ("layernorm", "no_affine"): """
def run_layernorm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
""",
    ("layernorm", "no_centering"): """
def run_layernorm(x, weight, bias, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight + bias
""",
    ("rmsnorm", "centered"): """
def run_rmsnorm(x, weight, eps):
    x = x - x.mean(-1, keepdim=True)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight
""",
    ("rmsnorm", "eps_outside_sqrt"): """
def run_rmsnorm(x, weight, eps):
    return x / (torch.sqrt((x * x).mean(-1, keepdim=True)) + eps) * weight
""",
    ("rmsnorm", "sum_not_mean"): """
def run_rmsnorm(x, weight, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps) * weight
""",
    ("rmsnorm", "no_weight"): """
def run_rmsnorm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
""",
    ("feed_forward_gelu", "exact_gelu"): """
def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
""",
    ("feed_forward_gelu", "relu"): """
def activation(kind, x):
    return torch.relu(x)
""",
    ("feed_forward_gelu", "no_activation"): """
def activation(kind, x):
    return x if kind == "gelu" else torch.relu(x)
""",
    ("feed_forward_relu", "gelu"): """
def activation(kind, x):
    return gelu(x)
""",
    ("feed_forward_relu", "no_activation"): """
def activation(kind, x):
    return gelu(x) if kind == "gelu" else x
""",
    ("feed_forward_swiglu", "gate_up_swapped"): """
def glu(gate, up):
    return silu(up) * gate
""",
    ("feed_forward_swiglu", "sigmoid_gate"): """
def glu(gate, up):
    return torch.sigmoid(gate) * up
""",
    ("block", "normed_residual"): """
def run_block(x, weights, n_heads):
    n = block_norm(weights, "norm1", x)
    h = n + run_multihead_attention(n, weights_under(weights, "attn."), n_heads, False)
    m = block_norm(weights, "norm2", h)
    return m + run_feed_forward(m, weights_under(weights, "ffn."), "gelu")
""",
    ("multihead_attention_rope", "rope_base"): """
def rotate(x):
    n, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
""",
    ("scaled_dot_product_attention", "mask_after_softmax"): """
def run_scaled_dot_product_attention(q, k, v, causal):
    weights = run_softmax(attention_scores(q, k), -1)
    if causal:
        weights = weights.masked_fill(~causal_mask(q.shape[-2]), 0.0)
    return weights @ v
""",
    ("scaled_dot_product_attention", "mask_value_zero"): """
def run_scaled_dot_product_attention(q, k, v, causal):
    scores = attention_scores(q, k)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2]), 0.0)
    return run_softmax(scores, -1) @ v
""",
    ("block", "post_norm"): """
def run_block(x, weights, n_heads):
    attn, ffn = weights_under(weights, "attn."), weights_under(weights, "ffn.")
    h = block_norm(weights, "norm1", x + run_multihead_attention(x, attn, n_heads, False))
    return block_norm(weights, "norm2", h + run_feed_forward(h, ffn, "gelu"))
""",
    ("block", "parallel"): """
def run_block(x, weights, n_heads):
    attn, ffn = weights_under(weights, "attn."), weights_under(weights, "ffn.")
    a = run_multihead_attention(block_norm(weights, "norm1", x), attn, n_heads, False)
    return x + a + run_feed_forward(block_norm(weights, "norm2", x), ffn, "gelu")
""",
    ("block", "no_residual"): """
def run_block(x, weights, n_heads):
    attn, ffn = weights_under(weights, "attn."), weights_under(weights, "ffn.")
    h = run_multihead_attention(block_norm(weights, "norm1", x), attn, n_heads, False)
    return run_feed_forward(block_norm(weights, "norm2", h), ffn, "gelu")
""",
    ("block", "norm1_twice"): """
def run_block(x, weights, n_heads):
    attn, ffn = weights_under(weights, "attn."), weights_under(weights, "ffn.")
    h = x + run_multihead_attention(block_norm(weights, "norm1", x), attn, n_heads, False)
    return h + run_feed_forward(block_norm(weights, "norm1", h), ffn, "gelu")
""",
    ("cross_entropy", "mean_over_padding"): """
def run_cross_entropy(logits, targets, ignore_index):
    losses, counted = token_losses(logits, targets, ignore_index)
    return losses.sum() / targets.numel()
""",
    ("cross_entropy", "sum"): """
def run_cross_entropy(logits, targets, ignore_index):
    return token_losses(logits, targets, ignore_index)[0].sum()
""",
    ("cross_entropy", "mean_of_row_means"): """
def run_cross_entropy(logits, targets, ignore_index):
    losses, counted = token_losses(logits, targets, ignore_index)
    return (losses.sum(-1) / counted.sum(-1)).mean()
""",
    ("adamw_step", "no_bias_correction"): """
def adam_direction(m, v, step, beta1, beta2, eps):
    return m / (torch.sqrt(v) + eps)
""",
    ("adamw_step", "l2_in_gradient"): """
def adam_gradient(g, p, weight_decay):
    return g + weight_decay * p

def decayed(p, lr, weight_decay):
    return p
""",
    ("adamw_step", "decay_without_lr"): """
def decayed(p, lr, weight_decay):
    return p * (1 - weight_decay)
""",
    ("adamw_step", "step_off_by_one"): """
def adam_direction(m, v, step, beta1, beta2, eps):
    t = step + 1
    return (m / (1 - beta1**t)) / (torch.sqrt(v / (1 - beta2**t)) + eps)
""",
    ("cosine_schedule", "no_warmup"): """
def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * min(1.0, step / total)))
""",
    ("cosine_schedule", "warmup_from_zero"): """
def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * step / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))
""",
    ("cosine_schedule", "progress_from_zero"): """
def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * min(1.0, step / total)))
""",
    ("cosine_schedule", "to_zero"): """
def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    return 0.5 * max_lr * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))
""",
    ("cosine_schedule", "no_clamp"): """
def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
""",
    ("clip_grad_norm", "per_tensor"): """
def run_clip_grad_norm(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    return {n: g * min(1.0, max_norm / (float(g.norm()) + 1e-6)) for n, g in grads.items()}, total
""",
    ("clip_grad_norm", "by_value"): """
def run_clip_grad_norm(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    return {n: g.clamp(-max_norm, max_norm) for n, g in grads.items()}, total
""",
    ("clip_grad_norm", "always_scaled"): """
def run_clip_grad_norm(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    return {n: g * max_norm / (float(total) + 1e-6) for n, g in grads.items()}, total
""",
    ("top_k_filter", "k_plus_one"): """
def run_top_k_filter(logits, k):
    kth = torch.topk(logits, k + 1, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))
""",
    ("top_k_filter", "k_minus_one"): """
def run_top_k_filter(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits <= kth, float("-inf"))
""",
    ("top_k_filter", "zero_fill"): """
def run_top_k_filter(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, 0.0)
""",
    ("top_k_filter", "smallest"): """
def run_top_k_filter(logits, k):
    kth = torch.topk(logits, k, dim=-1, largest=False).values[..., -1:]
    return logits.masked_fill(logits > kth, float("-inf"))
""",
    ("top_p_filter", "drops_crossing_token"): """
def nucleus_drop(probs, p):
    return torch.cumsum(probs, dim=-1) > p
""",
    ("top_p_filter", "sorted_ascending"): """
def run_top_p_filter(logits, p):
    values, order = torch.sort(logits, dim=-1)
    kept = values.masked_fill(nucleus_drop(torch.softmax(values, dim=-1), p), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)
""",
    ("transformer_lm", "no_positions"): """
def embed(tokens, weights, start=0):
    return weights["tok_emb.weight"][tokens]
""",
    ("transformer_lm", "no_final_norm"): """
def final_logits(x, weights):
    return x @ weights["lm_head.weight"].T
""",
    ("transformer_lm", "post_norm"): """
def run_transformer_lm(tokens, weights, config):
    x = embed(tokens, weights)
    for i in range(config["n_layers"]):
        w = weights_under(weights, f"blocks.{i}.")
        h = block_norm(w, "norm1", x + run_multihead_attention(x, weights_under(w, "attn."), config["n_heads"], False))
        x = block_norm(w, "norm2", h + run_feed_forward(h, weights_under(w, "ffn."), "gelu"))
    return final_logits(x, weights)
""",
    ("transformer_lm", "tied_head"): """
def final_logits(x, weights):
    return run_layernorm(x, weights["norm_f.weight"], weights["norm_f.bias"], 1e-5) @ weights["tok_emb.weight"].T
""",
    ("grouped_query_attention", "kv_heads_tiled"): """
def expand_kv(t, group):
    return t.repeat(1, group, 1, 1)
""",
    ("gradient_accumulation", "not_divided_by_k"): """
def micro_batch_loss(x, targets, weight, bias, ignore_index, n_targets, k):
    losses, counted = token_losses(run_linear(x, weight, bias), targets, ignore_index)
    return losses.sum() / counted.sum()
""",
    ("gradient_accumulation", "mean_of_micro_means"): """
def micro_batch_loss(x, targets, weight, bias, ignore_index, n_targets, k):
    losses, counted = token_losses(run_linear(x, weight, bias), targets, ignore_index)
    return losses.sum() / counted.sum() / k
""",
    ("gradient_accumulation", "gradients_zeroed_each_micro_batch"): """
def run_accumulated_gradients(x, targets, weight, bias, micro_batches, ignore_index):
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rows = x.shape[0] // micro_batches
    for i in range(micro_batches):
        weight.grad = bias.grad = None
        part = slice(i * rows, (i + 1) * rows)
        losses, counted = token_losses(run_linear(x[part], weight, bias), targets[part], ignore_index)
        (losses.sum() / counted.sum()).backward()
    return {"weight": weight.grad, "bias": bias.grad}
""",
    ("gradient_checkpointing", "input_detached"): """
def input_gradient(g):
    return None
""",
    ("gradient_checkpointing", "not_checkpointed"): """
def run_checkpointed_blocks(x, weights, n_heads, n_layers):
    for i in range(n_layers):
        x = run_block(x, weights_under(weights, f"blocks.{i}."), n_heads)
    return x
""",
    ("gradient_accumulation", "one_batch"): """
def run_accumulated_gradients(x, targets, weight, bias, micro_batches, ignore_index):
    weight = weight.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    n_targets = (targets != ignore_index).sum()
    micro_batch_loss(x, targets, weight, bias, ignore_index, n_targets, 1).backward()
    return {"weight": weight.grad, "bias": bias.grad}
""",
    ("kv_cache", "prefix_recomputed"): """
def run_kv_cached_logits(tokens, weights, config):
    steps = [run_transformer_lm(tokens[:, : t + 1], weights, config)[:, -1] for t in range(tokens.shape[1])]
    return torch.stack(steps, dim=1)
""",
    ("kv_cache", "position_off_by_one"): """
def cache_position(cache_length):
    return cache_length + 1
""",
    ("kv_cache", "position_always_zero"): """
def cache_position(cache_length):
    return 0
""",
    ("kv_cache", "key_cached_after_attending"): """
def attend_cached(q, k, v, cache, i):
    old = cache[i]
    cache[i] = extend_cache(old, k, v)
    return torch.zeros_like(q) if old is None else cached_attention(q, *old)
""",
    ("greedy_decode", "first_position_logits"): """
def next_token_logits(seq, weights, config):
    return run_transformer_lm(torch.tensor([seq]), weights, config)[0, 0]
""",
    ("greedy_decode", "token_not_fed_back"): """
def run_greedy_decode(prompt, weights, config, max_new_tokens):
    seq = prompt.tolist()
    return [int(next_token_logits(seq, weights, config).argmax()) for _ in range(max_new_tokens)]
""",
    ("beam_search", "not_length_normalised"): """
def hypothesis_score(total, length, length_penalty):
    return total
""",
    ("beam_search", "eos_at_any_rank"): """
def may_finish(rank, k):
    return True
""",
    ("beam_search", "beams_start_equal"): """
def start_scores(k):
    return [0.0] * k
""",
    ("bpe_train", "ties_first_seen"): """
def best_pair(counts, vocab):
    return max(counts, key=counts.get)
""",
    ("bpe_train", "ties_greatest_bytes"): """
def best_pair(counts, vocab):
    top = max(counts.values())
    return max((p for p, c in counts.items() if c == top), key=lambda p: (vocab[p[0]], vocab[p[1]]))
""",
    ("bpe_train", "no_pretokenization"): """
def pretokens(text, pattern):
    return [text]
""",
    ("bpe_encode", "leftmost_merge_first"): """
def pick_merge(candidates):
    return min(candidates, key=lambda c: c[1])
""",
    ("bpe_decode", "tokens_decoded_one_by_one"): """
def run_bpe_decode(ids, merges):
    vocab = [bytes([b]) for b in range(256)] + [a + b for a, b in merges]
    return "".join(vocab[int(i)].decode("utf-8", errors="replace") for i in ids)
""",
    ("word_vocab", "ties_first_seen"): """
def ranked_words(counts):
    return sorted(counts, key=lambda w: -counts[w])
""",
    ("word_vocab", "unknown_dropped"): """
def run_word_encode(train_text, text, vocab_size):
    counts = {}
    for w in regex.findall(WORD, train_text):
        counts[w] = counts.get(w, 0) + 1
    ids = {w: 4 + i for i, w in enumerate(ranked_words(counts)[: vocab_size - 4])}
    return [ids[w] for w in regex.findall(WORD, text) if w in ids]
""",
    ("word_vocab", "specials_not_counted"): """
def run_word_encode(train_text, text, vocab_size):
    counts = {}
    for w in regex.findall(WORD, train_text):
        counts[w] = counts.get(w, 0) + 1
    ids = {w: 4 + i for i, w in enumerate(ranked_words(counts)[:vocab_size])}
    return [ids.get(w, 1) for w in regex.findall(WORD, text)]
""",
    ("ngram_add_k", "no_kv_in_denominator"): """
def add_k(c, contexts, k):
    rows = c[contexts]
    return (rows + k) / rows.sum(1, keepdim=True)
""",
    ("ngram_add_k", "laplace"): """
def add_k(c, contexts, k):
    rows = c[contexts]
    return (rows + 1) / (rows.sum(1, keepdim=True) + c.shape[0])
""",
    ("ngram_add_k", "seen_vocabulary"): """
def add_k(c, contexts, k):
    rows = c[contexts]
    return (rows + k) / (rows.sum(1, keepdim=True) + k * (c.sum(0) > 0).sum())
""",
    ("ngram_kneser_ney", "no_discount"): """
def run_ngram_probs(train, vocab_size, contexts, smoothing, k, discount):
    return kneser_ney(bigram_counts(train, vocab_size), contexts, 0.0)
""",
    ("ngram_kneser_ney", "raw_lower_order"): """
def continuation_probs(c, d):
    n = c.sum(0)
    total = n.sum()
    return (n - d).clamp(min=0) / total + d * (n > 0).sum() / total / c.shape[0]
""",
    ("ngram_kneser_ney", "no_interpolation"): """
def kneser_ney(c, contexts, d):
    rows = c[contexts]
    totals = rows.sum(1, keepdim=True)
    return torch.where(totals > 0, (rows - d).clamp(min=0) / totals.clamp(min=1), continuation_probs(c, d))
""",
    ("ngram_kneser_ney", "unigram_not_discounted"): """
def continuation_probs(c, d):
    n = (c > 0).sum(0).double()
    n[2] = 0
    return n / n.sum()
""",
}

AS_WRITTEN["multihead_attention_rope", "heads_by_view"] = AS_WRITTEN["multihead_attention", "heads_by_view"]


LARGER_PARTS = ("multihead_attention", "multihead_attention_rope", "block", "transformer_lm", "gradient_checkpointing")
NORM_LARGER_PARTS = ("block", "transformer_lm", "gradient_checkpointing")


def test_every_mistake_has_a_student_version():
    """Except the attention and LayerNorm mistakes inside larger parts (multi-head, block, LM,
    checkpointed blocks): a student writes those once, in scaled_dot_product_attention or
    layernorm, and test_an_attention_mistake_is_named_in_larger_parts_too and
    test_a_layernorm_mistake_is_named_in_larger_parts_too check them there."""
    attention = {"no_scale", "scale_by_d", "sees_next", "no_mask", "softmax_over_queries"}
    attention |= {"mask_after_softmax", "mask_value_zero"}
    norms = {"unbiased_variance", "no_affine", "no_centering"}
    assert {(part.name, m.key) for part in PARTS for m in part.mistakes} - set(AS_WRITTEN) == {
        *((name, key) for name in LARGER_PARTS for key in attention),
        *((name, key) for name in NORM_LARGER_PARTS for key in norms),
        ("transformer_lm", "eps_outside_sqrt"),
    }


@pytest.mark.parametrize("name, key", sorted(AS_WRITTEN), ids=[f"{n}-{k}" for n, k in sorted(AS_WRITTEN)])
def test_a_mistake_written_as_a_student_writes_it_is_named(name, key):
    result = verdict(student(AS_WRITTEN[name, key]), name)
    assert (result.status, result.mistake) == ("differs", key), result.line()


ATTENTION_AS_WRITTEN = [key for name, key in AS_WRITTEN if name == "scaled_dot_product_attention"]


@pytest.mark.parametrize("key", ATTENTION_AS_WRITTEN)
def test_an_attention_mistake_is_named_in_larger_parts_too(key):
    module = student(AS_WRITTEN["scaled_dot_product_attention", key])
    for name in LARGER_PARTS:
        assert verdict(module, name).mistake == key, name


@pytest.mark.parametrize("key", ["unbiased_variance", "no_affine", "no_centering", "eps_outside_sqrt"])
def test_a_layernorm_mistake_is_named_in_larger_parts_too(key):
    """eps outside the root shows only in the whole LM's gradients (at the blocks' eps of 1e-5)."""
    module = student(AS_WRITTEN["layernorm", key])
    parts = ["transformer_lm"] if key == "eps_outside_sqrt" else NORM_LARGER_PARTS
    for name in parts:
        if (key, name) == ("no_affine", "gradient_checkpointing"):  # the student's own backward raises there
            continue
        assert verdict(module, name).mistake == key, name


BASE_MISTAKES = [(n, k) for n, k in sorted(AS_WRITTEN) if n in ("layernorm", "scaled_dot_product_attention")]


@pytest.mark.parametrize("base, key", BASE_MISTAKES, ids=[f"{n}-{k}" for n, k in BASE_MISTAKES])
def test_one_mistake_is_one_red_cell_the_parts_built_on_it_say_which_to_fix_first(base, key):
    """As `tinylm check` judges the parts in order: each part that differs through the mistake
    says it differs because the part holding it does (the one exception: the student's own
    checkpointing raises when a LayerNorm without weights leaves them out of the graph)."""
    module = student(AS_WRITTEN[base, key])
    so_far = {}
    for part in PARTS:
        so_far[part.name] = explained(verdict(module, part.name), so_far)
    red = {name: r for name, r in so_far.items() if r.status != "ok" and r.because is None}
    expected = {base, "gradient_checkpointing"} if key == "no_affine" else {base}
    assert set(red) == expected, [r.line() for r in red.values()]
    assert red[base].mistake == key
    followers = [r for r in so_far.values() if r.because is not None]
    assert followers and all(r.because == base for r in followers)
    assert all(
        r.line().split(maxsplit=1)[1].startswith(f"differs because `{base}` differs: fix that first (")
        for r in followers
    )


CHEATS = [("kv_cache", "prefix_recomputed"), ("gradient_accumulation", "one_batch"), ("beam_search", "eos_at_any_rank")]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_part_that_skips_its_work_is_caught_on_other_seeds_too(seed):
    """A KV cache that recomputes the prefix, accumulation done as one batch, a beam that lets
    <eos> finish at any rank: right on the plain inputs, named on each run's own."""
    for name, key in CHEATS:
        part, case = PARTS_BY_NAME[name], make_case(PARTS_BY_NAME[name], seed)
        honest = judge(part, case, answer(student(), case.request, "adapter.py"))
        cheat = judge(part, case, answer(student(AS_WRITTEN[name, key]), case.request, "adapter.py"))
        assert honest.status == "ok" and (cheat.status, cheat.mistake) == ("differs", key), (
            honest.line(),
            cheat.line(),
        )


TWO_AT_ONCE = {
    ("scaled_dot_product_attention", "no_scale+no_mask"): """
def attention_scores(q, k):
    return q @ k.transpose(-2, -1)

def causal_mask(t):
    return torch.ones(t, t, dtype=torch.bool)
""",
    ("layernorm", "unbiased_variance+no_affine"): """
def run_layernorm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(x.var(-1, keepdim=True) + eps)
""",
}


@pytest.mark.parametrize("name, key", sorted(TWO_AT_ONCE), ids=[k for _, k in sorted(TWO_AT_ONCE)])
def test_two_mistakes_at_once_are_named_together_and_followed_by_the_larger_parts(name, key):
    module = student(TWO_AT_ONCE[name, key])
    result = verdict(module, name)
    assert (result.status, result.mistake) == ("differs", key), result.line()
    assert result.detail.endswith(": two mistakes at once")
    block = explained(verdict(module, "block"), {name: result})
    assert (block.mistake, block.because) == (key, name), block.line()


def test_an_unnamed_difference_says_where_and_a_wrong_gradient_is_named():
    off = verdict(student("def run_embedding(ids, weight):\n    return weight[ids] + 1e-3"), "embedding")
    assert off.status == "differs" and off.mistake is None
    assert off.detail.startswith("max abs error 0.001 at output[") and abs(off.max_error - 1e-3) < 1e-6
    schedule = verdict(
        student("def run_cosine_schedule(step, max_lr, min_lr, warmup, total):\n    return 1e-3"), "cosine_schedule"
    )
    assert "(call 0: step=0, max_lr=0.001" in schedule.detail
    detached = """
def run_linear(x, weight, bias):
    return x @ weight.detach().T + bias
"""
    cut = verdict(student(detached), "linear")
    assert cut.status == "differs" and "the output is right; no gradient reaches weight" in cut.detail


def test_an_exception_is_reported_with_its_type_message_and_the_adapters_line():
    raising = """
def run_cross_entropy(logits, targets, ignore_index):
    raise ValueError("targets and logits disagree")
"""
    source = STUDENT.read_text(encoding="utf-8") + "\n" + raising
    line = source.splitlines().index('    raise ValueError("targets and logits disagree")') + 1
    result = verdict(load(source, str(STUDENT)), "cross_entropy", str(STUDENT))
    assert result.status == "error"
    assert (
        result.detail
        == f"ValueError: targets and logits disagree (student_adapter.py line {line}, in run_cross_entropy)"
    )
    assert verdict(student("del run_embedding"), "embedding").status == "not implemented"
    returned_nothing = verdict(student("def run_softmax(x, dim):\n    x.exp()"), "softmax")
    assert returned_nothing.detail.startswith("TypeError: returned None")


# ------------------------------------------------------------------------ the student's process
def write_adapter(tmp_path: Path, *overrides: str) -> Path:
    path = tmp_path / "adapter.py"
    path.write_text("\n\n".join([STUDENT.read_text(encoding="utf-8"), *overrides]), encoding="utf-8")
    return path


def test_a_missing_adapter_or_an_unknown_part_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "no" / "adapter.py"
    assert main(["check", str(missing)]) == 2
    assert f"adapter file {missing} does not exist" in capsys.readouterr().err
    assert main(["check", str(STUDENT), "--parts", "linear,attention"]) == 2
    assert "unknown part(s) attention" in capsys.readouterr().err


@pytest.mark.slow
def test_a_student_adapter_passes_every_part_through_the_command_on_a_seed_of_its_own(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["check", str(STUDENT), "--seed", "20261207", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == len(PARTS) + 1
    assert all(line.split(maxsplit=1)[1].split(" (")[0] == "ok" for line in lines[:-1]), lines
    assert lines[-1] == f"{len(PARTS)} ok"
    assert "seed 20261207 (--seed 20261207 repeats these inputs)" in captured.err
    data = json.loads(out.read_text())
    assert data["passed"] and data["seed"] == 20261207
    assert [p["part"] for p in data["parts"]] == [part.name for part in PARTS]


def test_a_run_draws_its_own_inputs_and_a_seed_repeats_them():
    part = PARTS_BY_NAME["linear"]
    first, again, other = make_case(part, 5), make_case(part, 5), make_case(part, 6)
    assert torch.equal(first.calls[0]["x"], again.calls[0]["x"])
    assert not torch.equal(first.calls[0]["x"], other.calls[0]["x"])
    assert torch.equal(first.expected["output"], again.expected["output"])


@pytest.mark.slow
def test_tinylm_cannot_be_imported_by_the_student_and_the_template_alone_is_no_pass(tmp_path, capsys):
    """tinylm's own reference adapter is what a cheating student would call: it cannot load."""
    assert main(["check", reference_adapter.__file__, "--parts", "linear,softmax", "--seed", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert all("ModuleNotFoundError: No module named 'tinylm'" in line for line in lines[:2]), lines
    template = tmp_path / "adapter.py"
    template.write_text(Path(adapter_template.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["check", str(template), "--parts", "linear,softmax", "--seed", "1"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "2 not implemented"


@pytest.mark.slow
def test_the_command_names_a_mistake_a_missing_part_and_an_exception(tmp_path, capsys):
    adapter = write_adapter(
        tmp_path,
        AS_WRITTEN["scaled_dot_product_attention", "no_scale"],
        "del run_embedding",
        "def run_cross_entropy(logits, targets, ignore_index):\n    raise ValueError('no padding here')",
        "print('debugging output goes to stderr')",
    )
    out = tmp_path / "check.json"
    parts = "linear,embedding,cross_entropy,scaled_dot_product_attention"
    assert main(["check", str(adapter), "--parts", parts, "--json", str(out)]) == 1
    lines = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines()[:-1])
    assert lines["linear"] == "ok" and lines["embedding"] == "not implemented"
    assert lines["cross_entropy"].startswith("error: ValueError: no padding here (adapter.py line ")
    assert lines["scaled_dot_product_attention"].startswith(
        "differs: yours equals tinylm's attention without the 1/sqrt(d)"
    )
    data = json.loads(out.read_text())
    assert not data["passed"] and data["parts"][3]["mistake"] == "no_scale"


@pytest.mark.slow
def test_a_hanging_part_times_out_an_unbounded_allocation_fails_and_the_rest_still_run(tmp_path):
    adapter = write_adapter(
        tmp_path,
        "def run_softmax(x, dim):\n    while True:\n        pass",
        "def run_embedding(ids, weight):\n    buffer = torch.empty(2**28)  # 1 GiB\n    return weight[ids]",
    )
    results = {
        r.part: r
        for r in check_adapter(adapter, ["embedding", "softmax", "linear"], timeout=2.0, memory_bytes=256 << 20)
    }
    memory = results["embedding"]
    assert memory.status == "error" and any(word in memory.detail.lower() for word in ("allocat", "memory")), memory
    assert results["softmax"].line().split(maxsplit=1)[1] == "timed out after 2 s"
    assert results["linear"].status == "ok"


@pytest.mark.slow
def test_a_students_budget_ends_its_check_and_the_parts_left_say_so(tmp_path):
    adapter = write_adapter(tmp_path, "def run_softmax(x, dim):\n    while True:\n        pass")
    results = list(check_adapter(adapter, ["softmax", "linear", "embedding"], timeout=30.0, budget=3.0, seed=4))
    assert results[0].status == "timed out" and float(results[0].detail.split()[1]) <= 3.0
    assert [r.line().split(maxsplit=1)[1] for r in results[1:]] == [
        "timed out (the student's 3 s ran out before this part)"
    ] * 2


@pytest.mark.slow
def test_an_adapter_that_does_not_load_fails_every_part_with_the_reason(tmp_path):
    adapter = write_adapter(tmp_path, "def run_linear(x, weight, bias)\n    return x")
    results = list(check_adapter(adapter, ["linear", "softmax"]))
    assert [r.status for r in results] == ["error", "error"]
    assert results[0].detail.startswith("the adapter failed to load: SyntaxError")
