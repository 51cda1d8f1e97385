"""The parts ``tinylm check`` knows: for each, the adapter function it calls, its seeded inputs,
tinylm's reference, the tolerance (and why), the arguments whose gradients count, and the usual
mistakes it can name.

Inputs are small (batch 2, 5 positions, width 16, 4 heads) and float32, drawn from a generator
seeded by the part's name, so a part's inputs do not change when other parts are added. Weight
matrices are scaled by 1/sqrt(fan-in) so that activations stay near 1 and the tolerances are
absolute errors of values of that size; norm gains are near 1 and biases near 0, but not exactly,
so that forgetting either shows.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from tinylm.constants import EOS_ID, IGNORE_INDEX, SOS_ID
from tinylm.courses import mistakes as wrong
from tinylm.courses import reference_adapter as ref
from tinylm.models.gpt import state_dict_by_parts
from tinylm.tokenizers.bpe import GPT2_SPLIT

B, T, C, HEADS, D_FF = 2, 5, 16, 4, 32
KV_HEADS = 2
LM_CONFIG = {"vocab_size": 12, "context_length": 16, "d_model": C, "n_layers": 2, "n_heads": HEADS, "d_ff": D_FF}
MEMORY_RATIO = 0.5
# a cached decoding may do this many times the matrix-product flops of tinylm's: a forward over the
# whole prefix at each of the kv_cache part's 7 steps does 4x (28 token-passes instead of 7)
FLOPS_RATIO = 2.0


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    why: str


@dataclass(frozen=True)
class Mistake:
    key: str  # short and stable: JSON and tests name it
    says: str  # completes "yours equals ..."
    fn: Callable  # the adapter function's signature


def same(output):
    return output


@dataclass(frozen=True)
class Part:
    name: str
    function: str  # the adapter's function
    inputs: Callable[[torch.Generator], list[dict]]  # keyword arguments, one dict per call
    reference: Callable
    tolerance: Tolerance
    grad: tuple[str, ...] = ()  # arguments whose gradients are compared (one call only)
    mistakes: tuple[Mistake, ...] = ()
    # one call's output in the form compared (token ids as int64, hypotheses as dicts); raises
    # TypeError for an output that cannot be read so
    canonical: Callable = same
    # a part that must keep fewer activations for backward than this function (same arguments)
    # keeps: at most MEMORY_RATIO of its bytes
    memory_baseline: Callable | None = None
    # a part that must not redo work (a KV cache): at most FLOPS_RATIO of this function's
    # matrix-product flops (same arguments)
    flops_baseline: Callable | None = None
    # a part that accumulates over micro-batches: no matrix product may take this many rows (the
    # whole batch's) at once
    batch_rows: int | None = None

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())


# ------------------------------------------------------------------------------ inputs
def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def random_weights(module: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh random values for ``module``'s parameters under tinylm's state-dict names, q/k/v and
    gate/up apart (the names the adapter receives)."""
    weights = {}
    for name, t in state_dict_by_parts(module).items():
        if t.dim() >= 2:
            weights[name] = randn(gen, *t.shape, scale=t.shape[1] ** -0.5)
        elif name.endswith("weight"):  # a norm's gain
            weights[name] = 1.0 + randn(gen, *t.shape, scale=0.1)
        else:
            weights[name] = randn(gen, *t.shape, scale=0.1)
    return weights


def linear_inputs(gen):
    # square, so that forgetting the transpose gives a result of the right shape, which is named
    return [{"x": randn(gen, B, T, 8), "weight": randn(gen, 8, 8, scale=8**-0.5), "bias": randn(gen, 8, scale=0.1)}]


def embedding_inputs(gen):
    return [{"ids": torch.randint(0, 7, (B, T), generator=gen), "weight": randn(gen, 7, C)}]  # ids repeat


def softmax_inputs(gen):
    x = randn(gen, 3, 4, 6)
    x[0, 1, 2] = 1000.0  # exp(1000) overflows float32: a softmax must subtract the maximum first
    return [{"x": x, "dim": 1}]  # not the last axis, so that ignoring dim shows


def attention_inputs(gen):
    return [{"q": randn(gen, B, 2, T, 4), "k": randn(gen, B, 2, T, 4), "v": randn(gen, B, 2, T, 4), "causal": True}]


def multihead_inputs(gen, rope: bool):
    weights = random_weights(ref.attention_module(C, HEADS), gen)
    return [{"x": randn(gen, B, T, C), "weights": weights, "n_heads": HEADS, "rope": rope}]


def layernorm_inputs(gen):
    # rows off centre and a large eps: the mistakes that move eps or the mean show at these sizes
    x = randn(gen, B, T, C) + 0.5
    return [{"x": x, "weight": 1.0 + randn(gen, C, scale=0.1), "bias": randn(gen, C, scale=0.1), "eps": 0.1}]


def rmsnorm_inputs(gen):
    return [{"x": randn(gen, B, T, C) + 0.5, "weight": 1.0 + randn(gen, C, scale=0.1), "eps": 0.1}]


def feed_forward_inputs(gen, kind: str):
    weights = random_weights(ref.feed_forward_module(C, D_FF, kind, bias=kind != "swiglu"), gen)
    return [{"x": randn(gen, B, T, C), "weights": weights, "kind": kind}]


def block_inputs(gen):
    weights = random_weights(ref.block_module(C, HEADS, D_FF), gen)
    return [{"x": randn(gen, B, T, C), "weights": weights, "n_heads": HEADS}]


def cross_entropy_inputs(gen):
    targets = torch.randint(0, 10, (B, 6), generator=gen)
    targets[0, 5:] = IGNORE_INDEX  # rows padded unequally: the ways of averaging differ
    targets[1, 3:] = IGNORE_INDEX
    return [{"logits": randn(gen, B, 6, 10, scale=2.0), "targets": targets, "ignore_index": IGNORE_INDEX}]


