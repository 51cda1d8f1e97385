"""The adapter contract (``adapter_template.py``) filled with tinylm's own modules: the references
``tinylm check`` compares a student's parts with, and the worked example a teacher can read.

Each function builds the tinylm module that does the work (``CausalSelfAttention``, ``Block``, ...)
and runs it with the given tensors as its parameters (``torch.func.functional_call``), so that
gradients reach those tensors. Weights come under tinylm's state-dict names with q, k, v (gate, up)
apart, as ``state_dict_by_parts`` writes them; ``join_parts`` fuses them the way loading does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinylm.config import ModelConfig
from tinylm.generation.processors import top_k_filter, top_p_filter
from tinylm.models.gpt import (
    Block,
    CausalSelfAttention,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
    join_parts,
    rope_factors,
    rope_tables,
)
from tinylm.training.optim import scheduled_lr

ROPE_THETA = 10000.0  # tinylm's default (ModelConfig.rope_theta)
BLOCK_NORM_EPS = 1e-5  # tinylm's default (ModelConfig.norm_eps)


# ----------------------------------------------------------------------- tinylm's modules
def model_config(d_model: int, n_heads: int = 1, d_ff: int | None = None, **options) -> ModelConfig:
    """The configuration of one module of that width (dropout 0: the checks are deterministic)."""
    return ModelConfig(vocab_size=1, d_model=d_model, n_heads=n_heads, d_ff=d_ff, **options).resolved()


def attention_module(d_model: int, n_heads: int, bias: bool = True) -> CausalSelfAttention:
    return CausalSelfAttention(model_config(d_model, n_heads, bias=bias)).eval()


def feed_forward_module(d_model: int, d_ff: int, kind: str, bias: bool = True) -> FeedForward:
    return FeedForward(model_config(d_model, d_ff=d_ff, ffn=kind, bias=bias)).eval()


def block_module(d_model: int, n_heads: int, d_ff: int) -> Block:
    """tinylm's default block: pre-norm, LayerNorm, GELU (tanh), biases."""
    return Block(model_config(d_model, n_heads, d_ff)).eval()


def call_with_weights(module: nn.Module, weights: dict[str, torch.Tensor], *args) -> torch.Tensor:
    """``module(*args)`` with ``weights`` as its parameters, the tensors themselves (gradients
    reach them); parts stored apart (q_proj, k_proj, v_proj) are fused as loading fuses them."""
    state = dict(weights)
    for name, child in module.named_modules():
        join_parts(child, state, f"{name}." if name else "")
    return torch.func.functional_call(module, state, args)


# ------------------------------------------------------------------------------ model parts
def run_linear(x, weight, bias):
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    return call_with_weights(layer, {"weight": weight, **({"bias": bias} if bias is not None else {})}, x)


def run_embedding(ids, weight):
    return F.embedding(ids, weight)  # what GPT.tok_emb (an nn.Embedding) computes


def run_softmax(x, dim):
    return torch.softmax(x, dim=dim)


def run_scaled_dot_product_attention(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # CausalSelfAttention's path


def run_multihead_attention(x, weights, n_heads, rope):
    T, C = x.shape[-2], x.shape[-1]
    attention = attention_module(C, n_heads, bias="q_proj.bias" in weights)
    factors = None
    if rope:
        cos, sin = rope_tables(T, C // n_heads, ROPE_THETA)  # (T, D/2): positions 0 .. T-1
        factors = rope_factors(cos[None, None], sin[None, None])
    return call_with_weights(attention, weights, x, factors)


def run_layernorm(x, weight, bias, eps):
    norm = LayerNorm(x.shape[-1], eps, bias=bias is not None)
    return call_with_weights(norm, {"weight": weight, **({"bias": bias} if bias is not None else {})}, x)


def run_rmsnorm(x, weight, eps):
    return call_with_weights(RMSNorm(x.shape[-1], eps), {"weight": weight}, x)


def run_feed_forward(x, weights, kind):
    d_ff = weights["up.weight"].shape[0]
    ffn = feed_forward_module(x.shape[-1], d_ff, kind, bias="down.bias" in weights)
    return call_with_weights(ffn, weights, x)


def run_block(x, weights, n_heads):
    block = block_module(x.shape[-1], n_heads, weights["ffn.up.weight"].shape[0])
    return call_with_weights(block, weights, x)


# ---------------------------------------------------------------------------------- training
def run_cross_entropy(logits, targets, ignore_index):
    # GPT.forward's loss: the mean over the targets that are not ignore_index
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def torch_optimizer_step(optimizer: type, params, grads, state, step, **hyper) -> tuple[dict, dict]:
    """One step of a torch optimizer of the Adam family on copies of ``params``, its moments
    loaded from ``state`` as they stand after ``step - 1`` updates."""
    tensors = {name: nn.Parameter(p.detach().clone()) for name, p in params.items()}
    for name, p in tensors.items():
        p.grad = grads[name].detach().clone()
    opt = optimizer(list(tensors.values()), foreach=False, **hyper)
    for name, p in tensors.items():
        moments = state[name]
        opt.state[p] = {
            "step": torch.tensor(float(step - 1)),
            "exp_avg": moments["exp_avg"].clone(),
            "exp_avg_sq": moments["exp_avg_sq"].clone(),
        }
    opt.step()
    new_state = {name: {k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")} for name, p in tensors.items()}
    return {name: p.detach() for name, p in tensors.items()}, new_state


def run_adamw_step(params, grads, state, lr, betas, eps, weight_decay, step):
    # torch.optim.AdamW, as tinylm.training.optim.make_optimizer builds it
    return torch_optimizer_step(
        torch.optim.AdamW, params, grads, state, step, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
    )


def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    return scheduled_lr(step, max_lr, min_lr, warmup, total, "cosine")


def run_clip_grad_norm(grads, max_norm):
    tensors = {name: nn.Parameter(torch.zeros_like(g)) for name, g in grads.items()}
    for name, p in tensors.items():
        p.grad = grads[name].detach().clone()
    total = torch.nn.utils.clip_grad_norm_(list(tensors.values()), max_norm)  # as the trainer clips
    return {name: p.grad for name, p in tensors.items()}, total


# -------------------------------------------------------------------------------- generation
def run_top_k_filter(logits, k):
    return top_k_filter(logits, k)


def run_top_p_filter(logits, p):
    return top_p_filter(logits, p)
