"""A student's adapter written from torch primitives, without tinylm: it passes every part of
`tinylm check`. tests/test_check.py appends one wrong helper or function to this file (a later
definition replaces an earlier one) and expects the checker to name that mistake, so each piece a
student gets wrong is its own small function here."""

import math

import regex
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


# ------------------------------------------------------------------------- the whole model
def embed(tokens, weights, start=0):
    positions = torch.arange(start, start + tokens.shape[1])
    return weights["tok_emb.weight"][tokens] + weights["pos_emb.weight"][positions]


def final_logits(x, weights):
    x = run_layernorm(x, weights["norm_f.weight"], weights["norm_f.bias"], 1e-5)
    return x @ weights["lm_head.weight"].T


def run_transformer_lm(tokens, weights, config):
    x = embed(tokens, weights)
    for i in range(config["n_layers"]):
        x = run_block(x, weights_under(weights, f"blocks.{i}."), config["n_heads"])
    return final_logits(x, weights)


def expand_kv(t, group):
    return t.repeat_interleave(group, dim=1)


def run_grouped_query_attention(x, weights, n_heads, n_kv_heads):
    def project(name, t):
        return run_linear(t, weights[f"{name}.weight"], weights.get(f"{name}.bias"))

    q = split_heads(project("q_proj", x), n_heads)
    k = split_heads(project("k_proj", x), n_kv_heads)
    v = split_heads(project("v_proj", x), n_kv_heads)
    group = n_heads // n_kv_heads
    y = run_scaled_dot_product_attention(q, expand_kv(k, group), expand_kv(v, group), True)
    return project("out_proj", merge_heads(y))


# ---------------------------------------------------------------------- training, continued
def micro_batch_loss(x, targets, weight, bias, ignore_index, n_targets, k):
    losses, counted = token_losses(run_linear(x, weight, bias), targets, ignore_index)
    return losses.sum() / n_targets


def run_accumulated_gradients(x, targets, weight, bias, micro_batches, ignore_index):
    weight = weight.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    n_targets = (targets != ignore_index).sum()
    rows = x.shape[0] // micro_batches
    for i in range(micro_batches):
        part = slice(i * rows, (i + 1) * rows)
        loss = micro_batch_loss(x[part], targets[part], weight, bias, ignore_index, n_targets, micro_batches)
        loss.backward()
    return {"weight": weight.grad, "bias": bias.grad}


class CheckpointedBlock(torch.autograd.Function):
    """Keeps the block's input only; runs the block again in backward."""

    @staticmethod
    def forward(ctx, x, n_heads, names, *tensors):
        ctx.n_heads, ctx.names = n_heads, names
        ctx.save_for_backward(x, *tensors)
        with torch.no_grad():
            return run_block(x, dict(zip(names, tensors)), n_heads)

    @staticmethod
    def backward(ctx, grad_out):
        x, *tensors = ctx.saved_tensors
        x = x.detach().requires_grad_()
        tensors = [t.detach().requires_grad_() for t in tensors]
        with torch.enable_grad():
            out = run_block(x, dict(zip(ctx.names, tensors)), ctx.n_heads)
        grads = torch.autograd.grad(out, [x, *tensors], grad_out)
        return (input_gradient(grads[0]), None, None, *grads[1:])


def input_gradient(g):
    return g


def run_checkpointed_blocks(x, weights, n_heads, n_layers):
    for i in range(n_layers):
        block = weights_under(weights, f"blocks.{i}.")
        names = sorted(block)
        x = CheckpointedBlock.apply(x, n_heads, names, *[block[n] for n in names])
    return x


# -------------------------------------------------------------------- generation, continued
def cache_position(cache_length):
    return cache_length


def cached_attention(q, keys, values):
    return run_scaled_dot_product_attention(q, keys, values, False)  # one query sees every cached key


def extend_cache(layer_cache, k, v):
    if layer_cache is None:
        return [k, v]
    return [torch.cat([layer_cache[0], k], 2), torch.cat([layer_cache[1], v], 2)]


def attend_cached(q, k, v, cache, i):
    """The new key and value join layer i's cache, then the query attends to all of it."""
    cache[i] = extend_cache(cache[i], k, v)
    return cached_attention(q, *cache[i])


def cached_step(token, weights, config, cache):
    """Feed one token (B, 1); ``cache`` holds per layer [keys, values] (B, H, S, D) or None."""
    n_heads = config["n_heads"]
    length = 0 if cache[0] is None else cache[0][0].shape[2]
    x = embed(token, weights, cache_position(length))
    for i in range(config["n_layers"]):
        w = weights_under(weights, f"blocks.{i}.")
        attn = weights_under(w, "attn.")
        h = block_norm(w, "norm1", x)
        q, k, v = (
            split_heads(run_linear(h, attn[f"{n}.weight"], attn[f"{n}.bias"]), n_heads)
            for n in ("q_proj", "k_proj", "v_proj")
        )
        y = merge_heads(attend_cached(q, k, v, cache, i))
        x = x + run_linear(y, attn["out_proj.weight"], attn["out_proj.bias"])
        x = x + run_feed_forward(block_norm(w, "norm2", x), weights_under(w, "ffn."), "gelu")
    return final_logits(x, weights)[:, -1]


def run_kv_cached_logits(tokens, weights, config):
    cache = [None] * config["n_layers"]
    return torch.stack([cached_step(tokens[:, t : t + 1], weights, config, cache) for t in range(tokens.shape[1])], 1)