def adamw_inputs(gen):
    shapes = {"weight": (4, 3), "bias": (3,)}
    state = {
        name: {"exp_avg": randn(gen, *s, scale=0.1), "exp_avg_sq": torch.rand(s, generator=gen) * 0.01}
        for name, s in shapes.items()
    }
    call = {
        "params": {name: randn(gen, *s) for name, s in shapes.items()},
        "grads": {name: randn(gen, *s) for name, s in shapes.items()},
        "state": state,
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "step": 3,  # the third update: bias correction still matters (1 - 0.999^3 is 0.003)
    }
    return [call]


def schedule_inputs(gen):
    return [{"step": s, "max_lr": 1e-3, "min_lr": 1e-4, "warmup": 5, "total": 20} for s in range(25)]


def clip_inputs(gen):
    grads = {"weight": randn(gen, 4, 3), "bias": randn(gen, 3)}  # norm near 4
    return [{"grads": grads, "max_norm": 1.0}, {"grads": grads, "max_norm": 100.0}]


def top_k_inputs(gen):
    logits = randn(gen, 3, 12, scale=2.0)
    return [{"logits": logits, "k": 4}, {"logits": logits, "k": 2}]


def top_p_inputs(gen):
    # p = 0.05 is below every row's top probability: tinylm keeps that one token
    logits = randn(gen, 4, 12, scale=1.5)
    return [{"logits": logits, "p": 0.8}, {"logits": logits, "p": 0.05}]


def lm_weights(gen):
    return random_weights(ref.gpt_module(LM_CONFIG), gen)


def lm_inputs(gen):
    weights = lm_weights(gen)
    return [
        {
            "tokens": torch.randint(0, LM_CONFIG["vocab_size"], (B, 6), generator=gen),
            "weights": weights,
            "config": LM_CONFIG,
        }
    ]


def gqa_inputs(gen):
    weights = random_weights(ref.attention_module(C, HEADS, n_kv_heads=KV_HEADS), gen)
    return [{"x": randn(gen, B, T, C), "weights": weights, "n_heads": HEADS, "n_kv_heads": KV_HEADS}]


ACCUMULATION_ROWS = 4 * 6  # the batch's sequences x positions: the rows of its linear map


def accumulation_inputs(gen):
    # micro-batches padded unequally: averaging each one's mean is then not the batch's mean
    x, weight, bias = randn(gen, 4, 6, 8), randn(gen, 10, 8, scale=8**-0.5), randn(gen, 10, scale=0.1)
    targets = torch.randint(0, 10, (4, 6), generator=gen)
    targets[2, 2:] = targets[3, 4:] = IGNORE_INDEX
    call = {"x": x, "targets": targets, "weight": weight, "bias": bias, "ignore_index": IGNORE_INDEX}
    return [{**call, "micro_batches": 2}, {**call, "micro_batches": 4}]


def checkpoint_inputs(gen):
    block = ref.block_module(C, HEADS, D_FF)
    weights = {f"blocks.{i}.{name}": w for i in range(2) for name, w in random_weights(block, gen).items()}
    return [{"x": randn(gen, B, T, C), "weights": weights, "n_heads": HEADS, "n_layers": 2}]


def kv_inputs(gen):
    tokens = torch.randint(0, LM_CONFIG["vocab_size"], (B, 7), generator=gen)
    return [{"tokens": tokens, "weights": lm_weights(gen), "config": LM_CONFIG}]


def decoding_weights(gen):
    """An LM whose <eos> (id 3) is likely enough that beams end at different lengths."""
    weights = lm_weights(gen)
    weights["lm_head.weight"][EOS_ID] *= 3.0
    return weights


def greedy_inputs(gen):
    prompt = torch.randint(4, LM_CONFIG["vocab_size"], (4,), generator=gen)
    return [{"prompt": prompt, "weights": decoding_weights(gen), "config": LM_CONFIG, "max_new_tokens": 8}]


BEAM_DRAWS = 40  # draws of beam_inputs until the rank at which <eos> may finish decides the answer


def eos_at_rank(prompt, weights, rank: int) -> bool:
    """Scale the <eos> row of the head so that, after the prompt, <eos> is the ``rank``-th most
    likely token (from 0); False when its logit is too near 0 to be scaled there."""
    logits = ref.run_transformer_lm(prompt[None], weights, LM_CONFIG)[0, -1]
    others = torch.cat([logits[:EOS_ID], logits[EOS_ID + 1 :]]).sort(descending=True).values
    target, current = float(others[rank - 1]) - 0.01, float(logits[EOS_ID])  # just below: as likely as can be
    if abs(current) < 1e-3:
        return False
    weights["lm_head.weight"][EOS_ID] *= target / current  # the head has no bias: the logit scales with the row
    return True


def beam_inputs(gen):
    """Drawn until a beam search that lets a candidate end at any of its 2k ranks (not only the
    first k, the contract's rule) gives other hypotheses: <eos> is placed 4th after the prompt,
    between the k = 3 candidates that may finish and the k that may not."""
    for _ in range(BEAM_DRAWS):
        prompt = torch.randint(4, LM_CONFIG["vocab_size"], (4,), generator=gen)
        weights = decoding_weights(gen)
        if not eos_at_rank(prompt, weights, 3):
            continue
        call = {"prompt": prompt, "weights": weights, "config": LM_CONFIG, "max_new_tokens": 6}
        settings = ((1, 1.0), (3, 1.0), (3, 0.0))  # length penalty 0: an early <eos> scores high
        calls = [{**call, "beam_width": k, "eos_id": EOS_ID, "length_penalty": lp} for k, lp in settings]
        if any(wrong.beam_search(**c) != wrong.beam_search(**c, any_rank=True) for c in calls[1:]):
            break
    return calls


BPE_TEXT = (
    "The cat sat on the mat. The dog sat on the log. That hat, this hat: thin things think. "
    "A theme, then another theme; the three thin thieves thought the thing through. "
    "Café, naïve, 日本語. Then they sat there, and that was that."
)
ENCODE_TEXT = "The thin cat hath thought: that theme there! Naïve thieves sat on 日本."


