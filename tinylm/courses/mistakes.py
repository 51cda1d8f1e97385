"""The usual wrong versions of each part, each a small function with the adapter's signature.

When a student's part differs from tinylm's, ``check`` runs these on the same inputs and names the
first one the student's output equals. Most are written once with a switch per mistake
(``attention(..., scale_power=0)``) beside the pieces of tinylm they keep: a mistake differs from the
reference in the one way it names, which tests/test_check.py checks (with every switch at its
default, each function equals the reference).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import partial

import regex
import torch
import torch.nn.functional as F

from tinylm.constants import SOS_ID
from tinylm.courses import reference_adapter as ref
from tinylm.generation.processors import NEG_INF, top_k_filter
from tinylm.models.gpt import apply_rope, rope_tables
from tinylm.tokenizers.merges import merge_pair
from tinylm.tokenizers.word import WORD_PATTERN


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


def attention(
    q,
    k,
    v,
    causal,
    *,
    scale_power=-0.5,
    mask_diagonal=0,
    masked=True,
    softmax_dim=-1,
    mask_value=NEG_INF,
    mask_after=False,
):
    """Scaled dot-product attention by hand: the scores scaled by d ** ``scale_power`` (0: not
    scaled, -1: by 1/d), the causal mask as ``tril(mask_diagonal)`` (1:
    each position also sees the next one), masked scores set to ``mask_value`` (0: the masked
    positions still take weight), or with ``mask_after`` the softmax's weights zeroed after it
    (the rows then sum to less than 1)."""
    T, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * D**scale_power
    keep = torch.ones(T, S, dtype=torch.bool).tril(S - T + mask_diagonal)
    if causal and masked and not mask_after:
        scores = scores.masked_fill(~keep, mask_value)
    weights = torch.softmax(scores, dim=softmax_dim)
    if causal and mask_after:
        weights = weights.masked_fill(~keep, 0.0)
    return weights @ v


def rotate_halves(x, cos, sin):
    """RoPE on the two halves of each head, (x[:D/2], x[D/2:]) (GPT-NeoX's and HF Llama's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def multihead(
    x, weights, n_heads, rope, *, attend=attention, split="transpose", rotate=apply_rope, keys=True, theta=None
):
    """Multi-head causal self-attention by hand: ``split="view"`` cuts heads by reshaping (B, T, C)
    straight to (B, H, T, D); ``rotate`` is the RoPE rotation (None: none), ``keys=False`` leaves
    the keys unrotated, ``theta`` RoPE's base (default tinylm's)."""
    B, T, C = x.shape
    D = C // n_heads

    def heads(name):
        t = linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))
        return t.reshape(B, n_heads, T, D) if split == "view" else t.view(B, T, n_heads, D).transpose(1, 2)

    q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
    if rope and rotate is not None:
        cos, sin = rope_tables(T, D, theta or ref.ROPE_THETA)
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


def block(x, weights, n_heads, *, layout="pre", scaled=None, normed=None):
    """A transformer block from tinylm's own norms, attention and feed-forward, put together as
    ``layout`` says: "pre" (tinylm), "post", "normed_residual" (the residual stream carries the
    norm's output), "parallel", "no_residual", "one_norm"; ``scaled``, a
    scaled dot-product attention with a mistake, replaces tinylm's inside the attention, and
    ``normed``, a LayerNorm with a mistake (``normalize`` with switches), tinylm's norms."""
    attn, ffn = ref.weights_under(weights, "attn."), ref.weights_under(weights, "ffn.")
    layernorm = normed or ref.run_layernorm

    def norm(name, t):
        return layernorm(t, weights[f"{name}.weight"], weights[f"{name}.bias"], ref.BLOCK_NORM_EPS)

    def attend(t):
        if scaled is not None:
            return multihead(t, attn, n_heads, False, attend=scaled)
        return ref.run_multihead_attention(t, attn, n_heads, False)

    def mlp(t):
        return ref.run_feed_forward(t, ffn, "gelu")

    if layout == "post":
        h = norm("norm1", x + attend(x))
        return norm("norm2", h + mlp(h))
    if layout == "normed_residual":
        h = norm("norm1", x)
        h = h + attend(h)
        m = norm("norm2", h)
        return m + mlp(m)
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