def next_token_logits(seq, weights, config):
    return run_transformer_lm(torch.tensor([seq]), weights, config)[0, -1]


def run_greedy_decode(prompt, weights, config, max_new_tokens):
    seq, new = prompt.tolist(), []
    for _ in range(max_new_tokens):
        token = int(next_token_logits(seq, weights, config).argmax())
        new.append(token)
        seq.append(token)
    return new


def hypothesis_score(total, length, length_penalty):
    return total / length**length_penalty


def start_scores(k):
    return [0.0] + [-1e9] * (k - 1)


def may_finish(rank, k):
    """Only the first k of the 2k candidates may end a hypothesis."""
    return rank < k


def run_beam_search(prompt, weights, config, beam_width, max_new_tokens, eos_id, length_penalty):
    k = beam_width
    beams = [(s, []) for s in start_scores(k)]
    finished = []
    for step in range(max_new_tokens):
        log_probs = torch.stack(
            [torch.log_softmax(next_token_logits(prompt.tolist() + toks, weights, config), -1) for _, toks in beams]
        )
        totals = log_probs + torch.tensor([s for s, _ in beams])[:, None]
        top, index = torch.topk(totals.flatten(), 2 * k)
        running = []
        for rank, (score, i) in enumerate(zip(top.tolist(), index.tolist())):
            beam, token = divmod(i, totals.shape[1])
            if token == eos_id or step == max_new_tokens - 1:
                if may_finish(rank, k):
                    toks = beams[beam][1] + ([] if token == eos_id else [token])
                    finished.append((hypothesis_score(score, step + 1, length_penalty), toks))
                    finished = sorted(finished, key=lambda h: -h[0])[:k]
            elif len(running) < k:
                running.append((score, beams[beam][1] + [token]))
        if step == max_new_tokens - 1:
            break
        if len(finished) == k and hypothesis_score(running[0][0], step + 1, length_penalty) <= finished[-1][0]:
            break
        beams = running
    return [(toks, score) for score, toks in finished]


# ------------------------------------------------------------------- tokenizers and n-grams
def pretokens(text, pattern):
    return regex.findall(pattern, text)


def best_pair(counts, vocab):
    top = max(counts.values())
    return min(pair for pair, c in counts.items() if c == top)


def run_train_bpe(text, n_merges, pattern):
    words = {}
    for piece in pretokens(text, pattern):
        key = tuple(piece.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    vocab = [bytes([b]) for b in range(256)]
    merges = []
    for _ in range(n_merges):
        counts = {}
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        a, b = best_pair(counts, vocab)
        new = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        merges.append((vocab[a], vocab[b]))
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(new)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return merges


def merge_ranks(merges):
    ids = {bytes([b]): b for b in range(256)}
    ranks = {}
    for i, (a, b) in enumerate(merges):
        ranks[(ids[a], ids[b])] = i
        ids[a + b] = 256 + i
    return ranks


def pick_merge(candidates):
    """(rank, position) of each mergeable pair -> the one to merge."""
    return min(candidates)


def run_bpe_encode(text, merges, pattern):
    ranks = merge_ranks(merges)
    ids = []
    for piece in pretokens(text, pattern):
        seq = list(piece.encode("utf-8"))
        while len(seq) > 1:
            candidates = [(ranks[p], i) for i, p in enumerate(zip(seq, seq[1:])) if p in ranks]
            if not candidates:
                break
            rank, i = pick_merge(candidates)
            seq[i : i + 2] = [256 + rank]
        ids.extend(seq)
    return ids


def run_bpe_decode(ids, merges):
    vocab = [bytes([b]) for b in range(256)] + [a + b for a, b in merges]
    return b"".join(vocab[int(i)] for i in ids).decode("utf-8", errors="replace")


WORD = r"\w+(?:'\w+)*|[^\w\s]"


def ranked_words(counts):
    return sorted(counts, key=lambda w: (-counts[w], w))


def run_word_encode(train_text, text, vocab_size):
    counts = {}
    for w in regex.findall(WORD, train_text):
        counts[w] = counts.get(w, 0) + 1
    ids = {w: 4 + i for i, w in enumerate(ranked_words(counts)[: vocab_size - 4])}
    return [ids.get(w, 1) for w in regex.findall(WORD, text)]


def bigram_counts(train, vocab_size):
    c = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for v, w in zip(train.tolist(), train.tolist()[1:]):
        c[v, w] += 1
    return c


def add_k(c, contexts, k):
    rows = c[contexts]
    return (rows + k) / (rows.sum(1, keepdim=True) + k * c.shape[0])


def continuation_probs(c, d):
    n = (c > 0).sum(0).double()
    n[2] = 0  # <sos> is never predicted
    total = n.sum()
    return (n - d).clamp(min=0) / total + d * (n > 0).sum() / total / c.shape[0]


def kneser_ney(c, contexts, d):
    lower = continuation_probs(c, d)
    rows = c[contexts]
    totals = rows.sum(1, keepdim=True)
    seen = totals > 0
    safe = totals.clamp(min=1)
    higher = (rows - d).clamp(min=0) / safe + d * (rows > 0).sum(1, keepdim=True) / safe * lower
    return torch.where(seen, higher, lower)


def run_ngram_probs(train, vocab_size, contexts, smoothing, k, discount):
    c = bigram_counts(train, vocab_size)
    if smoothing == "add_k":
        return add_k(c, contexts, k)
    return kneser_ney(c, contexts, discount)
