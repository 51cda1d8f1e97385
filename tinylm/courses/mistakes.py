"""The usual wrong versions of each part, each a small function with the adapter's signature.

When a student's part differs from tinylm's, ``check`` runs these on the same inputs and names the
first one the student's output equals. Most are written once with a switch per mistake
(``attention(..., scale_power=0)``) beside the pieces of tinylm they keep: a mistake differs from the
reference in the one way it names, which tests/test_check.py checks (with every switch at its
default, each function equals the reference).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from tinylm.courses import reference_adapter as ref
from tinylm.generation.processors import NEG_INF, top_k_filter
from tinylm.models.gpt import apply_rope, rope_tables


def weights_under(weights: dict, prefix: str) -> dict:
    """The entries of a block's weights under ``attn.`` or ``ffn.``, without the prefix."""
    return {name[len(prefix) :]: w for name, w in weights.items() if name.startswith(prefix)}


# ------------------------------------------------------------------------------ model parts
def linear(x, weight, bias, *, transpose=True, use_bias=True):
    y = x @ (weight.T if transpose else weight)
    return y + bias if use_bias and bias is not None else y


def softmax(x, dim, *, axis=None, subtract_max=True):
    """A softmax over ``axis`` instead of ``dim`` when given; without the max subtracted it
    overflows where a logit is large (exp(89) is inf in float32)."""
    dim = dim if axis is None else axis
    e = (x - x.amax(dim, keepdim=True)).exp() if subtract_max else x.exp()
    return e / e.sum(dim, keepdim=True)


def attention(q, k, v, causal, *, scale_power=-0.5, mask_diagonal=0, masked=True, softmax_dim=-1):
    """Scaled dot-product attention by hand: the scores scaled by d ** ``scale_power`` (0: not
    scaled, -1: by 1/d), the causal mask as ``tril(mask_diagonal)`` (1: each position also sees
    the next one)."""
    T, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * D**scale_power
    if causal and masked:
        keep = torch.ones(T, S, dtype=torch.bool).tril(S - T + mask_diagonal)
        scores = scores.masked_fill(~keep, NEG_INF)
    return torch.softmax(scores, dim=softmax_dim) @ v


