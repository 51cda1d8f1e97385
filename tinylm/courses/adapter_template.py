"""The adapter a student fills for ``tinylm check ADAPTER.py``: copy this file, replace each
``raise NotImplementedError`` with a call into your own code, and run the check.

Every function receives float32 CPU tensors (token ids and targets are int64) and returns a
tensor of the shape stated, unless its docstring says otherwise. Write each part with PyTorch
primitives (tensor arithmetic, ``@``, ``torch.exp``, ...): calling torch's own attention or AdamW
passes the check but teaches nothing.

A function you leave as it is (or delete) is reported "not implemented" and the others are still
checked. Keep the parameter names: the checker passes every argument by name.

The parts that train (linear, embedding, softmax, attention, norms, feed-forward, block,
cross-entropy) are also checked for their gradients with respect to the inputs and weights, so
keep the computation in torch: ``.detach()``, ``.item()`` or numpy in the middle cut it.

Weights come as a dict under tinylm's state-dict names, listed in each docstring: a weight matrix
is (out_features, in_features), as in ``torch.nn.Linear``, and a linear map is
``x @ weight.T + bias``. Shapes: B batch, T positions, C model width, H heads, D = C / H head
width, V vocabulary, F feed-forward width.

The adapter runs in its own process, each function with a time limit (30 s by default), under a
memory limit; printing is fine (it goes to stderr). tinylm's own answers to this contract are in
``tinylm/courses/reference_adapter.py``.
"""

from __future__ import annotations


# ------------------------------------------------------------------------------ model parts
def run_linear(x, weight, bias):
    """A linear map: ``x @ weight.T + bias``.

    x: (..., in); weight: (out, in); bias: (out,) or None. Returns (..., out).
    """
    raise NotImplementedError


def run_embedding(ids, weight):
    """Look up the rows of ``weight`` for each token id.

    ids: (B, T) int64 in [0, V); weight: (V, C). Returns (B, T, C).
    """
    raise NotImplementedError


def run_softmax(x, dim):
    """Softmax of ``x`` along dimension ``dim``; it must not overflow where x holds large values
    (subtract the maximum along ``dim`` first).

    x: any shape; dim: an int (may be negative). Returns x's shape.
    """
    raise NotImplementedError


def run_scaled_dot_product_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v, the softmax over the keys; with ``causal`` query i attends to
    keys 0..i only.

    q: (B, H, T, D); k, v: (B, H, T, D); causal: bool. Returns (B, H, T, D).
    """
    raise NotImplementedError


def run_multihead_attention(x, weights, n_heads, rope):
    """Causal multi-head self-attention: project x to queries, keys and values, split each into
    ``n_heads`` heads of width D = C / n_heads (head h is features h*D .. (h+1)*D - 1), attend
    (causal, scaled by 1/sqrt(D)), join the heads and project with ``out_proj``.

    x: (B, T, C). weights: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``,
    ``out_proj.weight`` (each (C, C)) and ``q_proj.bias``, ``k_proj.bias``, ``v_proj.bias``,
    ``out_proj.bias`` (each (C,)). n_heads: int.

    rope: when True, rotate each head's queries and keys (not values) by their position
    (rotary embeddings, positions 0 .. T-1, theta 10000), on consecutive pairs as in Meta's Llama
    and llama2.c: pair i is features (2i, 2i+1) of the head, at angle pos * theta ** (-2i / D),
    (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos).

    Returns (B, T, C).
    """
    raise NotImplementedError


def run_layernorm(x, weight, bias, eps):
    """LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * weight + bias, with the
    biased variance (divided by C).

    x: (..., C); weight: (C,); bias: (C,) or None; eps: float. Returns x's shape.
    """
    raise NotImplementedError


def run_rmsnorm(x, weight, eps):
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight (no mean subtracted,
    no bias).

    x: (..., C); weight: (C,); eps: float. Returns x's shape.
    """
    raise NotImplementedError


def run_feed_forward(x, weights, kind):
    """The transformer's feed-forward, of one of three kinds:

    - ``"gelu"``: down(gelu(up(x))), with GPT-2's tanh approximation of GELU,
      0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))); weights ``up.weight`` (F, C),
      ``up.bias`` (F,), ``down.weight`` (C, F), ``down.bias`` (C,).
    - ``"relu"``: down(relu(up(x))), the same weights.
    - ``"swiglu"``: down(silu(gate(x)) * up(x)), silu(z) = z * sigmoid(z); weights
      ``gate.weight`` (F, C), ``up.weight`` (F, C), ``down.weight`` (C, F), no biases.

    x: (B, T, C). Returns (B, T, C).
    """
    raise NotImplementedError


