"""A decoder-only transformer built from PyTorch primitives, in one file.

Reading order: norms -> positions -> attention (with its KV cache) -> feed-forward -> block -> GPT.
Shapes in comments: B batch, T new tokens, S keys attended (cache + new), C d_model,
H heads, Hkv key/value heads, D head width.

Defaults are the seed architecture (pre-LN, learned positions, LayerNorm, GELU, biases, tied
weights). Options cover the checkpoints people bring: RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases (llama2.c / Llama shape).

This file is the one forward pass: training, evaluation, filling a KV cache with a prompt and
the one-token decoding step (``GPT.forward(..., cache_slot=)``; compiled: static shapes, every
cache slot attended under a mask, so one compiled step serves every length; eager: the filled
slots, and rows joining the step may read their whole prompts in it, ``StepPrompts``).
``GPT.prepare_for_decoding`` switches the projections to a layout measured faster for one-token
rows; tests check every path against the uncached forward and against Hugging Face to 1e-5.

Inside a block, submodules are run through ``.forward`` rather than called: at batch 1 on a
2-core CPU a module call's hook machinery costs about as much as a one-token product, and the
decoding step makes a dozen per layer. Hooks belong on blocks (the logit lens puts them there),
which the model does call.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinylm.config import ModelConfig
from tinylm.constants import IGNORE_INDEX
from tinylm.models import cpu_attention

_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


# ---------------------------------------------------------------------------------------- norms
class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel, forward and backward: measured (torch 2.13, CPU) 2-5x faster than
        # the same arithmetic in var_mean / rsqrt / addcmul, for a training batch and for a decoding row
        return torch.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


QK_NORM_EPS = 1e-6  # the epsilon of QK-norm without gain (with one, model.norm_eps, as Qwen3)


def rms_normalize(x: torch.Tensor, eps: float = QK_NORM_EPS) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, no gain (RMSNorm's core; QK-norm)."""
    # sum * (1/D) rather than mean(): same value, and mean() costs several times more per call
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) * (1.0 / x.shape[-1]) + eps)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (no centring, no bias), as in Llama."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (F.rms_norm is not a fused kernel on CPU and measured slower than these few ops)
        if x.dtype in (torch.float32, torch.float64):  # no cast calls: decoding runs this 2 x layers per token
            return rms_normalize(x, self.eps) * self.weight
        return rms_normalize(x.float(), self.eps).type_as(x) * self.weight


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, cfg.norm_eps, cfg.bias)


