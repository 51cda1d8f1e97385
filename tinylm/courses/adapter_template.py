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

The adapter runs in its own sandboxed process, each function with a time limit (30 s by default),
under hard limits on memory, CPU time, processes and file size. It can import torch, numpy, regex
and Python's standard library (not tinylm), read its own folder and write to /tmp, and has no
network; printing is fine (it goes to stderr). Each run draws its own inputs (the seed is printed;
``--seed`` repeats them). tinylm's own answers to this contract are in
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


# ------------------------------------------------------------------------- the whole model
def run_transformer_lm(tokens, weights, config):
    """The whole decoder-only LM's logits: x = tok_emb[tokens] + pos_emb[0 .. T-1], then
    ``n_layers`` pre-norm blocks as ``run_block`` (block i's weights under ``blocks.{i}.``),
    LayerNorm ``norm_f`` (eps 1e-5), and the head: logits = x @ lm_head.weight.T (no bias; the
    head is its own matrix, not tied to the embedding).

    tokens: (B, T) int64 in [0, V). config: a dict with ``vocab_size`` (V), ``context_length``,
    ``d_model`` (C), ``n_layers``, ``n_heads``, ``d_ff`` (F). weights: ``tok_emb.weight`` (V, C),
    ``pos_emb.weight`` (context_length, C), for each block i the names of ``run_block`` under
    ``blocks.{i}.`` (``blocks.0.norm1.weight``, ``blocks.0.attn.q_proj.weight``, ...,
    ``blocks.0.ffn.down.bias``), ``norm_f.weight``, ``norm_f.bias`` (C,), ``lm_head.weight`` (V, C).

    Returns (B, T, V).
    """
    raise NotImplementedError


def run_grouped_query_attention(x, weights, n_heads, n_kv_heads):
    """Causal grouped-query attention: ``n_heads`` query heads and ``n_kv_heads`` key/value heads
    of width D = C / n_heads; kv head j serves the consecutive query heads j * G .. (j + 1) * G - 1,
    G = n_heads / n_kv_heads (``repeat_interleave``, as Llama). No RoPE.

    x: (B, T, C). weights: ``q_proj.weight`` (C, C), ``k_proj.weight`` and ``v_proj.weight``
    (n_kv_heads * D, C), ``out_proj.weight`` (C, C), and the biases ``q_proj.bias`` (C,),
    ``k_proj.bias``, ``v_proj.bias`` (n_kv_heads * D,), ``out_proj.bias`` (C,).

    Returns (B, T, C).
    """
    raise NotImplementedError


# ---------------------------------------------------------------------- training, continued
def run_accumulated_gradients(x, targets, weight, bias, micro_batches, ignore_index):
    """Gradient accumulation: the gradients of one batch's loss computed over ``micro_batches``
    micro-batches (rows i * B/k .. (i + 1) * B/k - 1, forward and backward each), equal to the
    gradients of the whole batch at once.

    The model is a linear map to logits, logits = x @ weight.T + bias, and the loss the mean
    cross-entropy over every target of the batch that is not ``ignore_index`` (the micro-batches
    may hold different numbers of them). Start from zero gradients. Each micro-batch goes through
    the model on its own: a matrix product over the whole batch's rows at once is reported (the
    gradients are right, but nothing was accumulated).

    x: (B, T, C); targets: (B, T) int64; weight: (V, C); bias: (V,); micro_batches: k, dividing B;
    ignore_index: int. Returns {"weight": gradient (V, C), "bias": gradient (V,)}.
    """
    raise NotImplementedError


def run_checkpointed_blocks(x, weights, n_heads, n_layers):
    """``n_layers`` blocks as ``run_block`` one after the other (block i's weights under
    ``blocks.{i}.``), with gradient checkpointing written by hand: keep each block's input only and
    recompute the block inside backward (a ``torch.autograd.Function``, or
    ``torch.utils.checkpoint``). The check compares the output and the gradients with tinylm's,
    and measures what autograd keeps for backward after the forward: it must be at most half of
    what the same blocks keep without checkpointing.

    x: (B, T, C). Returns (B, T, C).
    """
    raise NotImplementedError