def run_block(x, weights, n_heads):
    """One pre-norm transformer block: h = x + attn(norm1(x)), then h + ffn(norm2(h)); norms are
    LayerNorm (eps 1e-5), attention is causal multi-head without RoPE, the feed-forward is GELU
    (tanh approximation).

    x: (B, T, C). weights: ``norm1.weight``, ``norm1.bias``, ``norm2.weight``, ``norm2.bias``
    (each (C,)); the attention's under ``attn.`` (``attn.q_proj.weight``, ``attn.q_proj.bias``,
    ``attn.k_proj.weight``, ``attn.k_proj.bias``, ``attn.v_proj.weight``, ``attn.v_proj.bias``,
    ``attn.out_proj.weight``, ``attn.out_proj.bias``); the feed-forward's under ``ffn.``
    (``ffn.up.weight``, ``ffn.up.bias``, ``ffn.down.weight``, ``ffn.down.bias``). n_heads: int.

    Returns (B, T, C).
    """
    raise NotImplementedError


# ---------------------------------------------------------------------------------- training
def run_cross_entropy(logits, targets, ignore_index):
    """The mean cross-entropy of next-token predictions over the targets that count: positions
    whose target is ``ignore_index`` (padding) add nothing and are not counted in the mean.

    logits: (B, T, V); targets: (B, T) int64, in [0, V) or ignore_index; ignore_index: int
    (-100). Returns a scalar tensor.
    """
    raise NotImplementedError


def run_adamw_step(params, grads, state, lr, betas, eps, weight_decay, step):
    """One AdamW update (Loshchilov & Hutter; torch.optim.AdamW), for every tensor in ``params``:

        m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
        m_hat = m / (1 - beta1^step);  v_hat = v / (1 - beta2^step)
        param = param * (1 - lr * weight_decay) - lr * m_hat / (sqrt(v_hat) + eps)

    params, grads: dicts name -> tensor of the same shapes; state: name -> {"exp_avg": m,
    "exp_avg_sq": v}, the moments after the previous updates; lr, eps, weight_decay: floats;
    betas: (beta1, beta2); step: this update's number, counting from 1 (the bias correction uses
    it as it is). Every tensor given decays (tinylm itself passes biases and norm gains with
    weight_decay 0). Do not change the inputs in place.

    Returns (new_params, new_state), dicts of the same names and shapes.
    """
    raise NotImplementedError


def run_cosine_schedule(step, max_lr, min_lr, warmup, total):
    """The learning rate at ``step`` (from 0): linear warmup max_lr * (step + 1) / warmup for the
    first ``warmup`` steps, then a cosine from max_lr down to min_lr at step ``total``, and min_lr
    after it: min_lr + 0.5 (max_lr - min_lr) (1 + cos(pi * progress)), progress =
    min(1, (step - warmup) / (total - warmup)).

    step, warmup, total: ints; max_lr, min_lr: floats. Returns a float.
    """
    raise NotImplementedError


def run_clip_grad_norm(grads, max_norm):
    """Gradient clipping by the global norm, as torch.nn.utils.clip_grad_norm_: the norm of all
    gradients together, total = sqrt(sum of every g^2); when it exceeds max_norm, every gradient
    is multiplied by max_norm / (total + 1e-6).

    grads: dict name -> tensor; max_norm: float. Returns (clipped grads dict, total norm as a
    float or a scalar tensor).
    """
    raise NotImplementedError


# -------------------------------------------------------------------------------- generation
def run_top_k_filter(logits, k):
    """Keep the k largest logits of each row; set the others to -inf (float("-inf")).

    logits: (B, V); k: int, 1 <= k <= V. Returns (B, V).
    """
    raise NotImplementedError


def run_top_p_filter(logits, p):
    """Nucleus (top-p) filtering: sort each row's tokens by probability (softmax of the logits),
    most likely first, and keep them while the probability of the tokens before them is below p:
    the token whose probability crosses p is kept, and so is the most likely token always. The
    others become -inf; kept logits are returned unchanged.

    logits: (B, V); p: float in (0, 1). Returns (B, V).
    """
    raise NotImplementedError