# ------------------------------------------------------------------------- the whole model
def lm_logits(
    tokens,
    weights,
    config,
    *,
    positions=True,
    final_norm=True,
    layout="pre",
    head="lm_head.weight",
    scaled=None,
    normed=None,
):
    """The LM by hand from tinylm's blocks: ``positions=False`` adds no position embedding,
    ``final_norm=False`` skips ``norm_f``, ``layout`` is the blocks' (``block``), ``head`` the
    matrix that reads the logits out (``tok_emb.weight``: an LM that assumes tied weights),
    ``scaled`` and ``normed`` an attention and a LayerNorm with a mistake (``block``; ``normed``
    is the final norm too)."""
    x = weights["tok_emb.weight"][tokens]
    if positions:
        x = x + weights["pos_emb.weight"][: tokens.shape[1]]
    for i in range(config["n_layers"]):
        w = ref.weights_under(weights, f"blocks.{i}.")
        x = block(x, w, config["n_heads"], layout=layout, scaled=scaled, normed=normed)
    if final_norm:
        x = (normed or ref.run_layernorm)(x, weights["norm_f.weight"], weights["norm_f.bias"], ref.BLOCK_NORM_EPS)
    return x @ weights[head].T


def grouped_query_attention(x, weights, n_heads, n_kv_heads, *, tiled=False):
    """Grouped-query attention by hand; ``tiled`` gives query head h the kv head h % n_kv_heads
    (``k.repeat``) where tinylm gives it h // (n_heads / n_kv_heads) (``repeat_interleave``)."""
    B, T, C = x.shape
    D = C // n_heads

    def heads(name, n):
        return linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias")).view(B, T, n, D).transpose(1, 2)

    q, k, v = heads("q_proj", n_heads), heads("k_proj", n_kv_heads), heads("v_proj", n_kv_heads)
    group = n_heads // n_kv_heads
    k, v = (t.repeat(1, group, 1, 1) if tiled else t.repeat_interleave(group, dim=1) for t in (k, v))
    y = attention(q, k, v, True).transpose(1, 2).reshape(B, T, C)
    return linear(y, weights["out_proj.weight"], weights.get("out_proj.bias"))


def accumulated_gradients(x, targets, weight, bias, micro_batches, ignore_index, *, divide="targets"):
    """Gradients over micro-batches by hand: each micro-batch's summed loss divided by the whole
    batch's counted targets ("targets", tinylm), or its mean loss not divided ("none"), divided by
    k ("k"), or only the last micro-batch's mean ("last": gradients zeroed before each)."""
    w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    rows = x.shape[0] // micro_batches
    total = int((targets != ignore_index).sum())
    for i in range(micro_batches):
        part = slice(i * rows, (i + 1) * rows)
        if divide == "last":
            w.grad = b.grad = None
        logits = linear(x[part], w, b)
        per_target = "none" if divide == "targets" else "targets"  # summed, or each micro-batch's mean
        loss = cross_entropy(logits, targets[part], ignore_index, divide_by=per_target)
        (loss / {"targets": total, "k": micro_batches}.get(divide, 1)).backward()
    return {"weight": w.grad, "bias": b.grad}


def checkpointed_blocks(x, weights, n_heads, n_layers, *, detach_inputs=False, scaled=None, normed=None):
    """The blocks one after the other without checkpointing (what a student's version that keeps
    every activation computes); ``detach_inputs`` cuts the gradient between blocks, as a
    recomputation from a detached input whose gradient is not returned does; ``scaled`` and
    ``normed`` as in ``block``."""
    h = x
    for i in range(n_layers):
        w = ref.weights_under(weights, f"blocks.{i}.")
        h = block(h.detach() if detach_inputs and i else h, w, n_heads, scaled=scaled, normed=normed)
    return h


# -------------------------------------------------------------------------------- decoding
def kv_cached_logits(tokens, weights, config, *, position_offset=0, fixed_position=False, key_after=False):
    """The LM one token at a time with a cache of keys and values, by hand: the new token at
    position t + ``position_offset`` (0 with ``fixed_position``); with ``key_after`` its key and
    value join the cache after it attended (so it never sees itself)."""
    B, T = tokens.shape
    H, D = config["n_heads"], config["d_model"] // config["n_heads"]
    cache = [([], []) for _ in range(config["n_layers"])]
    steps = []
    for t in range(T):
        x = weights["tok_emb.weight"][tokens[:, t : t + 1]]
        x = x + weights["pos_emb.weight"][0 if fixed_position else t + position_offset]
        for i, (keys, values) in enumerate(cache):
            w = ref.weights_under(weights, f"blocks.{i}.")
            h = ref.run_layernorm(x, w["norm1.weight"], w["norm1.bias"], ref.BLOCK_NORM_EPS)
            q, k, v = (
                linear(h, w[f"attn.{n}.weight"], w[f"attn.{n}.bias"]).view(B, 1, H, D).transpose(1, 2)
                for n in ("q_proj", "k_proj", "v_proj")
            )
            if not key_after:
                keys.append(k)
                values.append(v)
            seen_k, seen_v = (torch.cat(c, 2) if c else k.new_zeros(B, H, 0, D) for c in (keys, values))
            y = torch.softmax(q @ seen_k.transpose(-2, -1) * D**-0.5, dim=-1) @ seen_v
            if key_after:
                keys.append(k)
                values.append(v)
            x = x + linear(y.transpose(1, 2).reshape(B, 1, H * D), w["attn.out_proj.weight"], w["attn.out_proj.bias"])
            x = x + ref.run_feed_forward(
                ref.run_layernorm(x, w["norm2.weight"], w["norm2.bias"], ref.BLOCK_NORM_EPS),
                ref.weights_under(w, "ffn."),
                "gelu",
            )
        steps.append(lm_logits_head(x[:, 0], weights))
    return torch.stack(steps, dim=1)