# -------------------------------------------------------------------- generation, continued
def run_kv_cached_logits(tokens, weights, config):
    """The LM of ``run_transformer_lm`` run one token at a time with a cache of each layer's keys
    and values: step t feeds tokens[:, t] alone, at position t, its key and value added to the
    cache before it attends (it sees itself and every earlier token). Returns the logits of every
    step stacked, (B, T, V), which must equal ``run_transformer_lm`` on the whole sequence.
    The checker counts the floating-point operations of its matrix products: a step that runs the
    whole prefix through the model again (no cache) does about 4x tinylm's here and is reported.
    """
    raise NotImplementedError


def run_greedy_decode(prompt, weights, config, max_new_tokens):
    """Greedy decoding with the LM of ``run_transformer_lm`` (these weights): append the most
    likely next token (argmax of the last position's logits), ``max_new_tokens`` times; no stop
    token.

    prompt: (P,) int64. Returns the new tokens: a list of ints (or a 1-d tensor).
    """
    raise NotImplementedError


def run_beam_search(prompt, weights, config, beam_width, max_new_tokens, eos_id, length_penalty):
    """Beam search with the LM of ``run_transformer_lm``, by Hugging Face's rules (as tinylm):

    - k = ``beam_width`` running beams; beam 0 starts at score 0, the others at -1e9;
    - each step adds each beam's next-token log-probabilities (log_softmax of the last position's
      logits) to its score and takes the best 2k (beam, token) candidates of all k * V;
    - a candidate whose token is ``eos_id``, or any candidate at the last step (step
      ``max_new_tokens`` - 1), ends: among the first k candidates it becomes a finished hypothesis
      scored sum log p / L ** length_penalty, L the number of generated tokens (the eos counted);
      its tokens leave the eos out; the best k finished are kept;
    - the best k candidates that do not end are the next beams;
    - stop early when k hypotheses are finished and the best running score / L ** length_penalty
      is no better than the worst of them.

    prompt: (P,) int64. Returns the k finished hypotheses, best first: a list of (tokens, score),
    tokens a list of ints, score a float. With beam_width 1 it is greedy decoding up to the eos.
    """
    raise NotImplementedError


# ------------------------------------------------------------------- tokenizers and n-grams
def run_train_bpe(text, n_merges, pattern):
    """Byte-level BPE training. Split ``text`` into pre-tokens with the regular expression
    ``pattern`` (GPT-2's; use the ``regex`` package, ``regex.findall(pattern, text)``: ``re``
    lacks \\p{L}), write each pre-token as its UTF-8 bytes, then ``n_merges`` times merge the most
    frequent adjacent pair inside pre-tokens (counted at every position, weighted by how often the
    pre-token occurs; a merge replaces occurrences left to right). Ties: the pair with the smallest
    (left id, right id), where byte b has id b and the i-th merge makes id 256 + i.

    Returns the merges in order: a list of (left bytes, right bytes).
    """
    raise NotImplementedError


def run_bpe_encode(text, merges, pattern):
    """Encode ``text`` with byte-level BPE: split it into pre-tokens with ``pattern``, and in each,
    starting from its UTF-8 bytes, merge the adjacent pair of lowest merge rank (the first in
    ``merges``) until no pair is a merge. Ids: byte b is b, merge i is 256 + i.

    merges: a list of (left bytes, right bytes) as ``run_train_bpe`` returns. Returns a list of
    ints (or a 1-d tensor).
    """
    raise NotImplementedError