def bpe_train_inputs(gen):
    return [{"text": BPE_TEXT, "n_merges": 30, "pattern": GPT2_SPLIT}]


def bpe_encode_inputs(gen):
    return [{"text": ENCODE_TEXT, "merges": ref.run_train_bpe(BPE_TEXT, 30, GPT2_SPLIT), "pattern": GPT2_SPLIT}]


def bpe_decode_inputs(gen):
    merges = ref.run_train_bpe(BPE_TEXT, 30, GPT2_SPLIT)
    return [{"ids": torch.tensor(ref.run_bpe_encode(ENCODE_TEXT, merges, GPT2_SPLIT)), "merges": merges}]


WORD_TRAIN = (
    "the cat saw the dog . the dog saw a bird , and the bird saw the cat . a cat and a dog ran . "
    "one bird sang ; one dog slept . Tom saw Lily and Lily saw Tom ."
)
WORD_TEXT = "the bird and the fox saw Tom , Lily and a zebra ."


def word_inputs(gen):
    return [{"train_text": WORD_TRAIN, "text": WORD_TEXT, "vocab_size": 12}]


def ngram_inputs(gen, smoothing: str):
    V = LM_CONFIG["vocab_size"]
    body = torch.randint(4, V - 2, (40,), generator=gen)  # ids V-2 and V-1 never occur
    train = torch.cat([torch.tensor([SOS_ID]), body, torch.tensor([EOS_ID])])
    contexts = torch.tensor([SOS_ID, *range(4, V)])  # <eos> is never a context; V-1 is one never seen
    return [{"train": train, "vocab_size": V, "contexts": contexts, "smoothing": smoothing, "k": 0.5, "discount": 0.75}]


# ------------------------------------------------------------------------------ tolerances
ELEMENTWISE = Tolerance(1e-6, 1e-6, "a few float32 operations per value: rounding only (~1e-7)")
PRODUCT = Tolerance(1e-5, 1e-5, "float32 sums of 8 to 32 products, in whatever order the kernel adds them (~1e-6)")
NORM = Tolerance(1e-5, 1e-5, "a mean, a variance and a square root per row of 16 in float32 (~1e-6)")
ATTENTION = Tolerance(
    1e-4, 1e-4, "three or four chained float32 matrix products, a softmax and their gradients: errors compound (~1e-5)"
)
LOSS = Tolerance(1e-5, 1e-5, "a log-sum-exp over 10 logits and a mean over 8 targets in float32 (~1e-6)")
UPDATE = Tolerance(1e-6, 1e-5, "a few float32 operations per weight, a square root and a division (~1e-7)")
SCHEDULE = Tolerance(1e-10, 1e-5, "one number per step; a float32 computation of it is within 1e-7 relative")
COPY = Tolerance(0.0, 0.0, "kept logits are copied, the others are -inf: exact")
LM = Tolerance(
    1e-4,
    1e-4,
    "two blocks, the final norm and the head: a dozen chained float32 products, softmaxes and their "
    "gradients (~1e-5); the same for the cached step, whose products are added in another order",
)
ACCUMULATED = Tolerance(
    1e-6, 1e-5, "float32 gradients of the same losses summed in another order (~1e-7; tinylm's own test: 1e-6)"
)
DECODED = Tolerance(
    1e-4, 1e-4, "token ids are exact (they differ by 1 at least); a beam's score sums float32 log-probabilities (~1e-6)"
)
EXACT = Tolerance(0.0, 0.0, "merges, token ids and text: exact")
PROBABILITY = Tolerance(1e-6, 1e-5, "ratios of counts: float32 arithmetic gives ~1e-7 relative")


def mistake(key: str, says: str, fn: Callable, **switches) -> Mistake:
    return Mistake(key, says, partial(fn, **switches) if switches else fn)


def merged(a: Callable, b: Callable) -> Callable | None:
    """One function with the switches of both: ``a`` and ``b`` partials of the same function whose
    switches do not clash (a switch both set to partials of one function is merged in turn:
    two attention mistakes inside a block), else None."""
    if not (isinstance(a, partial) and isinstance(b, partial)) or a.func is not b.func or a.args or b.args:
        return None
    switches = dict(a.keywords)
    for name, value in b.keywords.items():
        if name in switches:
            inner = merged(switches[name], value)
            if inner is None:
                return None
            value = inner
        switches[name] = value
    return partial(a.func, **switches)


def mistake_pairs(mistakes: tuple[Mistake, ...]) -> list[Mistake]:
    """Every two of ``mistakes`` that can be made at once, as one mistake keyed ``a+b``."""
    pairs = []
    for a, b in itertools.combinations(mistakes, 2):
        fn = merged(a.fn, b.fn)
        if fn is not None:
            pairs.append(Mistake(f"{a.key}+{b.key}", f"{a.says}; and {b.says}: two mistakes at once", fn))
    return pairs