# ------------------------------------------------------------------------------------ positions
def sinusoidal_table(n_positions: int, dim: int) -> torch.Tensor:
    """The fixed sin/cos table of "Attention is all you need": (n_positions, dim)."""
    pos = torch.arange(n_positions, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_positions, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table


def rope_tables(n_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles: each (n_positions, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``apply_rope``'s last arguments for the angles at some positions, built once per forward
    (not per layer): cos and sin in at least float32 (a bfloat16 model rotates in float32) and
    cos + i sin, which compiled code goes without (it rotates in reals)."""
    if cos.dtype not in (torch.float32, torch.float64):
        cos, sin = cos.float(), sin.float()
    return (cos, sin) if torch.compiler.is_compiling() else (cos, sin, torch.complex(cos, sin))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cis: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1), (x2, x3), ... (the Meta / llama2.c layout).

    x: (B, H, T, D); cos, sin: (B, 1, T, D/2) (or any shapes that broadcast alike); cis:
    optionally cos + i sin, precomputed once per forward. Each pair is one complex number times
    cis: (x0 cos - x1 sin, x0 sin + x1 cos), in a handful of ops instead of a dozen (decoding
    runs this once per layer per token).
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if torch.compiler.is_compiling():  # inductor makes no code for complex numbers: the same rotation in reals
        x0, x1 = xf.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)
    if cis is None:
        cis = torch.complex(cos, sin)
    if xf.dtype == torch.float64:  # float64 models keep their precision
        cis = cis.to(torch.complex128)
    pairs = torch.view_as_complex(xf.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * cis).flatten(-2).type_as(x)


# ------------------------------------------------------------------------------------ KV cache
class KVCache:
    """Keys and values of every layer, preallocated to ``max_len`` slots: no growing torch.cat.

    All rows of a batch share the slot index; a left-padded batch marks its padding slots in
    ``key_mask`` so that no query attends to them (slots that decoding will fill must be marked
    True up front: a one-token step reads the mask as is).
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device, dtype):
        head_dim = cfg.d_attn // cfg.n_heads
        shape = (batch_size, cfg.n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.length = 0  # slots filled so far
        self.key_mask: torch.Tensor | None = None  # (B, max_len) bool, True = real token

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        """Memory the keys and values take (every slot, filled or not)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def reorder(self, rows: torch.Tensor, start: int = 0) -> None:
        """Keep / duplicate batch rows (beam search, rows leaving a batch): row i becomes old row
        ``rows[i]``.

        With an unchanged batch size only the rows that change and only their filled slots from
        ``start`` are copied, in place (a beam step must not reallocate or rewrite the whole
        preallocated cache; most beams keep their own row, and the slots before ``start`` hold
        the same keys in every row a beam can come from); a new size (one prompt row expanded to
        k beams) builds new tensors.
        """
        same_size = rows.numel() == self.batch_size
        if same_size:
            n = self.length
            moved = (rows != torch.arange(rows.numel(), device=rows.device)).nonzero().squeeze(1)
            if moved.numel() == 1 and start < n:  # a row leaving a batch: the last row takes its place
                to, source = int(moved), int(rows[moved])  # one copy per tensor, no gather first
                for t in (*self.k, *self.v):
                    t[to, :, start:n].copy_(t[source, :, start:n])
            elif moved.numel() and start < n:
                sources = rows.index_select(0, moved)
                for t in (*self.k, *self.v):
                    filled = t[:, :, start:n]
                    filled.index_copy_(0, moved, filled.index_select(0, sources))
        else:
            self.k = [k.index_select(0, rows) for k in self.k]
            self.v = [v.index_select(0, rows) for v in self.v]
        if self.key_mask is not None and same_size:
            self.key_mask.copy_(self.key_mask.index_select(0, rows))  # in place: it may be a view of more rows
        elif self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)


@dataclass
class StepPrompts:
    """Rows joining a decoding step with their whole prompts (``step_prompts``): the step's rows
    feed one token each and these rows their P prompt tokens, in one forward, so that a row
    joining a running batch costs a few more rows of the step's products rather than a forward
    of its own. Each prompt is right-aligned with the step's slot (its last token is written
    where the step's rows write theirs) in its own cache row, from ``first_row`` on."""

    tokens: torch.Tensor  # (P,) every prompt's tokens, one prompt after another
    positions: torch.Tensor  # (P,) their positions (each prompt from 0)
    rows: torch.Tensor  # (P,) each token's cache row
    slots: torch.Tensor  # (P,) each token's cache slot
    grid: torch.Tensor  # (P,) each token's place in the (prompts, width) grid, left-padded
    last: torch.Tensor  # (prompts,) where each prompt's last token is among the P
    mask: torch.Tensor  # (prompts, 1, width, width) True = may attend (causal, real keys, padding sees itself)
    bias: torch.Tensor  # (P, 1, slot + 1) float32, 0 where a token may attend, -inf elsewhere (the C loops' mask)
    first_row: int
    slot: int  # the step's slot


def step_prompts(prompts: list[list[int]], first_row: int, slot: int, device) -> StepPrompts:
    """The ``StepPrompts`` of ``prompts`` joining a step at cache slot ``slot``, in cache rows
    ``first_row``, ``first_row + 1``, ... (each prompt fits before the slot: len <= slot + 1)."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    if width > slot + 1:
        raise ValueError(f"a prompt of {width} tokens does not fit before cache slot {slot}")
    offsets = [width - n for n in lengths]  # each prompt's left padding in the grid
    grid = [j * width + offsets[j] + t for j, n in enumerate(lengths) for t in range(n)]
    rows = [first_row + j for j, n in enumerate(lengths) for _ in range(n)]
    positions = [t for n in lengths for t in range(n)]
    real = torch.arange(width, device=device)[None, :] >= torch.tensor(offsets, device=device)[:, None]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    own = torch.eye(width, dtype=torch.bool, device=device)  # a padding query sees itself: no empty softmax
    as_long = partial(torch.tensor, dtype=torch.long, device=device)
    slots = as_long([slot + 1 - width + g % width for g in grid])
    # each token sees its own prompt's slots up to its own: from the prompt's first slot to its slot
    firsts = as_long([slot + 1 - n for n in lengths for _ in range(n)])
    every = torch.arange(slot + 1, device=device)
    seen = (every >= firsts[:, None]) & (every <= slots[:, None])
    return StepPrompts(
        tokens=as_long([t for p in prompts for t in p]),
        positions=as_long(positions),
        rows=as_long(rows),
        slots=slots,
        grid=as_long(grid),
        last=as_long(list(itertools.accumulate(lengths))) - 1,
        mask=((causal & real[:, None, :]) | own)[:, None],
        bias=torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))[:, None],
        first_row=first_row,
        slot=slot,
    )


# ------------------------------------------------------------------------------ linear maps
BLOCKED_MIN_ROWS = 16  # fewer rows: MKL's products are as fast (oneDNN's call costs about 10 us more)


class DecodeLayout(NamedTuple):
    """A projection's weights as the decoding step reads them (never saved).

    ``weight_t``: the weight transposed to (in, out) and contiguous, measured 1.3-3x faster than
    ``nn.Linear``'s (out, in) for the few rows of a decoding step on CPU. ``blocked``: on a CPU
    with oneDNN, the float32 weight in oneDNN's blocked layout, for steps of ``BLOCKED_MIN_ROWS``
    rows or more: MKL packs the weight anew on every product, about a third of a 32-row product's
    time in the server, where the weights are out of cache between steps; the blocked copy is
    packed once, and an activation after it runs inside the product (the tanh GELU). Measured on
    the demo model's step (docs/notes/issue-41.md): 5-9% faster at 16 and 32 rows, the same at 1.
    oneDNN builds a kernel for each row count at its first product (about a millisecond):
    ``GPT.warm_blocked_products`` builds a server's at its start."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None
    blocked: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> None:
        """A copied model has none (oneDNN's blocked tensor cannot be copied): its own weights get
        theirs at its first ``prepare_for_decoding``."""
        return None

    def product(self, x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
        """x (rows, in) times the weight, plus the bias; then the tanh GELU where asked."""
        weight_t, bias, blocked = self  # unpacked: a step makes a product per projection
        if (
            blocked is not None
            and x.shape[0] >= BLOCKED_MIN_ROWS
            and x.dtype is torch.float32
            and not x.requires_grad
            and not torch.compiler.is_compiling()
        ):
            post = ("gelu", "tanh") if gelu_tanh else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, post[0], [], post[1])
        y = x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)
        return F.gelu(y, approximate="tanh") if gelu_tanh else y


def blocked_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` (out, in); None where it does not apply (not float32 on
    the CPU, torch built without oneDNN)."""
    if weight.dtype is not torch.float32 or not weight.is_cpu or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 32)  # 32: the rows it is laid out for
    except (AttributeError, RuntimeError):  # an op this build of torch does not have
        return None


class Linear(nn.Linear):
    """``nn.Linear`` with an optional decoding layout, ``decode_layout`` (``DecodeLayout``). A
    (rows, in) input -- the decoding step's shape; training and prefill pass (B, T, in) -- uses it
    when set. ``GPT.prepare_for_decoding``, which the decoding core calls whenever it prefills rows
    (a generation's first step; rows joining a running batch step with the layouts it began with),
    sets it and renews it when a weight changed since."""

    decode_layout: DecodeLayout | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.decode_layout
        if layout is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        return layout.product(x)


class FusedLinear(Linear):
    """Linear maps of one input stacked into one weight, so that they cost one matrix product
    (attention's q, k, v; SwiGLU's gate and up): output rows in ``parts`` order, ``parts`` naming
    each map and its row count. Each part is still its own matrix to initialisation and to Muon
    (``split_sizes``), and keeps its own name in formats that store the parts apart (Hugging Face,
    llama2.c, state dicts naming ``q_proj``): ``join_parts`` reads those, ``state_dict_by_parts``
    writes them."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.part_names = tuple(parts)
        self.split_sizes = tuple(parts.values())


def join_parts(module: nn.Module, state_dict: dict, prefix: str, *_args) -> None:
    """Load-state-dict pre-hook of a module holding ``FusedLinear`` children: a state dict that
    names the parts separately (``attn.q_proj.weight``, ...) gets them concatenated under the
    fused name. A state dict with only some of the parts is left alone, so loading names them."""
    for name, child in module.named_children():
        if not isinstance(child, FusedLinear):
            continue
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{part}.{kind}" for part in child.part_names]
            if f"{prefix}{name}.{kind}" not in state_dict and all(k in state_dict for k in keys):
                state_dict[f"{prefix}{name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])


def split_sizes_by_parameter(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """id(weight) -> its parts' row counts, for every ``FusedLinear`` in ``model``."""
    return {id(m.weight): m.split_sizes for m in model.modules() if isinstance(m, FusedLinear)}


def state_dict_by_parts(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (or ``state``, a dict under the same names, e.g. gradients) with every
    ``FusedLinear`` weight and bias split into its parts' own names (views): the layout of formats
    that store q, k, v (gate, up) separately."""
    state = dict(model.state_dict() if state is None else state)
    for name, module in model.named_modules():
        if not isinstance(module, FusedLinear):
            continue
        parent = name.rpartition(".")[0]
        for kind in ("weight", "bias"):
            fused = state.pop(f"{name}.{kind}", None)
            if fused is None:
                continue
            for part, tensor in zip(module.part_names, fused.split(module.split_sizes)):
                state[f"{parent}.{part}.{kind}" if parent else f"{part}.{kind}"] = tensor
    return state


# ------------------------------------------------------------------------------------ attention
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; ``layer`` (its block's index) decides whether it owns a
    value-embedding table (``ModelConfig.value_embeddings``), read with the token ids ``idx``."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_attn // cfg.n_heads
        self.impl = cfg.attention
        self.qk_norm = cfg.qk_norm
        self.qk_eps = cfg.norm_eps if cfg.qk_norm_weight else QK_NORM_EPS
        if cfg.qk_norm_weight:  # Qwen3's q_norm and k_norm: one gain over the head dimension each
            self.q_norm = nn.Parameter(torch.ones(self.head_dim))
            self.k_norm = nn.Parameter(torch.ones(self.head_dim))
        self.qk_norm_weight = cfg.qk_norm_weight
        self.dropout = cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout  # on the weights
        kv_width = cfg.n_kv_heads * self.head_dim
        self.qkv = FusedLinear(
            cfg.d_model, {"q_proj": cfg.n_heads * self.head_dim, "k_proj": kv_width, "v_proj": kv_width}, bias=cfg.bias
        )
        self._register_load_state_dict_pre_hook(join_parts, with_module=True)
        self.out_proj = Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.value_embed = nn.Embedding(cfg.vocab_size, kv_width) if cfg.has_value_embedding(layer) else None

    def forward(
        self, x, rope=None, mask=None, kv_cache=None, layer=0, attention_out=None, idx=None, slot=None, prompts=None
    ):
        """x (B, T, C) -> (B, T, C); or, with ``slot`` (the decoding step), x (B, C) -> (B, C): the
        new keys and values go into cache slot ``slot`` and ``mask`` is the additive mask over
        the slots attended, (B Hkv, 1, S) (``GPT._step_mask``). With ``prompts`` (``StepPrompts``)
        the last P of the B rows are joining rows' prompt tokens."""
        B, T = x.shape[0], 1 if slot is not None else x.shape[1]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        # one matrix product for q, k and v, then views of its heads: (B, H + 2 Hkv, T, D)
        qkv = self.qkv.forward(x).view(B, T, H + 2 * Hkv, D).transpose(1, 2)
        qk, v = qkv[:, : H + Hkv], qkv[:, H + Hkv :]  # queries and keys are normalised and rotated together
        if self.value_embed is not None:  # before the cache: decoding reads the values with it added
            v = v + self.value_embed.forward(idx).view(B, T, Hkv, D).transpose(1, 2).to(v.dtype)
        if self.qk_norm:  # unit RMS per head: bounded attention logits whatever the weights' scale
            qk = rms_normalize(qk, self.qk_eps)
            if self.qk_norm_weight:  # the query heads' gain, then the key heads' (qk holds H + Hkv heads)
                gain = torch.cat([self.q_norm.expand(H, D), self.k_norm.expand(Hkv, D)])
                qk = qk * gain.view(H + Hkv, 1, D).to(qk.dtype)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        q, k = qk[:, :H], qk[:, H:]  # (B, H, T, D), (B, Hkv, T, D)
        if slot is not None and prompts is None:
            return self.out_proj.forward(self._attend_every_slot(q, k, v, kv_cache, layer, slot, mask))
        if slot is not None:  # the step's rows first, then the joining prompts' tokens
            n = B - prompts.tokens.numel()
            y = self._attend_every_slot(q[:n], k[:n], v[:n], kv_cache, layer, slot, mask)
            y = torch.cat([y, self._attend_prompts(q[n:], k[n:], v[n:], kv_cache, layer, prompts)])
            return self.out_proj.forward(y)
        if kv_cache is not None:
            start = kv_cache.length
            kv_cache.k[layer][:, :, start : start + T] = k
            kv_cache.v[layer][:, :, start : start + T] = v
            k = kv_cache.k[layer][:, :, : start + T]  # (B, Hkv, S, D)
            v = kv_cache.v[layer][:, :, : start + T]
        dropout_p = self.dropout if self.training else 0.0
        use_sdpa = self.impl == "sdpa" and attention_out is None
        if self.n_kv_heads != self.n_heads and not (use_sdpa and _SDPA_GQA):
            # grouped-query attention: each kv head serves n_heads / n_kv_heads query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)

        if use_sdpa:
            gqa = {"enable_gqa": True} if self.n_kv_heads != self.n_heads and _SDPA_GQA else {}
            # no mask: plain causal over the new tokens (no cache, or a cache being filled)
            causal = mask is None and T > 1
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, **gqa)
        else:
            # the hand-written path: scores, causal mask, softmax, weighted sum
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, H, T, S)
            if mask is None:
                S = k.shape[-2]
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            scores = scores.masked_fill(~mask, float("-inf"))
            # softmax in at least float32 (bf16/fp16 autocast), in float64 when the model is float64
            weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).type_as(q)
            if attention_out is not None:
                attention_out.append(weights.detach())
            weights = F.dropout(weights, p=dropout_p, training=self.training)
            y = weights @ v  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        y = self.out_proj.forward(y)
        return self.resid_dropout(y) if self.training else y

    def _attend_every_slot(self, q, k, v, kv_cache, layer, slot, mask_bias) -> torch.Tensor:
        """The decoding step's attention: q (B, H, 1, D), k and v (B, Hkv, 1, D) written at
        ``slot``, attending over the first S slots of the cache, S the mask's width
        (``GPT._step_mask``); returns (B, H D)."""
        B, H, Hkv, D = q.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        if B < k_cache.shape[0]:  # the first B rows (joining rows follow): still views that merge rows and heads
            k_cache, v_cache = k_cache[:B], v_cache[:B]
        if k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        S = mask_bias.shape[-1]
        every_slot = k_cache, v_cache
        if S < k_cache.shape[2]:  # the first S slots of every row: still a view (rows and heads merge)
            k_cache, v_cache = k_cache[:, :, :S], v_cache[:, :, :S]
        # the query heads sharing a kv head are rows of one product: no copy of the cached keys
        q, keys, values = q.reshape(B * Hkv, H // Hkv, D), k_cache.view(B * Hkv, S, D), v_cache.view(B * Hkv, S, D)
        out = cpu_attention.attend(q, keys, values, mask_bias, D**-0.5, (k, v, slot))  # float32 on the CPU: C loops
        if out is None:  # the C loops did not apply, and wrote nothing
            every_slot[0].index_copy_(2, slot, k)
            every_slot[1].index_copy_(2, slot, v)
            out = step_attention_products(q, keys, values, mask_bias, D**-0.5)
        return out.view(B, H * D)

    def _attend_prompts(self, q, k, v, kv_cache, layer, p: StepPrompts) -> torch.Tensor:
        """The joining prompts' attention in a step: q, k, v (P, H or Hkv, 1, D), one row per
        prompt token; their keys and values go into their rows' slots, then each prompt attends
        causally over its own: in the C loops (float32 on the CPU), one query row per token and
        kv head, else as a left-padded grid of prompts; returns (P, H D)."""
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
        S, P, R = p.slot + 1, q.shape[0], k_cache.shape[0]
        # the slots up to the step's, every cache row's: still views (rows and heads merge)
        keys, values = k_cache[:, :, :S].view(R * Hkv, S, D), v_cache[:, :, :S].view(R * Hkv, S, D)
        queries = q.reshape(P * Hkv, H // Hkv, D)
        out = cpu_attention.attend(queries, keys, values, p.bias, D**-0.5, (k, v, p.slots), rows=p.rows)
        if out is not None:  # else the C loops did not apply, and wrote nothing
            return out.view(P, H * D)
        k_cache[p.rows, :, p.slots] = k[:, :, 0].to(k_cache.dtype)
        v_cache[p.rows, :, p.slots] = v[:, :, 0].to(v_cache.dtype)
        J, _, W, _ = p.mask.shape  # prompts, the longest prompt
        window = slice(p.slot + 1 - W, p.slot + 1)
        keys, values = (
            k_cache[p.first_row : p.first_row + J, :, window],
            v_cache[p.first_row : p.first_row + J, :, window],
        )
        if Hkv != H:
            keys, values = keys.repeat_interleave(H // Hkv, dim=1), values.repeat_interleave(H // Hkv, dim=1)
        queries = q.new_zeros(J * W, H, D).index_copy_(0, p.grid, q[:, :, 0]).view(J, W, H, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=p.mask)
        return y.transpose(1, 2).reshape(J * W, H * D).index_select(0, p.grid)


def step_attention_products(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """The decoding step's attention as batched products, where ``cpu_attention.attend`` does not
    apply: softmax(scale q keys^T + mask_bias) values for q (BH, G, D), keys and values (BH, S, D),
    the softmax in at least float32."""
    scores = torch.baddbmm(mask_bias, q, keys.transpose(1, 2), alpha=scale)
    low_precision = scores.dtype in (torch.float16, torch.bfloat16)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32 if low_precision else None)
    if low_precision:
        weights = weights.to(values.dtype)
    # baddbmm with beta=0, not bmm: on CPU inductor turns a bmm with one query row into a
    # generated loop slower than the BLAS call (0.92x eager at batch 32, bench_decode_step.py)
    return torch.baddbmm(weights.new_empty(q.shape), weights, values, beta=0)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): a smooth bound, |logit| <= cap."""
    return cap * torch.tanh(logits / cap)


# --------------------------------------------------------------------------------- feed-forward
def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class FeedForward(nn.Module):
    """GELU MLP (GPT-2), ReLU MLP (the original Transformer), ReLU^2 MLP (Primer, nanochat) or SwiGLU
    (Llama: w2(silu(w1 x) * w3 x), with w1 and w3 one ``gate_up`` matrix, gate rows first)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.ffn == "swiglu"
        gelu = partial(F.gelu, approximate="tanh")  # tanh: GPT-2's gelu_new
        self.activation = {"relu": F.relu, "relu2": relu_squared}.get(cfg.ffn, gelu)
        self.tanh_gelu = cfg.ffn == "gelu"
        if self.swiglu:
            self.gate_up = FusedLinear(cfg.d_model, {"gate": cfg.d_ff, "up": cfg.d_ff}, bias=cfg.bias)
            self._register_load_state_dict_pre_hook(join_parts, with_module=True)
        else:
            self.up = Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down = Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_up.forward(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.tanh_gelu and x.dim() == 2 and getattr(self.up, "decode_layout", None) is not None:
            h = self.up.decode_layout.product(x, gelu_tanh=True)  # the decoding step (an int8 up has no layout)
        else:
            h = self.activation(self.up.forward(x))
        h = self.down.forward(h)
        return self.dropout(h) if self.training else h  # no module call per decoding step


class Block(nn.Module):
    """Pre-LN residual block: x + attn(norm(x)), then x + ffn(norm(x)). ``idx``, the token ids, is
    read only by a block with a value-embedding table."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.norm2 = make_norm(cfg)
        self.ffn = FeedForward(cfg)

    def forward(
        self, x, rope=None, mask=None, kv_cache=None, layer=0, attention_out=None, idx=None, slot=None, prompts=None
    ):
        x = x + self.attn.forward(self.norm1.forward(x), rope, mask, kv_cache, layer, attention_out, idx, slot, prompts)
        return x + self.ffn.forward(self.norm2.forward(x))


# ---------------------------------------------------------------------------------------- model
class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_embed)
        # pretrained vectors narrower/wider than d_model (e.g. 300-d FastText): a learned projection
        self.embed_proj = Linear(cfg.d_embed, cfg.d_model, bias=False) if cfg.d_embed != cfg.d_model else None
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)
        elif cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.context_length, cfg.d_model), persistent=False)
        elif cfg.positions == "rope":
            cos, sin = rope_tables(cfg.context_length, cfg.d_attn // cfg.n_heads, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.norm_f = make_norm(cfg)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers); or
        Xavier-uniform for every matrix (embeddings included). Biases 0, norm weights 1. With
        ``zero_init_out`` the residual output projections start at zero instead."""
        fused = split_sizes_by_parameter(self)
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "down.weight")) and self.config.zero_init_out:
                nn.init.zeros_(p)  # each block starts as the identity; its first update opens it
            elif p.dim() >= 2:
                residual = name.endswith(("out_proj.weight", "down.weight"))
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if residual else 0.02
                # a fused weight's parts one by one: Xavier's bound depends on each part's shape
                for part in p.data.split(fused.get(id(p), p.shape[0])):
                    if self.config.init == "xavier":
                        nn.init.xavier_uniform_(part)
                    else:
                        nn.init.normal_(part, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # norm weights
                nn.init.ones_(p)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @torch.no_grad()
    def prepare_for_decoding(self) -> None:
        """Give every projection its decoding layout (``Linear.decode_layout``: a transposed copy of
        the weights and, where it applies, oneDNN's blocked copy; never saved), or renew it when a
        weight changed since (an optimizer step, ``load_state_dict``, ``.to()``). Call once per
        generation, not per step: checking the weights costs about as much as a small model's step.
        An int8 model's layers already hold their integers in that layout (``models.quantize``)."""
        # buffers too: an int8 model's weights are buffers (its integers and scales)
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in (*self.parameters(), *self.buffers()))
        if self.__dict__.get("_decoding_layout_of") == key:
            return
        for module in self.modules():
            if isinstance(module, Linear):
                bias = None if module.bias is None else module.bias.detach()
                weight = module.weight.detach()
                module.decode_layout = DecodeLayout(weight.t().contiguous(), bias, blocked_weight(weight))
        self.__dict__["_decoding_layout_of"] = key

    @torch.inference_mode()
    def warm_blocked_products(self, most_rows: int) -> None:
        """Run every blocked product (``DecodeLayout``) once for each row count from
        ``BLOCKED_MIN_ROWS`` to ``most_rows``. oneDNN builds its kernel for a row count at that
        count's first product, about a millisecond against tens of microseconds after; a server's
        steps take many row counts (its rows plus the tokens of the prompts joining), and built at
        its start, no request waits for them."""
        self.prepare_for_decoding()
        gelu_ups = {id(m.up) for m in self.modules() if isinstance(m, FeedForward) and m.tanh_gelu}
        for module in self.modules():
            layout = getattr(module, "decode_layout", None)
            if layout is None or layout.blocked is None:
                continue
            gelu = id(module) in gelu_ups  # the up projection's product has the GELU inside
            for rows in range(BLOCKED_MIN_ROWS, most_rows + 1):
                layout.product(layout.weight_t.new_zeros(rows, layout.weight_t.shape[0]), gelu_tanh=gelu)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        p = self.tok_emb.weight
        return KVCache(self.config, batch_size, max_len or self.config.context_length, p.device, p.dtype)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        cache_slot: torch.Tensor | None = None,
        step_prompts: StepPrompts | None = None,
        loss_reduction: str = "mean",
        label_smoothing: float = 0.0,
        attention_out: list | None = None,
        last_logits_only: bool = False,
        document_start: int | None = None,
        checkpoint_blocks: Callable | None = None,
    ):
        """idx (B, T) token ids -> (logits (B, T, V), loss or None).

        targets: (B, T) next-token ids, IGNORE_INDEX where nothing is predicted (padding).
        kv_cache: append this call's keys/values and attend over everything cached so far.
        position_ids: (B, T) per-row positions (left-padded batches); default start..start+T-1.
        cache_slot: the one-token decoding step (idx (B, 1)): a (1,) tensor holding
            ``kv_cache.length``, the cache slot its keys and values go to; position_ids is then
            (B,). Under ``torch.compile`` every slot of the cache is attended under its key mask,
            so shapes stay fixed and one compiled step serves every length; eager, only the
            filled slots are (the rest are masked anyway, and reading them costs as much as the
            keys themselves). The cache's ``length`` is the caller's to advance
            (``generation.decode.decode_step``).
        step_prompts: with ``cache_slot`` (eager), joining rows' prompts: logits (B + prompts, 1, V).
        last_logits_only: compute logits for the last position only, (B, 1, V) (generation:
            the output head is a large share of a prompt's compute).
        attention_out: a list to receive each layer's attention weights (B, H, T, S) (forces the
            hand-written attention path, since SDPA does not return weights).
        document_start: the token id that opens a document (``<sos>``): each token attends only to
            the earlier tokens of its own document in the window, not across a packed boundary.
        checkpoint_blocks: a function (block, x, rope, mask, idx) -> x run instead of each block
            while training without a cache (gradient checkpointing: it recomputes in backward).
        """
        if cache_slot is not None:
            return self._step(idx, kv_cache, position_ids, cache_slot, step_prompts)
        cfg = self.config
        B, T = idx.shape
        start = kv_cache.length if kv_cache is not None else 0
        if start + T > cfg.context_length or (kv_cache is not None and start + T > kv_cache.max_len):
            raise ValueError(f"sequence of {start + T} tokens exceeds the context length {cfg.context_length}")
        if position_ids is None:  # a slice of the tables: no index tensor to build and gather from
            position_ids = slice(start, start + T)
        x, rope = self._embed(idx, position_ids)
        if self.training:
            x = self.drop(x)

        if document_start is not None:
            if kv_cache is not None:
                raise ValueError("document_start (attention within documents) is for whole windows, not a KV cache")
            mask = document_mask(idx, document_start)
        else:
            mask = self._attention_mask(T, start, kv_cache, idx.device)
        for layer, block in enumerate(self.blocks):
            if checkpoint_blocks is not None and self.training and kv_cache is None:
                x = checkpoint_blocks(block, x, rope, mask, idx)
            else:
                x = block(x, rope, mask, kv_cache, layer, attention_out, idx)
        if kv_cache is not None:
            kv_cache.length = start + T
        if last_logits_only and targets is None:  # generation needs the next-token logits only
            x = x[:, -1:]
        logits = self.read_out(x)  # (B, T, V)

        if targets is None:
            return logits, None
        # at least float32 for the loss; a float64 model keeps float64 (exactness tests)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32)).view(-1, logits.size(-1))
        loss = F.cross_entropy(
            wide,
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction=loss_reduction,
            label_smoothing=label_smoothing,
        )
        return logits, loss

    def _embed(self, idx: torch.Tensor, positions) -> tuple[torch.Tensor, tuple | None]:
        """Token (and absolute position) embeddings of ``idx``, and the rotary factors.

        positions: a slice (every row at start..start+T-1), (B, T) per-row positions, or, for the
        decoding step, (B,) with idx (B,); the tables' rows come back as (1 or B, T, ...) or (B, ...)."""
        cfg = self.config
        x = self.tok_emb.forward(idx)  # (B, T, d_embed)
        if self.embed_proj is not None:
            x = self.embed_proj.forward(x)  # -> (B, T, C)

        def at_positions(table: torch.Tensor) -> torch.Tensor:
            return table[positions][None] if isinstance(positions, slice) else table[positions]

        if cfg.positions == "learned":
            x = x + at_positions(self.pos_emb.weight)
        elif cfg.positions == "sinusoidal":
            x = x + at_positions(self.pos_table).to(x.dtype)
        rope = None
        if cfg.positions == "rope":
            cos, sin = at_positions(self.rope_cos), at_positions(self.rope_sin)
            if idx.dim() == 1:  # the step: (B, D/2) -> (B, 1, 1, D/2), over heads and its one position
                cos, sin = cos[:, None], sin[:, None]
            rope = rope_factors(cos[:, None], sin[:, None])
        return x, rope

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        """A residual stream (B, T, C) or (B, C) through the final norm, the head and the soft-cap."""
        logits = self.lm_head.forward(self.norm_f.forward(x))
        return soft_cap(logits, self.config.logit_softcap) if self.config.logit_softcap is not None else logits

    def _step(
        self,
        idx: torch.Tensor,
        kv_cache: KVCache,
        positions: torch.Tensor | None,
        slot: torch.Tensor,
        prompts: StepPrompts | None = None,
    ) -> tuple[torch.Tensor, None]:
        """The one-token decoding step (``forward`` with ``cache_slot``): rows of (B, C) throughout,
        which is what switches the projections to their decoding layout (``Linear``). Joining
        prompts' tokens are more such rows, after the step's."""
        tokens = idx.view(-1)  # (B,)
        B = tokens.shape[0]
        positions = slot.expand(B) if positions is None else positions
        if prompts is not None:
            tokens, positions = torch.cat([tokens, prompts.tokens]), torch.cat([positions, prompts.positions])
        x, rope = self._embed(tokens, positions)
        mask = self._step_mask(kv_cache, slot, x.dtype, B)
        for layer, block in enumerate(self.blocks):
            x = block.forward(x, rope, mask, kv_cache, layer, None, tokens, slot, prompts)
        if prompts is not None:  # each row's next-token logits: the step's rows, then each prompt's last token
            x = torch.cat([x[:B], x[B:].index_select(0, prompts.last)])
        return self.read_out(x)[:, None], None

    def _step_mask(self, kv_cache: KVCache, slot: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """Additive mask (B Hkv, 1, S) of the cache's first ``rows`` rows (B): 0 where a key may be
        seen (filled by now and not padding), -inf elsewhere (slots after ``slot`` are not written yet)."""
        B, Hkv = rows, self.config.n_kv_heads
        # compiled: every slot (one shape for every length); eager: the slots filled so far and this one
        S = kv_cache.max_len if torch.compiler.is_compiling() else kv_cache.length + 1
        visible = torch.arange(S, device=slot.device) <= slot  # (S,)
        if kv_cache.key_mask is not None:
            visible = visible & kv_cache.key_mask[:B, :S]  # (B, S)
        bias = torch.zeros(visible.shape, dtype=dtype, device=slot.device).masked_fill_(~visible, float("-inf"))
        return bias.view(-1, 1, 1, S).expand(B, Hkv, 1, S).reshape(B * Hkv, 1, S)

    @staticmethod
    def _attention_mask(T: int, start: int, kv_cache: KVCache | None, device) -> torch.Tensor | None:
        """Boolean (B or 1, 1, T, S) mask, True = may attend; None when plain causal suffices."""
        if kv_cache is None or (kv_cache.key_mask is None and (start == 0 or T == 1)):
            return None  # causal triangle applied by the attention itself (one new query sees all keys)
        S = start + T
        if T == 1:  # a decoding step: the new token sees every real key (its own slot is marked real)
            return kv_cache.key_mask[:, None, None, :S]
        causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(start)  # query i sees keys <= start+i
        if kv_cache.key_mask is None:
            return causal
        keys = kv_cache.key_mask[:, None, None, :S]  # (B, 1, 1, S)
        # a padding query attends to itself only, so its softmax row is never empty (no NaN)
        own = torch.zeros(T, S, dtype=torch.bool, device=device)
        own[torch.arange(T), torch.arange(start, S)] = True
        return (causal & keys) | own


def document_mask(idx: torch.Tensor, document_start: int) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask, True = may attend: causal, and only within the query's document.

    A document runs from a ``document_start`` token to the token before the next one; the tokens
    before a window's first ``document_start`` (the tail of a story cut by packing) are one more."""
    T = idx.shape[1]
    doc = (idx == document_start).cumsum(1)  # (B, T): which document of the window each token is in
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Eval mode (no dropout) inside the block; the caller's train/eval mode comes back after it,
    also when the block raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
