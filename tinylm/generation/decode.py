"""One decoding step with static shapes, on weights prepared for inference (gpt-fast style).

``prepare_for_inference(model)`` lays the weights out for a one-token step: the q, k and v
projections (and SwiGLU's gate and up) concatenated into one matrix, every matrix stored
transposed, (in, out) contiguous: one ``addmm`` per projection, and the layout measured 1.3-3x
faster than ``nn.Linear``'s (out, in) for decoding-sized inputs on CPU. The result is cached on
the model (one extra copy of the weights, never saved) and rebuilt when any weight changes.

``decode_step(prepared, cache, tokens, positions)`` feeds one token per row: it writes the new keys
and values into the preallocated ``KVCache`` at a slot given as a tensor, attends over *every*
slot of the cache under a mask (slots not yet filled, and padding, are masked out), and returns
the next-token logits. All shapes are fixed by (batch, cache slots), so the same step compiles
once (``compile=True``: ``torch.compile``, paid once per process and shape) and runs eagerly
with no per-step branching on the length. Prompts are filled by the model's own ``forward``
(``generation.core.prefill``); this step is only the token-by-token part. Tests check it against
the model's cached forward and the compiled step against the eager one, token for token.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinylm.models.gpt import GPT, KVCache, apply_rope, rms_normalize, rope_factors, soft_cap
from tinylm.models.quantize import Int8Matmul, int8_kernel_of, is_quantized, quantize_transposed


def _transposed(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(in, out) weight of the Linear layers reading one input, side by side, and their biases."""
    w = torch.cat([layer.weight for layer in linears]).t().contiguous()
    b = torch.cat([layer.bias for layer in linears]) if linears[0].bias is not None else None
    return w, b


@dataclass
class PreparedLayer:
    norm1: nn.Module
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # (C, (H + 2 Hkv) D), bias; queries pre-scaled by 1/sqrt(D)
    out: tuple[torch.Tensor, torch.Tensor | None]
    norm2: nn.Module
    ffn_in: tuple[torch.Tensor, torch.Tensor | None]  # up, or gate and up side by side (SwiGLU)
    ffn_down: tuple[torch.Tensor, torch.Tensor | None]
    value_embed: torch.Tensor | None  # (V, Hkv D): added to the new token's values (model.value_embeddings)


@dataclass
class Prepared:
    """A GPT's weights laid out for ``decode_step`` (tensors only; the model's norms are reused)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qk_norm: bool
    swiglu: bool
    activation: Callable  # the feed-forward's own (GELU, ReLU, ReLU^2); SwiGLU is spelled out
    logit_softcap: float | None
    tok_emb: torch.Tensor  # (V, d_embed)
    embed_proj: torch.Tensor | None  # (d_embed, C)
    pos_table: torch.Tensor | None  # learned or sinusoidal (ctx, C)
    rope_cos: torch.Tensor | None  # (ctx, D/2)
    rope_sin: torch.Tensor | None
    layers: list[PreparedLayer]
    norm_f: nn.Module
    head: torch.Tensor | Int8Matmul  # (C, V)


def _weights_key(model: GPT) -> tuple:
    # buffers too: an int8 model's weights are buffers (its integers and scales)
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in (*model.parameters(), *model.buffers()))


def _qkv(attn, scale_queries: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k and v side by side, the query part times ``scale_queries``: the attention's
    1/sqrt(D) moves into the weights (rotary positions are linear, so they commute with it)."""
    w, b = _transposed(attn.qkv)  # a copy: the scaling below leaves the model's weights alone
    q_width = attn.n_heads * attn.head_dim
    w[:, :q_width] *= scale_queries
    if b is not None:
        b[:q_width] *= scale_queries
    return w, b