LINEAR_MISTAKES = (
    mistake(
        "weight_not_transposed",
        "x @ weight + bias; weight is (out, in), so a linear map is x @ weight.T + bias",
        wrong.linear,
        transpose=False,
    ),
    mistake("no_bias", "x @ weight.T without the bias", wrong.linear, use_bias=False),
)
SOFTMAX_MISTAKES = (
    mistake("ignores_dim", "a softmax over the last axis: the dim argument was ignored", wrong.softmax, axis=-1),
    mistake("first_axis", "a softmax over axis 0 instead of dim", wrong.softmax, axis=0),
    mistake(
        "no_max_subtracted",
        "exp(x) / sum(exp(x)) without subtracting the maximum first: exp overflows to inf and the result holds nan",
        wrong.softmax,
        subtract_max=False,
    ),
)
ATTENTION_MISTAKES = (
    mistake("no_scale", "tinylm's attention without the 1/sqrt(d) scale on the scores", wrong.attention, scale_power=0),
    mistake(
        "scale_by_d", "tinylm's attention with the scores scaled by 1/d, not 1/sqrt(d)", wrong.attention, scale_power=-1
    ),
    mistake(
        "sees_next",
        "tinylm's attention with a causal mask one position too wide: each position also sees the next one",
        wrong.attention,
        mask_diagonal=1,
    ),
    mistake("no_mask", "tinylm's attention without the causal mask", wrong.attention, masked=False),
    mistake(
        "softmax_over_queries",
        "tinylm's attention with the softmax over the queries (dim -2), not over the keys (dim -1)",
        wrong.attention,
        softmax_dim=-2,
    ),
    mistake(
        "mask_after_softmax",
        "tinylm's attention with the causal mask applied after the softmax (weights zeroed, so each row sums "
        "to less than 1); mask the scores with -inf before it",
        wrong.attention,
        mask_after=True,
    ),
    mistake(
        "mask_value_zero",
        "tinylm's attention with the masked scores set to 0, not -inf: exp(0) = 1 gives the future positions weight",
        wrong.attention,
        mask_value=0.0,
    ),
)


def in_multihead(m: Mistake) -> Mistake:
    """An attention mistake inside multi-head attention."""
    return Mistake(m.key, m.says.replace("attention", "multi-head attention", 1), partial(wrong.multihead, attend=m.fn))


def inside(m: Mistake, what: str, fn: Callable) -> Mistake:
    """An attention mistake inside a larger part (a block, the LM): ``fn`` takes ``scaled``."""
    attention = m.says.removeprefix("tinylm's ")
    return Mistake(m.key, f"tinylm's {what} with {attention}", partial(fn, scaled=m.fn))


def norm_inside(m: Mistake, what: str, fn: Callable) -> Mistake:
    """A LayerNorm mistake inside a larger part (a block, the LM): ``fn`` takes ``normed``."""
    return Mistake(m.key, f"tinylm's {what} with its norms computed as {m.says}", partial(fn, normed=m.fn))


MULTIHEAD_MISTAKES = (
    *(in_multihead(m) for m in ATTENTION_MISTAKES),
    mistake(
        "heads_by_view",
        "tinylm's multi-head attention with the heads cut by reshaping (B, T, C) straight to (B, H, T, D), "
        "without the transpose: each head mixes positions",
        wrong.multihead,
        split="view",
    ),
)
ROPE_MISTAKES = (
    mistake(
        "rope_halves",
        "tinylm's attention with RoPE rotating the two halves of each head (x[:D/2], x[D/2:]: GPT-NeoX's "
        "layout); tinylm rotates consecutive pairs (x0, x1), (x2, x3), ... (Meta's layout)",
        wrong.multihead,
        rotate=wrong.rotate_halves,
    ),
    mistake(
        "rope_queries_only",
        "tinylm's attention with RoPE on the queries only, not the keys",
        wrong.multihead,
        keys=False,
    ),
    mistake("no_rope", "tinylm's attention without RoPE: rope=True was ignored", wrong.multihead, rotate=None),
    mistake(
        "rope_base",
        "tinylm's attention with RoPE's base 500,000 (Llama 3's); tinylm's is 10,000 (ModelConfig.rope_theta)",
        wrong.multihead,
        theta=500000.0,
    ),
)
LAYERNORM_MISTAKES = (
    mistake(
        "unbiased_variance",
        "LayerNorm with the unbiased variance (dividing by C - 1, torch.var's default); LayerNorm divides by C",
        wrong.normalize,
        unbiased=True,
    ),
    mistake(
        "eps_outside_sqrt",
        "LayerNorm with eps added to the standard deviation, not to the variance under the square root",
        wrong.normalize,
        eps_inside=False,
    ),
    mistake("no_affine", "LayerNorm without its weight and bias", wrong.normalize, affine=False),
    mistake(
        "no_centering", "LayerNorm without the mean subtracted (RMSNorm with a bias)", wrong.normalize, center=False
    ),
)


# inside a block (eps 1e-5) eps outside the root is within the tolerance of the block's output and
# gradients; the whole LM's gradients still show it
BLOCK_NORM_MISTAKES = tuple(m for m in LAYERNORM_MISTAKES if m.key != "eps_outside_sqrt")


def rms(fn: Callable) -> Callable:
    """A ``normalize`` switch as an RMSNorm: no bias, no centring unless the switch says so."""
    return lambda x, weight, eps: fn(x, weight, None, eps)