def run_bpe_decode(ids, merges):
    """The text of BPE ids (byte b is b, merge i is 256 + i): the bytes of every token joined,
    then decoded as UTF-8 once (a character may be split over tokens). decode(encode(text)) is
    ``text``.

    ids: (N,) int64. Returns a str.
    """
    raise NotImplementedError


def run_word_encode(train_text, text, vocab_size):
    """A word vocabulary with ``<unk>``: split ``train_text`` into words and punctuation with
    ``regex.findall(r"\\w+(?:'\\w+)*|[^\\w\\s]", text)`` (case kept), rank them by count (ties
    alphabetical), keep the first vocab_size - 4 (ids 0-3 are ``<pad>``, ``<unk>``, ``<sos>``,
    ``<eos>``; the i-th word kept is id 4 + i), and encode ``text`` the same way, each word not
    in the vocabulary becoming ``<unk>`` (id 1).

    Returns a list of ints (or a 1-d tensor).
    """
    raise NotImplementedError


def run_ngram_probs(train, vocab_size, contexts, smoothing, k, discount):
    """Bigram probabilities P(w | v) for each context v in ``contexts`` and every w in
    0 .. vocab_size - 1, counted on ``train``: one document, ``<sos>`` (id 2) first and ``<eos>``
    (id 3) last. c(v w) counts the adjacent pairs of train; c(v) = sum over w of c(v w).

    - ``smoothing == "add_k"``: (c(v w) + k) / (c(v) + k V), V = vocab_size (a context never seen:
      1 / V).
    - ``"kneser_ney"``, interpolated, one discount d = ``discount``:
      P(w | v) = max(c(v w) - d, 0) / c(v) + d N1+(v .) / c(v) P1(w), with N1+(v .) the number of
      distinct w after v; a context never seen: P1(w). The lower order uses continuation counts
      N(w) = the number of distinct v with c(v w) > 0 (``<sos>`` counts as a v; N(<sos>) = 0),
      discounted as well and interpolated with the uniform 1 / V:
      P1(w) = max(N(w) - d, 0) / S + d n / S / V, S = sum of N(w), n = the number of w with N(w) > 0.

    train: (N,) int64; contexts: (M,) int64; k, discount: floats. Returns (M, vocab_size).
    """
    raise NotImplementedError


# ------------------------------------------------- your whole model: `tinylm evaluate --adapter`
# ``tinylm evaluate --adapter ADAPTER.py --data valid.txt`` scores your own trained model on tinylm's
# protocol (bits per byte, token and word perplexity, the KV cache's speed-up; BLEU with --bleu). Load your model and
# tokenizer once, at the top of this file or on the first call, and fill these:


def model_info():
    """{"context_length": the longest input ``model_logits`` takes, "bos_id": the id that starts
    every scored document (your <sos>), or None when none is prepended, and, for BLEU (``--bleu``),
    "stop_ids": the ids that end a continuation (your <eos>), a list, empty or left out for none}."""
    raise NotImplementedError


def model_encode(text):
    """Your tokenizer: the ids of ``text`` (no start id added). Returns a list of ints."""
    raise NotImplementedError


def model_decode(ids):
    """Your tokenizer back: the text of ``ids`` (a list of ints). Returns a str. Needed by
    ``--bleu`` only (BLEU compares texts)."""
    raise NotImplementedError


def model_logits(tokens):
    """Your model's next-token logits at every position of ``tokens`` (B, T) int64, T at most the
    context length, rows right-padded with 0 where shorter (padding comes after every scored
    position, so a causal model is not affected). Returns (B, T, V)."""
    raise NotImplementedError


def model_generate(prompt, max_new_tokens, use_cache):
    """Greedy decoding with your model from ``prompt`` (a list of ints): ``max_new_tokens`` new
    tokens (no stop token), with your KV cache when ``use_cache`` is True and recomputing the whole
    sequence every step when False. Returns the new tokens, a list of ints. tinylm times both on
    the same prompt: the speed-up it reports is the same measurement for every student."""
    raise NotImplementedError
