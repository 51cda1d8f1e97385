"""A student's adapter written from torch primitives, without tinylm: it passes every part of
`tinylm check`. tests/test_check.py appends one wrong helper or function to this file (a later
definition replaces an earlier one) and expects the checker to name that mistake, so each piece a
student gets wrong is its own small function here."""

import math

import torch


# ------------------------------------------------------------------------------ model parts
def run_linear(x, weight, bias):
    y = x @ weight.T
    return y if bias is None else y + bias


def run_embedding(ids, weight):
    return weight[ids]


def run_softmax(x, dim):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def attention_scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def causal_mask(t):
    return torch.ones(t, t, dtype=torch.bool).tril()


def run_scaled_dot_product_attention(q, k, v, causal):
    scores = attention_scores(q, k)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2]), float("-inf"))
    return run_softmax(scores, -1) @ v


def split_heads(t, n_heads):
    b, n, c = t.shape
    return t.view(b, n, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def rotate(x):
    """RoPE on consecutive pairs (x0, x1), (x2, x3), ..."""
    n, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def rotate_queries_and_keys(q, k):
    return rotate(q), rotate(k)


def run_multihead_attention(x, weights, n_heads, rope):
    def project(name, t):
        return run_linear(t, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    q, k, v = (split_heads(project(name, x), n_heads) for name in ("q_proj", "k_proj", "v_proj"))
    if rope:
        q, k = rotate_queries_and_keys(q, k)
    y = run_scaled_dot_product_attention(q, k, v, True)
    return project("out_proj", merge_heads(y))


def run_layernorm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * weight
    return y if bias is None else y + bias


def run_rmsnorm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x * torch.sigmoid(x)


def glu(gate, up):
    return silu(gate) * up


def activation(kind, x):
    return gelu(x) if kind == "gelu" else torch.relu(x)


def run_feed_forward(x, weights, kind):
    def lin(name, t):
        return run_linear(t, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    if kind == "swiglu":
        h = glu(lin("gate", x), lin("up", x))
    else:
        h = activation(kind, lin("up", x))
    return lin("down", h)


def weights_under(weights, prefix):
    return {name[len(prefix) :]: w for name, w in weights.items() if name.startswith(prefix)}


def block_norm(weights, name, t):
    return run_layernorm(t, weights[f"{name}.weight"], weights[f"{name}.bias"], 1e-5)


def run_block(x, weights, n_heads):
    h = x + run_multihead_attention(block_norm(weights, "norm1", x), weights_under(weights, "attn."), n_heads, False)
    return h + run_feed_forward(block_norm(weights, "norm2", h), weights_under(weights, "ffn."), "gelu")


# ---------------------------------------------------------------------------------- training
def token_losses(logits, targets, ignore_index):
    """Each position's -log p(target), 0 at padding, and the mask of counted positions."""
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    counted = targets != ignore_index
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -picked * counted, counted


def run_cross_entropy(logits, targets, ignore_index):
    losses, counted = token_losses(logits, targets, ignore_index)
    return losses.sum() / counted.sum()


def adam_gradient(g, p, weight_decay):
    return g


def decayed(p, lr, weight_decay):
    return p * (1 - lr * weight_decay)


def adam_direction(m, v, step, beta1, beta2, eps):
    return (m / (1 - beta1**step)) / (torch.sqrt(v / (1 - beta2**step)) + eps)


def run_adamw_step(params, grads, state, lr, betas, eps, weight_decay, step):
    beta1, beta2 = betas
    new_params, new_state = {}, {}
    for name, p in params.items():
        g = adam_gradient(grads[name], p, weight_decay)
        m = beta1 * state[name]["exp_avg"] + (1 - beta1) * g
        v = beta2 * state[name]["exp_avg_sq"] + (1 - beta2) * g * g
        new_params[name] = decayed(p, lr, weight_decay) - lr * adam_direction(m, v, step, beta1, beta2, eps)
        new_state[name] = {"exp_avg": m, "exp_avg_sq": v}
    return new_params, new_state


def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


def run_clip_grad_norm(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    return {name: g * scale for name, g in grads.items()}, total


# -------------------------------------------------------------------------------- generation
def run_top_k_filter(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def nucleus_drop(probs, p):
    drop = torch.cumsum(probs, dim=-1) - probs >= p
    drop[..., 0] = False
    return drop


def run_top_p_filter(logits, p):
    values, order = torch.sort(logits, dim=-1, descending=True)
    drop = nucleus_drop(torch.softmax(values, dim=-1), p)
    kept = values.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)