RMSNORM_MISTAKES = (
    mistake(
        "centered",
        "LayerNorm without bias: RMSNorm does not subtract the mean",
        rms(partial(wrong.normalize, center=True)),
    ),
    mistake(
        "eps_outside_sqrt",
        "RMSNorm with eps added to the root mean square, not under the square root",
        rms(partial(wrong.normalize, center=False, eps_inside=False)),
    ),
    mistake(
        "sum_not_mean",
        "x / sqrt(sum(x^2) + eps): RMSNorm takes the mean of the squares, not their sum",
        rms(partial(wrong.normalize, center=False, reduce="sum")),
    ),
    mistake("no_weight", "RMSNorm without its weight", rms(partial(wrong.normalize, center=False, affine=False))),
)
NO_ACTIVATION = "the feed-forward without its activation: two linear maps in a row"
GELU_MISTAKES = (
    mistake(
        "exact_gelu",
        "the feed-forward with the exact (erf) GELU; tinylm uses GPT-2's tanh approximation, "
        "F.gelu(x, approximate='tanh')",
        wrong.feed_forward,
        activation=torch.nn.functional.gelu,
    ),
    mistake("relu", "the feed-forward with ReLU instead of GELU", wrong.feed_forward, activation=torch.relu),
    mistake("no_activation", NO_ACTIVATION, wrong.feed_forward, activation=wrong.identity),
)
RELU_MISTAKES = (
    mistake(
        "gelu",
        "the feed-forward with GELU instead of ReLU",
        wrong.feed_forward,
        activation=partial(torch.nn.functional.gelu, approximate="tanh"),
    ),
    mistake("no_activation", NO_ACTIVATION, wrong.feed_forward, activation=wrong.identity),
)
SWIGLU_MISTAKES = (
    mistake(
        "gate_up_swapped",
        "SwiGLU with gate and up swapped, silu(up(x)) * gate(x); tinylm computes down(silu(gate(x)) * up(x))",
        wrong.feed_forward,
        swap=True,
    ),
    mistake(
        "sigmoid_gate",
        "SwiGLU with sigmoid instead of SiLU (a GLU): sigmoid(gate(x)) * up(x)",
        wrong.feed_forward,
        gate_fn=torch.sigmoid,
    ),
)
BLOCK_MISTAKES = (
    mistake(
        "normed_residual",
        "a block whose residual stream carries the norm's output, n = norm1(x), h = n + attn(n); tinylm adds "
        "to x itself: h = x + attn(norm1(x))",
        wrong.block,
        layout="normed_residual",
    ),
    mistake(
        "post_norm",
        "a post-norm block, norm1(x + attn(x)) then norm2(h + ffn(h)); tinylm's block is pre-norm: "
        "h = x + attn(norm1(x)), then h + ffn(norm2(h))",
        wrong.block,
        layout="post",
    ),
    mistake(
        "parallel",
        "a parallel block, x + attn(norm1(x)) + ffn(norm2(x)); in tinylm's the feed-forward reads x + attn(norm1(x))",
        wrong.block,
        layout="parallel",
    ),
    mistake("no_residual", "a block without its residual connections", wrong.block, layout="no_residual"),
    mistake(
        "norm1_twice",
        "a block with norm1 before the feed-forward too; norm2 belongs there",
        wrong.block,
        layout="one_norm",
    ),
    *(inside(m, "block", wrong.block) for m in ATTENTION_MISTAKES),
    *(norm_inside(m, "block", wrong.block) for m in BLOCK_NORM_MISTAKES),
)
CROSS_ENTROPY_MISTAKES = (
    mistake(
        "mean_over_padding",
        "the loss averaged over every position, padding included; divide by the targets that are not ignore_index",
        wrong.cross_entropy,
        divide_by="positions",
    ),
    mistake(
        "sum", "the summed loss; tinylm takes the mean over the counted targets", wrong.cross_entropy, divide_by="none"
    ),
    mistake(
        "mean_of_row_means",
        "the mean of each row's mean loss; tinylm averages all counted targets at once, so a row with more "
        "padding does not weigh more per target",
        wrong.cross_entropy,
        divide_by="rows",
    ),
)
ADAMW_MISTAKES = (
    mistake("no_bias_correction", "AdamW without bias correction of the moments", wrong.adamw, bias_correction=False),
    mistake(
        "l2_in_gradient",
        "Adam with L2 regularisation (weight_decay * param added to the gradient); AdamW decays the weights "
        "apart from the gradient: param *= 1 - lr * weight_decay",
        wrong.adam_l2,
    ),
    mistake(
        "decay_without_lr",
        "AdamW with the decay not scaled by lr: param *= 1 - weight_decay instead of 1 - lr * weight_decay",
        wrong.adamw,
        decay="plain",
    ),
    mistake(
        "step_off_by_one",
        "AdamW with the bias correction one step ahead, 1 - beta ** (step + 1); step is this update's number, from 1",
        wrong.adamw,
        t_offset=1,
    ),
)
SCHEDULE_MISTAKES = (
    mistake("no_warmup", "a cosine from step 0 without the warmup", wrong.cosine_schedule, variant="no_warmup"),
    mistake(
        "warmup_from_zero",
        "a warmup of max_lr * step / warmup, which gives step 0 a rate of 0; tinylm's is max_lr * (step + 1) / warmup",
        wrong.cosine_schedule,
        variant="warmup_from_zero",
    ),
    mistake(
        "progress_from_zero",
        "a cosine whose progress is step / total; tinylm's decay starts after warmup: "
        "(step - warmup) / (total - warmup)",
        wrong.cosine_schedule,
        variant="progress_from_zero",
    ),
    mistake("to_zero", "a cosine that decays to 0 instead of min_lr", wrong.cosine_schedule, variant="to_zero"),
    mistake(
        "no_clamp",
        "a cosine that rises again after total steps; tinylm stays at min_lr from step total on",
        wrong.cosine_schedule,
        variant="no_clamp",
    ),
)
CLIP_MISTAKES = (
    mistake(
        "per_tensor",
        "each gradient clipped by its own norm; the norm is over all gradients together",
        wrong.clip_grad_norm,
        how="per_tensor",
    ),
    mistake(
        "by_value",
        "gradients clamped to [-max_norm, max_norm] (clipping by value), not scaled by max_norm / norm",
        wrong.clip_grad_norm,
        how="by_value",
    ),
    mistake(
        "always_scaled",
        "gradients scaled to max_norm even when their norm is below it",
        wrong.clip_grad_norm,
        how="always",
    ),
)
TOP_K_MISTAKES = (
    mistake("k_plus_one", "top-k keeping k + 1 logits", wrong.top_k_shifted, by=1),
    mistake("k_minus_one", "top-k keeping k - 1 logits (a strict > where >= belongs?)", wrong.top_k_shifted, by=-1),
    mistake(
        "zero_fill", "top-k with the other logits set to 0, not -inf: they can still be sampled", wrong.top_k_zero_fill
    ),
    mistake("smallest", "top-k keeping the k smallest logits", wrong.top_k_smallest),
)
TOP_P_MISTAKES = (
    mistake(
        "drops_crossing_token",
        "top-p that drops the token whose probability crosses p (cumsum > p); tinylm keeps tokens until their "
        "mass reaches p, that token included, and always the most likely one",
        wrong.top_p,
        keep_crossing=False,
    ),
    mistake(
        "sorted_ascending",
        "top-p over logits sorted ascending (torch.sort's default): it keeps the least likely tokens",
        wrong.top_p,
        descending=False,
    ),
)