def lm_logits_head(x, weights):
    return (
        ref.run_layernorm(x, weights["norm_f.weight"], weights["norm_f.bias"], ref.BLOCK_NORM_EPS)
        @ weights["lm_head.weight"].T
    )


def greedy_decode(prompt, weights, config, max_new_tokens, *, position=-1, feed_back=True):
    """Greedy decoding by hand (the whole sequence through the LM each step): the next token is the
    argmax at ``position`` (0: the first position's logits); without ``feed_back`` the chosen
    token is never appended, so every step predicts from the prompt."""
    seq, new = prompt.tolist(), []
    for _ in range(max_new_tokens):
        token = int(ref.run_transformer_lm(torch.tensor([seq]), weights, config)[0, position].argmax())
        new.append(token)
        seq = seq + [token] if feed_back else seq
    return new


def beam_search(
    prompt,
    weights,
    config,
    beam_width,
    max_new_tokens,
    eos_id,
    length_penalty,
    *,
    normalise=True,
    one_start=True,
    any_rank=False,
):
    """Beam search by hand with tinylm's (Hugging Face's) rules (``generation.beam``): without
    ``normalise`` a finished hypothesis scores its plain sum of log-probabilities; without
    ``one_start`` every beam starts at score 0, so the first step picks one token k times; with
    ``any_rank`` an ending candidate finishes at any of the 2k ranks, not only the first k."""
    k, V = beam_width, config["vocab_size"]
    scores = torch.full((k,), 0.0 if not one_start else -1e9)
    scores[0] = 0.0
    beams, finished = [[] for _ in range(k)], []
    for step in range(max_new_tokens):
        norm = (step + 1) ** length_penalty if normalise else 1.0  # generated length, the stop token counted
        rows = torch.tensor([prompt.tolist() + b for b in beams])
        log_probs = torch.log_softmax(ref.run_transformer_lm(rows, weights, config)[:, -1].float(), dim=-1)
        top, index = torch.topk((log_probs + scores[:, None]).view(-1), min(2 * k, k * V))
        running = []
        for rank, (score, i) in enumerate(zip(top.tolist(), index.tolist())):
            beam, token = divmod(i, V)
            if token == eos_id or step == max_new_tokens - 1:
                if rank < k or any_rank:
                    finished.append((score / norm, beams[beam] + ([] if token == eos_id else [token])))
                    finished = sorted(finished, key=lambda h: -h[0])[:k]
            elif len(running) < k:
                running.append((score, beams[beam] + [token]))
        if step == max_new_tokens - 1:
            break
        if len(finished) == k and running[0][0] / norm <= finished[-1][0]:
            break  # no running beam can beat the worst finished hypothesis
        scores = torch.tensor([s for s, _ in running])
        beams = [b for _, b in running]
    return [(tokens, score) for score, tokens in finished]


# ------------------------------------------------------------------- tokenizers and n-grams
def train_bpe(text, n_merges, pattern, *, ties="smallest_ids", pretokenize=True):
    """BPE training by hand, pair counts recomputed every merge: among the most frequent pairs,
    ``ties`` picks the smallest (left id, right id) (tinylm), the first seen in the text
    ("first_seen": ``max(counts, key=counts.get)``) or the greatest bytes ("greatest_bytes", CS336's
    rule); without ``pretokenize`` the whole text is one sequence, so merges cross words."""
    words = Counter(regex.findall(pattern, text) if pretokenize else [text])
    seqs = {tuple(w.encode("utf-8")): n for w, n in words.items()}
    token_bytes, merges = [bytes([b]) for b in range(256)], []
    for _ in range(n_merges):
        counts: dict[tuple[int, int], int] = {}
        for seq, n in seqs.items():
            for pair in zip(seq, seq[1:]):
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        best = max(counts.values())
        tied = [pair for pair, c in counts.items() if c == best]
        if ties == "first_seen":
            pair = tied[0]
        elif ties == "greatest_bytes":
            pair = max(tied, key=lambda p: (token_bytes[p[0]], token_bytes[p[1]]))
        else:
            pair = min(tied)
        new = len(token_bytes)
        token_bytes.append(token_bytes[pair[0]] + token_bytes[pair[1]])
        merges.append((token_bytes[pair[0]], token_bytes[pair[1]]))
        seqs = {tuple(merge_pair(list(seq), pair, new)): n for seq, n in seqs.items()}
    return merges