@torch.no_grad()
def prepare_for_inference(model: GPT) -> Prepared:
    """The model's weights in the decoding layout, cached on the model until a weight changes
    (an optimizer step, ``load_state_dict``, ``.to()``). Call once per generation, not per step:
    checking the weights costs about as much as a small model's step."""
    key = _weights_key(model)
    cached = model.__dict__.get("_prepared_for_inference")
    if cached is not None and cached[0] == key:
        return cached[1]
    cfg = model.config
    head_dim = cfg.d_attn // cfg.n_heads
    # with QK-norm the queries are normalised after the projection: the scale stays in the step
    scale_queries = 1.0 if cfg.qk_norm else 1.0 / math.sqrt(head_dim)
    layers = []
    for block in model.blocks:
        attn, ffn = block.attn, block.ffn
        layers.append(
            PreparedLayer(
                norm1=block.norm1,
                qkv=_qkv(attn, scale_queries),
                out=_transposed(attn.out_proj),
                norm2=block.norm2,
                ffn_down=_transposed(ffn.down),
                ffn_in=_transposed(ffn.gate_up) if ffn.swiglu else _transposed(ffn.up),
                value_embed=attn.value_embed.weight if attn.value_embed is not None else None,
            )
        )
    pos_table = {"learned": lambda: model.pos_emb.weight, "sinusoidal": lambda: model.pos_table}.get(cfg.positions)
    rope = cfg.positions == "rope"
    prepared = Prepared(
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=head_dim,
        qk_norm=cfg.qk_norm,
        swiglu=cfg.ffn == "swiglu",
        activation=model.blocks[0].ffn.activation,
        logit_softcap=cfg.logit_softcap,
        tok_emb=model.tok_emb.weight,
        embed_proj=model.embed_proj.weight.t().contiguous() if model.embed_proj is not None else None,
        pos_table=pos_table() if pos_table else None,
        rope_cos=model.rope_cos if rope else None,
        rope_sin=model.rope_sin if rope else None,
        layers=layers,
        norm_f=model.norm_f,
        head=model.lm_head.weight.t().contiguous(),
    )
    if is_quantized(model):
        _quantize_prepared(prepared, int8_kernel_of(model))
    model.__dict__["_prepared_for_inference"] = (key, prepared)
    return prepared


def _quantize_prepared(p: Prepared, kernel) -> None:
    """An int8 model's matrices in the decoding layout as int8 again: its weights are int8 values
    times per-row scales, and quantising (int8 x scale) x c per row gives back the same integers,
    so the step multiplies by exactly the model's int8 weights (the query scaling included)."""
    for layer in p.layers:
        for name in ("qkv", "out", "ffn_in", "ffn_down"):
            setattr(layer, name, quantize_transposed(*getattr(layer, name), kernel))
    p.head = quantize_transposed(p.head, None, kernel)


def _linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor | None] | Int8Matmul) -> torch.Tensor:
    if isinstance(weight, Int8Matmul):
        return weight(x)
    w, b = weight
    return torch.addmm(b, x, w) if b is not None else x @ w