LM_MISTAKES = (
    mistake("no_positions", "tinylm's LM without the position embeddings added", wrong.lm_logits, positions=False),
    mistake(
        "no_final_norm",
        "tinylm's LM without the final norm (norm_f) before the head",
        wrong.lm_logits,
        final_norm=False,
    ),
    mistake("post_norm", "tinylm's LM with post-norm blocks; its blocks are pre-norm", wrong.lm_logits, layout="post"),
    mistake(
        "tied_head",
        "tinylm's LM reading the logits out with tok_emb.weight; this LM's head is its own lm_head.weight",
        wrong.lm_logits,
        head="tok_emb.weight",
    ),
    *(inside(m, "LM", wrong.lm_logits) for m in ATTENTION_MISTAKES),
    *(norm_inside(m, "LM", wrong.lm_logits) for m in LAYERNORM_MISTAKES),
)
GQA_MISTAKES = (
    mistake(
        "kv_heads_tiled",
        "grouped-query attention with query head h reading kv head h % n_kv_heads (k.repeat); tinylm gives "
        "each kv head a run of consecutive query heads, h // (n_heads / n_kv_heads) (repeat_interleave)",
        wrong.grouped_query_attention,
        tiled=True,
    ),
)
ACCUMULATION_MISTAKES = (
    mistake(
        "not_divided_by_k",
        "each micro-batch's mean loss backpropagated as it is: the gradients are the sum of k means, about k "
        "times the batch's",
        wrong.accumulated_gradients,
        divide="none",
    ),
    mistake(
        "mean_of_micro_means",
        "each micro-batch's mean loss divided by k: with padding the micro-batches hold different numbers of "
        "targets, so the mean of their means is not the batch's mean (tinylm divides each summed loss by the "
        "batch's count of targets)",
        wrong.accumulated_gradients,
        divide="k",
    ),
    mistake(
        "gradients_zeroed_each_micro_batch",
        "the last micro-batch's gradients only: they were zeroed before each micro-batch",
        wrong.accumulated_gradients,
        divide="last",
    ),
)
CHECKPOINT_MISTAKES = (
    mistake(
        "input_detached",
        "blocks whose recomputation starts from a detached input whose gradient is not returned: no gradient "
        "reaches x or the blocks before the last",
        wrong.checkpointed_blocks,
        detach_inputs=True,
    ),
    *(inside(m, "blocks", wrong.checkpointed_blocks) for m in ATTENTION_MISTAKES),
    *(norm_inside(m, "blocks", wrong.checkpointed_blocks) for m in BLOCK_NORM_MISTAKES),
)
ONE_BATCH = (
    "one_batch",
    "the gradients of the whole batch in one forward and backward: they are right, but nothing was "
    "accumulated over micro-batches",
)
PREFIX_RECOMPUTED = (
    "prefix_recomputed",
    "a decoding that runs the whole prefix through the model at each step: the logits are right, but nothing is cached",
)
NOT_CHECKPOINTED = (
    "not_checkpointed",
    "a forward that keeps every activation for backward: the gradients are right, but nothing is recomputed",
)
KV_MISTAKES = (
    mistake(
        "position_off_by_one",
        "the cached LM with each new token at position t + 1: the cache position is off by one "
        "(the token at index t has position t, so the first is 0)",
        wrong.kv_cached_logits,
        position_offset=1,
    ),
    mistake(
        "position_always_zero",
        "the cached LM with every new token at position 0: the position must follow the cache's length",
        wrong.kv_cached_logits,
        fixed_position=True,
    ),
    mistake(
        "key_cached_after_attending",
        "the cached LM whose new key and value join the cache after the token attended: each token must see itself",
        wrong.kv_cached_logits,
        key_after=True,
    ),
)
GREEDY_MISTAKES = (
    mistake(
        "first_position_logits",
        "greedy decoding from the logits of the first position (logits[:, 0]); the next token is read at the last",
        wrong.greedy_decode,
        position=0,
    ),
    mistake(
        "token_not_fed_back",
        "greedy decoding that never appends the chosen token: every step predicts from the prompt",
        wrong.greedy_decode,
        feed_back=False,
    ),
)
BEAM_MISTAKES = (
    mistake(
        "not_length_normalised",
        "beam search whose finished hypotheses score the plain sum of log-probabilities; tinylm divides by "
        "the generated length (the stop token counted) ** length_penalty",
        wrong.beam_search,
        normalise=False,
    ),
    mistake(
        "eos_at_any_rank",
        "beam search that lets a candidate ending in <eos> finish at any of the 2k ranks; only the first k "
        "candidates may finish (Hugging Face's rule, tinylm's)",
        wrong.beam_search,
        any_rank=True,
    ),
    mistake(
        "beams_start_equal",
        "beam search whose k beams all start at score 0: the first step extends the same prompt k times with "
        "one token; beam 0 starts at 0 and the others at -1e9",
        wrong.beam_search,
        one_start=False,
    ),
)
BPE_TRAIN_MISTAKES = (
    mistake(
        "ties_first_seen",
        "BPE whose ties go to the pair seen first (max(counts, key=counts.get)); tinylm merges the pair with the "
        "smallest (left id, right id)",
        wrong.train_bpe,
        ties="first_seen",
    ),
    mistake(
        "ties_greatest_bytes",
        "BPE whose ties go to the lexicographically greatest pair of bytes (CS336's rule); tinylm merges the "
        "pair with the smallest (left id, right id)",
        wrong.train_bpe,
        ties="greatest_bytes",
    ),
    mistake(
        "no_pretokenization",
        "BPE trained on the text as one sequence: merges cross word boundaries; tinylm first splits the text "
        "with the pattern and counts pairs inside pre-tokens",
        wrong.train_bpe,
        pretokenize=False,
    ),
)
BPE_ENCODE_MISTAKES = (
    mistake(
        "leftmost_merge_first",
        "encoding that merges the leftmost mergeable pair first; merges are applied by rank (the lowest-ranked "
        "pair present, wherever it is)",
        wrong.bpe_encode,
        leftmost=True,
    ),
)
BPE_DECODE_MISTAKES = (
    mistake(
        "tokens_decoded_one_by_one",
        "each token's bytes decoded to text on its own: a character split over tokens becomes U+FFFD; join "
        "the bytes of every token, then decode once",
        wrong.bpe_decode_per_token,
    ),
)
WORD_MISTAKES = (
    mistake(
        "ties_first_seen",
        "a vocabulary whose equally frequent words are ranked by first appearance (Counter.most_common); "
        "tinylm ranks them alphabetically",
        wrong.word_encode,
        ties="first_seen",
    ),
    mistake(
        "unknown_dropped",
        "encoding that leaves unknown words out; each becomes <unk> (id 1)",
        wrong.word_encode,
        unknown="drop",
    ),
    mistake(
        "specials_not_counted",
        "a vocabulary of vocab_size words; the four special tokens count in vocab_size, so it holds "
        "vocab_size - 4 words",
        wrong.word_encode,
        specials=False,
    ),
)
ADD_K_MISTAKES = (
    mistake(
        "no_kv_in_denominator",
        "add-k without k V in the denominator, (c(v w) + k) / c(v): the rows do not sum to 1",
        wrong.ngram_probs,
        variant="no_kv",
    ),
    mistake("laplace", "add-one (Laplace) smoothing whatever k is", wrong.ngram_probs, variant="laplace"),
    mistake(
        "seen_vocabulary",
        "add-k with V the number of ids seen in training; V is the whole vocabulary (vocab_size)",
        wrong.ngram_probs,
        variant="seen_vocab",
    ),
)
KN_MISTAKES = (
    mistake(
        "no_discount",
        "Kneser-Ney without the discount: maximum-likelihood bigrams, the lower order never used",
        wrong.ngram_probs,
        variant="no_discount",
    ),
    mistake(
        "raw_lower_order",
        "Kneser-Ney whose lower order uses raw unigram counts; Kneser-Ney's uses continuation counts, "
        "N1+(. w): how many distinct tokens precede w",
        wrong.ngram_probs,
        variant="raw_unigram",
    ),
    mistake(
        "no_interpolation",
        "Kneser-Ney without the interpolation weight d N1+(v .) / c(v) on the lower order: the rows do not sum to 1",
        wrong.ngram_probs,
        variant="no_interpolation",
    ),
    mistake(
        "unigram_not_discounted",
        "Kneser-Ney whose lower order is N1+(. w) / N1+(. .) as it is; tinylm (KenLM) discounts it too and "
        "gives the freed mass to the uniform 1 / V",
        wrong.ngram_probs,
        variant="unigram_not_discounted",
    ),
)