def bpe_encode(text, merges, pattern, *, leftmost=False):
    """BPE encoding by hand: in each pre-token, merge the pair of lowest rank (tinylm), or with
    ``leftmost`` the leftmost pair that is any merge, whatever its rank."""
    ids = {m[0] + m[1]: 256 + i for i, m in enumerate(merges)}
    rank = {(bytes_id(a, ids), bytes_id(b, ids)): i for i, (a, b) in enumerate(merges)}
    out = []
    for piece in regex.findall(pattern, text):
        seq = list(piece.encode("utf-8"))
        while True:
            found = [(rank[p], i) for i, p in enumerate(zip(seq, seq[1:])) if p in rank]
            if not found:
                break
            r, i = min(found, key=lambda f: f[1]) if leftmost else min(found)
            seq[i : i + 2] = [256 + r]
        out.extend(seq)
    return out


def bytes_id(token: bytes, merged: dict) -> int:
    return token[0] if len(token) == 1 else merged[token]


def bpe_decode_per_token(ids, merges):
    """Each token decoded to text on its own: a character whose bytes are split over tokens
    becomes U+FFFD replacement characters."""
    token_bytes = [bytes([b]) for b in range(256)] + [a + b for a, b in merges]
    return "".join(token_bytes[int(i)].decode("utf-8", errors="replace") for i in ids)


def word_encode(train_text, text, vocab_size, *, ties="alphabetical", unknown="unk", specials=True):
    """The word vocabulary by hand: the most frequent words, ties alphabetical (tinylm) or in order
    of first appearance ("first_seen": ``Counter.most_common``); ``unknown="drop"`` leaves unknown
    words out instead of mapping them to ``<unk>`` (id 1); ``specials=False`` keeps ``vocab_size``
    words as if the four special tokens took no ids."""
    counts = Counter(regex.findall(WORD_PATTERN, train_text))
    if ties == "first_seen":
        ranked = [w for w, _ in counts.most_common()]
    else:
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
    kept = ranked[: vocab_size - (4 if specials else 0)]
    ids = {w: 4 + i for i, w in enumerate(kept)}
    words = regex.findall(WORD_PATTERN, text)
    return [ids.get(w, 1) for w in words if unknown == "unk" or w in ids]


def ngram_probs(train, vocab_size, contexts, smoothing, k, discount, *, variant="right"):
    """Bigram probabilities by hand over one document ``<sos> ... <eos>`` (tinylm's ``NGramLM``
    with one fixed discount). Add-k variants: "no_kv" (k V missing from the denominator),
    "laplace" (k = 1 whatever k is), "seen_vocab" (V counts only the ids seen). Kneser-Ney
    variants: "no_discount", "raw_unigram" (the lower order from raw counts, not continuation
    counts), "no_interpolation" (the freed mass d N1+(v .) / c(v) not given to the lower order),
    "unigram_not_discounted" (continuation counts over their total, not interpolated with 1/V)."""
    V, stream = vocab_size, [int(t) for t in train]
    bigrams = Counter(zip(stream, stream[1:]))
    c = torch.zeros(V, V, dtype=torch.float64)
    for (v, w), n in bigrams.items():
        c[v, w] = n
    rows = torch.stack([c[int(v)] for v in contexts])  # c(v w) for each context v
    totals = rows.sum(1, keepdim=True)
    if smoothing == "add_k":
        k = 1.0 if variant == "laplace" else k
        size = len(set(stream) - {SOS_ID}) if variant == "seen_vocab" else V
        denominator = totals + (0.0 if variant == "no_kv" else k * size)
        return (rows + k) / denominator
    return kneser_ney_rows(c, rows, totals, discount, variant)


def kneser_ney_rows(c, rows, totals, discount, variant):
    V = c.shape[0]
    d = 0.0 if variant == "no_discount" else discount
    continuation = (c > 0).sum(0).double()  # N1+(. w): distinct left neighbours, <sos> among them
    continuation[SOS_ID] = 0
    if variant == "raw_unigram":
        continuation = c.sum(0)
    total = continuation.sum()
    if variant == "unigram_not_discounted":
        unigram = continuation / total
    else:
        seen = (continuation > 0).sum()
        unigram = (continuation - d).clamp(min=0) / total + d * seen / total / V
    gamma = 0.0 if variant == "no_interpolation" else d * (rows > 0).sum(1, keepdim=True) / totals.clamp(min=1)
    seen_context = totals > 0
    return torch.where(seen_context, (rows - d).clamp(min=0) / totals.clamp(min=1) + gamma * unigram, unigram)