def rotate_halves(x, cos, sin):
    """RoPE on the two halves of each head, (x[:D/2], x[D/2:]) (GPT-NeoX's and HF Llama's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def multihead(x, weights, n_heads, rope, *, attend=attention, split="transpose", rotate=apply_rope, keys=True):
    """Multi-head causal self-attention by hand: ``split="view"`` cuts heads by reshaping (B, T, C)
    straight to (B, H, T, D); ``rotate`` is the RoPE rotation (None: none), ``keys=False`` leaves
    the keys unrotated."""
    B, T, C = x.shape
    D = C // n_heads

    def heads(name):
        t = linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))
        return t.reshape(B, n_heads, T, D) if split == "view" else t.view(B, T, n_heads, D).transpose(1, 2)

    q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
    if rope and rotate is not None:
        cos, sin = rope_tables(T, D, ref.ROPE_THETA)
        q = rotate(q, cos, sin)
        k = rotate(k, cos, sin) if keys else k
    y = attend(q, k, v, True)
    y = y.reshape(B, T, C) if split == "view" else y.transpose(1, 2).reshape(B, T, C)
    return linear(y, weights["out_proj.weight"], weights.get("out_proj.bias"))


def normalize(x, weight, bias, eps, *, center=True, unbiased=False, eps_inside=True, reduce="mean", affine=True):
    """LayerNorm (``center``) or RMSNorm by hand, with the switches of the usual mistakes."""
    if center:
        x = x - x.mean(-1, keepdim=True)
    squares = (x * x).sum(-1, keepdim=True)
    if reduce == "mean":
        squares = squares / (x.shape[-1] - 1 if unbiased else x.shape[-1])
    y = x / (squares + eps).sqrt() if eps_inside else x / (squares.sqrt() + eps)
    if not affine:
        return y
    y = y * weight
    return y + bias if bias is not None else y


def feed_forward(x, weights, kind, *, activation=None, swap=False, gate_fn=F.silu):
    """The feed-forward by hand: ``activation`` replaces the one ``kind`` names; for SwiGLU,
    ``swap`` exchanges gate and up, ``gate_fn`` replaces SiLU."""

    def lin(name, t):
        return linear(t, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    if kind == "swiglu":
        gate, up = lin("gate", x), lin("up", x)
        h = gate_fn(up) * gate if swap else gate_fn(gate) * up
    else:
        h = (activation or {"relu": F.relu, "gelu": partial(F.gelu, approximate="tanh")}[kind])(lin("up", x))
    return lin("down", h)


def identity(x):
    return x


def block(x, weights, n_heads, *, layout="pre"):
    """A transformer block from tinylm's own norms, attention and feed-forward, put together as
    ``layout`` says: "pre" (tinylm), "post", "parallel", "no_residual", "one_norm"."""
    attn, ffn = weights_under(weights, "attn."), weights_under(weights, "ffn.")

    def norm(name, t):
        return ref.run_layernorm(t, weights[f"{name}.weight"], weights[f"{name}.bias"], ref.BLOCK_NORM_EPS)

    def attend(t):
        return ref.run_multihead_attention(t, attn, n_heads, False)

    def mlp(t):
        return ref.run_feed_forward(t, ffn, "gelu")

    if layout == "post":
        h = norm("norm1", x + attend(x))
        return norm("norm2", h + mlp(h))
    if layout == "parallel":
        return x + attend(norm("norm1", x)) + mlp(norm("norm2", x))
    if layout == "no_residual":
        return mlp(norm("norm2", attend(norm("norm1", x))))
    second = "norm1" if layout == "one_norm" else "norm2"
    h = x + attend(norm("norm1", x))
    return h + mlp(norm(second, h))


# ---------------------------------------------------------------------------------- training
def cross_entropy(logits, targets, ignore_index, *, divide_by="targets"):
    """Cross-entropy summed over the counted targets, then divided by the number of counted
    targets ("targets"), of positions ("positions"), not at all ("none"), or averaged per row
    first ("rows")."""
    counted = targets != ignore_index
    logp = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    losses = -(logp * counted)
    if divide_by == "rows":
        return (losses.sum(-1) / counted.sum(-1)).mean()
    if divide_by == "positions":
        return losses.sum() / targets.numel()
    return losses.sum() if divide_by == "none" else losses.sum() / counted.sum()


def adamw(params, grads, state, lr, betas, eps, weight_decay, step, *, bias_correction=True, t_offset=0, decay="lr"):
    """AdamW by hand: ``decay="lr"`` multiplies by 1 - lr * weight_decay (AdamW), "plain" by
    1 - weight_decay; ``t_offset`` shifts the step count of the bias correction."""
    beta1, beta2 = betas
    t = step + t_offset
    new_params, new_state = {}, {}
    for name, p in params.items():
        g = grads[name]
        m = beta1 * state[name]["exp_avg"] + (1 - beta1) * g
        v = beta2 * state[name]["exp_avg_sq"] + (1 - beta2) * g * g
        m_hat, v_hat = (m / (1 - beta1**t), v / (1 - beta2**t)) if bias_correction else (m, v)
        p = p * (1 - (lr * weight_decay if decay == "lr" else weight_decay))
        new_params[name] = p - lr * m_hat / (v_hat.sqrt() + eps)
        new_state[name] = {"exp_avg": m, "exp_avg_sq": v}
    return new_params, new_state


def adam_l2(params, grads, state, lr, betas, eps, weight_decay, step):
    """Adam with L2 regularisation: weight_decay * param added to the gradient (torch.optim.Adam's
    weight_decay), where AdamW decays the weights apart from it."""
    return ref.torch_optimizer_step(
        torch.optim.Adam, params, grads, state, step, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
    )


def cosine_schedule(step, max_lr, min_lr, warmup, total, *, variant):
    """The cosine schedule with one mistake: "no_warmup", "warmup_from_zero", "progress_from_zero",
    "to_zero" or "no_clamp"."""
    if variant == "to_zero":
        min_lr = 0.0
    if variant != "no_warmup" and step < warmup:
        return max_lr * (step if variant == "warmup_from_zero" else step + 1) / warmup
    if variant in ("no_warmup", "progress_from_zero"):
        progress = min(1.0, step / total)
    else:
        progress = (step - warmup) / (total - warmup)
        progress = progress if variant == "no_clamp" else min(1.0, progress)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_grad_norm(grads, max_norm, *, how):
    """Clipping done wrong: "per_tensor" (each gradient by its own norm), "by_value" (clamped to
    [-max_norm, max_norm]), "always" (scaled to max_norm even below it)."""
    total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    if how == "per_tensor":
        clipped = {name: g * min(1.0, max_norm / (float(g.norm()) + 1e-6)) for name, g in grads.items()}
    elif how == "by_value":
        clipped = {name: g.clamp(-max_norm, max_norm) for name, g in grads.items()}
    else:
        clipped = {name: g * (max_norm / (float(total) + 1e-6)) for name, g in grads.items()}
    return clipped, total


# -------------------------------------------------------------------------------- generation
def top_k_shifted(logits, k, *, by):
    return top_k_filter(logits, k + by)


def top_k_zero_fill(logits, k):
    return logits.masked_fill(top_k_filter(logits, k).isinf(), 0.0)


def top_k_smallest(logits, k):
    return logits.masked_fill(top_k_filter(-logits, k).isinf(), NEG_INF)


def top_p(logits, p, *, descending=True, keep_crossing=True):
    """The nucleus filter with tinylm's rule (drop a token once the mass before it reaches p, keep
    at least one) or the student's ``cumsum > p`` (which drops the token that crosses p)."""
    values, order = torch.sort(logits, dim=-1, descending=descending)
    probs = torch.softmax(values, dim=-1)
    if keep_crossing:
        drop = (probs.cumsum(-1) - probs) >= p
        drop[..., 0] = False
    else:
        drop = probs.cumsum(-1) > p
    return torch.full_like(logits, NEG_INF).scatter(-1, order, values.masked_fill(drop, NEG_INF))