# ---------------------------------------------------------------------------- canonical forms
def as_ids(output) -> torch.Tensor:
    """Token ids (a list of ints or a 1-d tensor) as an int64 tensor."""
    if isinstance(output, torch.Tensor):
        values = output.flatten()
    elif isinstance(output, list) and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in output):
        values = torch.stack([v.reshape(()) for v in output]) if output else torch.zeros(0)
    else:
        raise TypeError("expected token ids: a list of ints or a 1-d tensor")
    return values.double().round().long()


def as_hypotheses(output) -> list[dict]:
    if not isinstance(output, list) or not all(isinstance(h, list) and len(h) == 2 for h in output):
        raise TypeError("expected a list of (tokens, score) pairs, best first")
    return [
        {"tokens": as_ids(tokens), "score": torch.as_tensor(score).double().reshape(())} for tokens, score in output
    ]


def as_merges(output) -> list[list[bytes]]:
    if not isinstance(output, list) or not all(
        isinstance(m, list) and len(m) == 2 and all(isinstance(t, bytes) for t in m) for m in output
    ):
        raise TypeError("expected a list of (bytes, bytes) merges")
    return output


def as_text(output) -> str:
    if not isinstance(output, str):
        raise TypeError("expected a str")
    return output


def uncached_logits(tokens, weights, config):
    """What the cached step must equal: tinylm's forward over the whole sequence at once."""
    return ref.run_transformer_lm(tokens, weights, config)


# ------------------------------------------------------------------------------ the parts
def _part(name, inputs, reference, tolerance, grad=(), mistakes=(), function=None, **more) -> Part:
    return Part(name, function or f"run_{name}", inputs, reference, tolerance, tuple(grad), tuple(mistakes), **more)