def step_logits(
    p: Prepared,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slot: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """tokens (B,) at positions (B,), written to cache slot ``slot`` (1,) -> next-token logits (B, V).

    keys / values: each layer's (B, Hkv, S, D) cache; key_mask: (B, S) True = real token, or
    None when no row is padded. Every tensor keeps its shape from step to step."""
    B = tokens.shape[0]
    H, Hkv, D = p.n_heads, p.n_kv_heads, p.head_dim
    group = H // Hkv
    S = keys[0].shape[2]
    x = p.tok_emb[tokens]  # (B, d_embed)
    if p.embed_proj is not None:
        x = x @ p.embed_proj
    if p.pos_table is not None:
        x = x + p.pos_table[positions].to(x.dtype)
    rope = None
    if p.rope_cos is not None:  # (B, 1, D/2): broadcasts over the heads
        rope = rope_factors(p.rope_cos[positions][:, None], p.rope_sin[positions][:, None])
    # additive mask over every slot: 0 where a key may be seen (filled by now, not padding), -inf elsewhere
    visible = torch.arange(S, device=tokens.device) <= slot  # (S,)
    visible = visible if key_mask is None else visible & key_mask  # (S,) or (B, S)
    bias = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
    bias = bias.view(-1, 1, 1, S).expand(B, Hkv, 1, S).reshape(B * Hkv, 1, S)
    softmax_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    for layer, k_cache, v_cache in zip(p.layers, keys, values):
        qkv = _linear(layer.norm1(x), layer.qkv)  # (B, (H + 2 Hkv) D)
        qk = qkv[:, : (H + Hkv) * D].view(B, H + Hkv, D)  # every query and key head, rotated together
        if p.qk_norm:
            qk = rms_normalize(qk)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        k = qk[:, H:, None]  # (B, Hkv, 1, D)
        v = qkv[:, (H + Hkv) * D :].view(B, Hkv, 1, D)
        if layer.value_embed is not None:
            v = v + layer.value_embed[tokens].view(B, Hkv, 1, D).to(v.dtype)
        k_cache.index_copy_(2, slot, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
        v_cache.index_copy_(2, slot, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
        # the query heads sharing a kv head are rows of one product: no copy of the cached keys
        q = qk[:, :H].reshape(B * Hkv, group, D)
        if p.qk_norm:  # normalised after the projection: the 1/sqrt(D) could not go into the weights
            q = q * (D**-0.5)
        scores = torch.baddbmm(bias, q, k_cache.view(B * Hkv, S, D).transpose(1, 2))  # (B Hkv, group, S)
        weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype)
        if softmax_dtype is not None:
            weights = weights.to(v_cache.dtype)
        # baddbmm with beta=0, not bmm: on CPU inductor turns a bmm with one query row into a
        # generated loop slower than the BLAS call (0.92x eager at batch 32, bench_decode_step.py)
        values_out = weights.new_empty(B * Hkv, group, D)
        y = torch.baddbmm(values_out, weights, v_cache.view(B * Hkv, S, D), beta=0).view(B, H * D)
        x = x + _linear(y, layer.out)
        h = _linear(layer.norm2(x), layer.ffn_in)
        if p.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = p.activation(h)
        x = x + _linear(h, layer.ffn_down)
    logits = _linear(p.norm_f(x), p.head if isinstance(p.head, Int8Matmul) else (p.head, None))  # (B, V)
    if p.logit_softcap is not None:
        logits = soft_cap(logits, p.logit_softcap)
    return logits


# ------------------------------------------------------------------------------------ compiled
_compiled: dict[str, Callable] = {}  # device type -> step_logits under torch.compile
_compiled_shapes: dict[tuple, float] = {}  # (B, S, dtype, ...) -> seconds its first call took
# CPU: the C++ wrapper calls the kernels without Python in between (measured 1.2x the Python
# wrapper on stories260K at batch 1); CUDA: CUDA graphs replay the whole step as one launch
COMPILE_OPTIONS = {"cpu": dict(options={"cpp_wrapper": True}), "cuda": dict(mode="reduce-overhead")}


_limit_raised = threading.local()


def compiled_step_logits(device_type: str) -> Callable:
    """``step_logits`` under ``torch.compile`` (one compiled function per process and device type;
    each new shape compiles on its first call)."""
    if not getattr(_limit_raised, "done", False):
        import torch._dynamo  # deferred: eager decoding never loads the compiler stack

        # each (batch, cache slots) shape is one more compile; dynamo's settings are per thread,
        # so every thread that decodes (a server's scheduler thread too) raises the limit once
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _limit_raised.done = True
    if device_type not in _compiled:
        _compiled[device_type] = torch.compile(
            step_logits, dynamic=False, fullgraph=True, **COMPILE_OPTIONS.get(device_type, {})
        )
    return _compiled[device_type]


def _mark_static(prepared: Prepared, cache: KVCache) -> None:
    """Tell CUDA graphs that the weights and the cache keep their addresses from step to step: the
    graph then reads them in place and may write the cache (a graph over inputs it must copy in
    refuses in-place writes and would not be used)."""
    import torch._dynamo  # deferred: eager decoding never loads the compiler stack

    marked = (id(prepared), cache.k[0].data_ptr())  # a beam search's first reorder makes new cache tensors
    if getattr(cache, "_marked_static", None) == marked:
        return
    weights = [
        prepared.tok_emb,
        prepared.head,
        prepared.embed_proj,
        prepared.pos_table,
        prepared.rope_cos,
        prepared.rope_sin,
    ]
    for layer in prepared.layers:
        weights += [*layer.qkv, *layer.out, *layer.ffn_in, *layer.ffn_down, layer.value_embed]
    for t in (*weights, *cache.k, *cache.v):
        if t is not None:
            torch._dynamo.mark_static_address(t)
    cache._marked_static = marked


def decode_step(
    prepared: Prepared,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Feed ``tokens`` (B,) into ``cache`` at its next slot; returns the next-token logits (B, V).

    prepared: ``prepare_for_inference(model)``; positions: (B,) the tokens' positions
    (left-padded rows); default: the slot index. Call under ``torch.inference_mode()``."""
    if cache.length >= cache.max_len:
        raise ValueError(f"the KV cache is full ({cache.max_len} slots); re-prefill a shorter window")
    slot = torch.tensor([cache.length], device=tokens.device)
    if positions is None:
        positions = slot.expand(tokens.shape[0])
    args = (prepared, cache.k, cache.v, tokens, positions, slot, cache.key_mask)
    if not compile:
        logits = step_logits(*args)
    else:
        # what the compiled code is specialised on: shapes, dtype, device, padding (not the weights' values)
        shape = (
            tuple(cache.k[0].shape),
            len(cache.k),
            cache.k[0].dtype,
            tokens.device.type,
            cache.key_mask is None,
            type(prepared.head).__name__,
            tuple(prepared.head.shape),
        )
        first = shape not in _compiled_shapes
        t0 = time.perf_counter()
        cuda = tokens.device.type == "cuda"
        if cuda:  # CUDA graphs: a new step may reuse the last step's output memory
            _mark_static(prepared, cache)
            torch.compiler.cudagraph_mark_step_begin()
        logits = compiled_step_logits(tokens.device.type)(*args)
        if cuda:
            logits = logits.clone()
        if first:
            _compiled_shapes[shape] = time.perf_counter() - t0
            print(
                f"compiled the decoding step for batch {cache.batch_size} x {cache.max_len} cache slots in "
                f"{_compiled_shapes[shape]:.1f} s (once per process and shape)",
                file=sys.stderr,
            )
    cache.length += 1
    return logits