PARTS: tuple[Part, ...] = (
    _part("linear", linear_inputs, ref.run_linear, PRODUCT, ("x", "weight", "bias"), LINEAR_MISTAKES),
    _part("embedding", embedding_inputs, ref.run_embedding, ELEMENTWISE, ("weight",)),
    _part("softmax", softmax_inputs, ref.run_softmax, ELEMENTWISE, ("x",), SOFTMAX_MISTAKES),
    _part(
        "scaled_dot_product_attention",
        attention_inputs,
        ref.run_scaled_dot_product_attention,
        ATTENTION,
        ("q", "k", "v"),
        ATTENTION_MISTAKES,
    ),
    _part(
        "multihead_attention",
        partial(multihead_inputs, rope=False),
        ref.run_multihead_attention,
        ATTENTION,
        ("x", "weights"),
        MULTIHEAD_MISTAKES,
    ),
    _part(
        "multihead_attention_rope",
        partial(multihead_inputs, rope=True),
        ref.run_multihead_attention,
        ATTENTION,
        ("x", "weights"),
        ROPE_MISTAKES + MULTIHEAD_MISTAKES,
        function="run_multihead_attention",
    ),
    _part("layernorm", layernorm_inputs, ref.run_layernorm, NORM, ("x", "weight", "bias"), LAYERNORM_MISTAKES),
    _part("rmsnorm", rmsnorm_inputs, ref.run_rmsnorm, NORM, ("x", "weight"), RMSNORM_MISTAKES),
    _part(
        "feed_forward_gelu",
        partial(feed_forward_inputs, kind="gelu"),
        ref.run_feed_forward,
        PRODUCT,
        ("x", "weights"),
        GELU_MISTAKES,
        function="run_feed_forward",
    ),
    _part(
        "feed_forward_relu",
        partial(feed_forward_inputs, kind="relu"),
        ref.run_feed_forward,
        PRODUCT,
        ("x", "weights"),
        RELU_MISTAKES,
        function="run_feed_forward",
    ),
    _part(
        "feed_forward_swiglu",
        partial(feed_forward_inputs, kind="swiglu"),
        ref.run_feed_forward,
        PRODUCT,
        ("x", "weights"),
        SWIGLU_MISTAKES,
        function="run_feed_forward",
    ),
    _part("block", block_inputs, ref.run_block, ATTENTION, ("x", "weights"), BLOCK_MISTAKES),
    _part("cross_entropy", cross_entropy_inputs, ref.run_cross_entropy, LOSS, ("logits",), CROSS_ENTROPY_MISTAKES),
    _part("adamw_step", adamw_inputs, ref.run_adamw_step, UPDATE, (), ADAMW_MISTAKES),
    _part("cosine_schedule", schedule_inputs, ref.run_cosine_schedule, SCHEDULE, (), SCHEDULE_MISTAKES),
    _part("clip_grad_norm", clip_inputs, ref.run_clip_grad_norm, UPDATE, (), CLIP_MISTAKES),
    _part("top_k_filter", top_k_inputs, ref.run_top_k_filter, COPY, (), TOP_K_MISTAKES),
    _part("top_p_filter", top_p_inputs, ref.run_top_p_filter, COPY, (), TOP_P_MISTAKES),
    _part("transformer_lm", lm_inputs, ref.run_transformer_lm, LM, ("weights",), LM_MISTAKES),
    _part(
        "grouped_query_attention",
        gqa_inputs,
        ref.run_grouped_query_attention,
        ATTENTION,
        ("x", "weights"),
        GQA_MISTAKES,
    ),
    _part(
        "gradient_accumulation",
        accumulation_inputs,
        ref.run_accumulated_gradients,
        ACCUMULATED,
        (),
        ACCUMULATION_MISTAKES,
        function="run_accumulated_gradients",
        batch_rows=ACCUMULATION_ROWS,
    ),
    _part(
        "gradient_checkpointing",
        checkpoint_inputs,
        ref.run_checkpointed_blocks,
        ATTENTION,
        ("x", "weights"),
        CHECKPOINT_MISTAKES,
        function="run_checkpointed_blocks",
        memory_baseline=wrong.checkpointed_blocks,
    ),
    _part(
        "kv_cache",
        kv_inputs,
        uncached_logits,
        LM,
        (),
        KV_MISTAKES,
        function="run_kv_cached_logits",
        flops_baseline=ref.run_kv_cached_logits,
    ),
    _part("greedy_decode", greedy_inputs, ref.run_greedy_decode, EXACT, (), GREEDY_MISTAKES, canonical=as_ids),
    _part("beam_search", beam_inputs, ref.run_beam_search, DECODED, (), BEAM_MISTAKES, canonical=as_hypotheses),
    _part(
        "bpe_train",
        bpe_train_inputs,
        ref.run_train_bpe,
        EXACT,
        (),
        BPE_TRAIN_MISTAKES,
        function="run_train_bpe",
        canonical=as_merges,
    ),
    _part("bpe_encode", bpe_encode_inputs, ref.run_bpe_encode, EXACT, (), BPE_ENCODE_MISTAKES, canonical=as_ids),
    _part("bpe_decode", bpe_decode_inputs, ref.run_bpe_decode, EXACT, (), BPE_DECODE_MISTAKES, canonical=as_text),
    _part(
        "word_vocab",
        word_inputs,
        ref.run_word_encode,
        EXACT,
        (),
        WORD_MISTAKES,
        function="run_word_encode",
        canonical=as_ids,
    ),
    _part(
        "ngram_add_k",
        partial(ngram_inputs, smoothing="add_k"),
        ref.run_ngram_probs,
        PROBABILITY,
        (),
        ADD_K_MISTAKES,
        function="run_ngram_probs",
    ),
    _part(
        "ngram_kneser_ney",
        partial(ngram_inputs, smoothing="kneser_ney"),
        ref.run_ngram_probs,
        PROBABILITY,
        (),
        KN_MISTAKES,
        function="run_ngram_probs",
    ),
)
PARTS_BY_NAME = {part.name: part for part in PARTS}
# the parts each part is built from in the contract (a student's block calls its own LayerNorm and
# attention): a part that differs where one of these differs is reported as following from it
ATTENTION_PARTS = ("linear", "softmax", "scaled_dot_product_attention")
BUILDS_ON: dict[str, tuple[str, ...]] = {
    "multihead_attention": ATTENTION_PARTS,
    "multihead_attention_rope": ATTENTION_PARTS,
    "grouped_query_attention": ATTENTION_PARTS,
    "feed_forward_gelu": ("linear",),
    "feed_forward_relu": ("linear",),
    "feed_forward_swiglu": ("linear",),
    "block": ("layernorm", "multihead_attention", "feed_forward_gelu"),
    "transformer_lm": ("embedding", "block", "layernorm", "linear"),
    "gradient_checkpointing": ("block",),
    "gradient_accumulation": ("linear", "cross_entropy"),
    "kv_cache": ("transformer_lm",),
    "greedy_decode": ("transformer_lm",),
    "beam_search": ("transformer_lm",),
}
