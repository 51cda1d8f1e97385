"""The adapter contract (``adapter_template.py``) filled with tinylm's own modules: the references
``tinylm check`` compares a student's parts with, and the worked example a teacher can read.

Each function builds the tinylm module that does the work (``CausalSelfAttention``, ``Block``, ...)
and runs it with the given tensors as its parameters (``torch.func.functional_call``), so that
gradients reach those tensors. Weights come under tinylm's state-dict names with q, k, v (gate, up)
apart, as ``state_dict_by_parts`` writes them; ``join_parts`` fuses them the way loading does.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tinylm.config import GenerationConfig, ModelConfig
from tinylm.generation.beam import beam_search
from tinylm.generation.decode import decode_step
from tinylm.generation.generate import generate_many
from tinylm.generation.processors import top_k_filter, top_p_filter
from tinylm.interop.loading import load_any_checkpoint
from tinylm.models.gpt import (
    GPT,
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
from tinylm.models.ngram import NGramLM
from tinylm.tokenizers.bpe import BYTE_BASE, FIRST_MERGE_ID, BPETokenizer
from tinylm.tokenizers.word import WordTokenizer
from tinylm.training.distributed import DistContext
from tinylm.training.optim import scheduled_lr
from tinylm.training.trainer import accumulate_gradients

ROPE_THETA = 10000.0  # tinylm's default (ModelConfig.rope_theta)
BLOCK_NORM_EPS = 1e-5  # tinylm's default (ModelConfig.norm_eps)


# ----------------------------------------------------------------------- tinylm's modules
def model_config(d_model: int, n_heads: int = 1, d_ff: int | None = None, **options) -> ModelConfig:
    """The configuration of one module of that width (dropout 0: the checks are deterministic)."""
    return ModelConfig(vocab_size=1, d_model=d_model, n_heads=n_heads, d_ff=d_ff, **options).resolved()


def attention_module(d_model: int, n_heads: int, bias: bool = True, n_kv_heads: int | None = None):
    return CausalSelfAttention(model_config(d_model, n_heads, bias=bias, n_kv_heads=n_kv_heads)).eval()


def feed_forward_module(d_model: int, d_ff: int, kind: str, bias: bool = True) -> FeedForward:
    return FeedForward(model_config(d_model, d_ff=d_ff, ffn=kind, bias=bias)).eval()


def block_module(d_model: int, n_heads: int, d_ff: int) -> Block:
    """tinylm's default block: pre-norm, LayerNorm, GELU (tanh), biases."""
    return Block(model_config(d_model, n_heads, d_ff)).eval()


def gpt_module(config: dict) -> GPT:
    """The whole LM the adapter's ``config`` describes: tinylm's defaults (learned positions,
    pre-norm LayerNorm blocks, GELU, biases) with an output head of its own (``lm_head.weight``)."""
    return GPT(ModelConfig(**config, tie_weights=False)).eval()


def gpt_with_weights(weights: dict[str, torch.Tensor], config: dict) -> GPT:
    """The LM with ``weights`` loaded (q, k, v stored apart are fused as loading fuses them)."""
    model = gpt_module(config)
    model.load_state_dict({name: w.detach() for name, w in weights.items()})
    return model


def weights_under(weights: dict, prefix: str) -> dict:
    """The entries of ``weights`` under ``prefix`` (``attn.``, ``blocks.0.``), without it."""
    return {name[len(prefix) :]: w for name, w in weights.items() if name.startswith(prefix)}


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


# ------------------------------------------------------------------------- the whole model
def run_transformer_lm(tokens, weights, config):
    return call_with_weights(gpt_module(config), weights, tokens)[0]


def run_grouped_query_attention(x, weights, n_heads, n_kv_heads):
    attention = attention_module(x.shape[-1], n_heads, bias="q_proj.bias" in weights, n_kv_heads=n_kv_heads)
    return call_with_weights(attention, weights, x, None)


def run_accumulated_gradients(x, targets, weight, bias, micro_batches, ignore_index):
    # the trainer's own accumulation: each micro-batch's summed loss over the batch's target count
    w, b = nn.Parameter(weight.detach().clone()), nn.Parameter(bias.detach().clone())

    def run_model(xm, ym, loss_reduction):
        logits = F.linear(xm, w, b)
        flat = logits.reshape(-1, logits.shape[-1])
        return logits, F.cross_entropy(flat, ym.reshape(-1), ignore_index=ignore_index, reduction=loss_reduction)

    rows = x.shape[0] // micro_batches
    micro = [(x[i * rows : (i + 1) * rows], targets[i * rows : (i + 1) * rows]) for i in range(micro_batches)]
    accumulate_gradients(run_model, micro, torch.device("cpu"), dist=DistContext())
    return {"weight": w.grad, "bias": b.grad}


def run_checkpointed_blocks(x, weights, n_heads, n_layers):
    # torch.utils.checkpoint, tinylm's reference for its own CheckpointedBlock (training.grad_checkpoint);
    # that Function takes a module's own parameters, and these weights are plain tensors
    block = block_module(x.shape[-1], n_heads, weights["blocks.0.ffn.up.weight"].shape[0])
    h = x
    for i in range(n_layers):
        h = torch.utils.checkpoint.checkpoint(
            call_with_weights, block, weights_under(weights, f"blocks.{i}."), h, use_reentrant=False
        )
    return h


# -------------------------------------------------------------------------------- decoding
def run_kv_cached_logits(tokens, weights, config):
    # the first token fills the cache as a prompt does; each next one is tinylm's decoding step
    model = gpt_with_weights(weights, config)
    model.prepare_for_decoding()
    with torch.inference_mode():
        cache = model.new_kv_cache(tokens.shape[0], tokens.shape[1])
        first, _ = model(tokens[:, :1], kv_cache=cache)
        steps = [first[:, 0]] + [decode_step(model, cache, tokens[:, t]) for t in range(1, tokens.shape[1])]
    return torch.stack(steps, dim=1)


def run_greedy_decode(prompt, weights, config, max_new_tokens):
    generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    return generate_many(gpt_with_weights(weights, config), [prompt.tolist()], generation)[0].tokens


def run_beam_search(prompt, weights, config, beam_width, max_new_tokens, eos_id, length_penalty):
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens,
        beam_width=beam_width,
        num_return_sequences=beam_width,
        stop_ids=(eos_id,),
        length_penalty=length_penalty,
    )
    hypotheses = beam_search(gpt_with_weights(weights, config), [prompt.tolist()], generation)[0]
    return [(h.tokens, h.score) for h in hypotheses]


# ------------------------------------------------------------------- tokenizers and n-grams
def bpe_tokenizer(merges, pattern) -> BPETokenizer:
    """tinylm's byte-level BPE from merges given as byte strings (the contract's form)."""
    ids = {bytes([b]): BYTE_BASE + b for b in range(256)}
    pairs = []
    for i, (a, b) in enumerate(merges):
        pairs.append((ids[bytes(a)], ids[bytes(b)]))
        ids[bytes(a) + bytes(b)] = FIRST_MERGE_ID + i
    return BPETokenizer(pairs, pattern)


def run_train_bpe(text, n_merges, pattern):
    tokenizer = BPETokenizer(pattern=pattern).train([text], FIRST_MERGE_ID + n_merges)
    return [(tokenizer.token_bytes[a], tokenizer.token_bytes[b]) for a, b in tokenizer.merges]


def run_bpe_encode(text, merges, pattern):
    # tinylm's ids start after its special tokens; the contract's bytes are 0..255
    return [i - BYTE_BASE for i in bpe_tokenizer(merges, pattern).encode(text)]


def run_bpe_decode(ids, merges):
    return bpe_tokenizer(merges, "gpt2").decode([BYTE_BASE + int(i) for i in ids])


def run_word_encode(train_text, text, vocab_size):
    return WordTokenizer().train([train_text], vocab_size).encode(text)


def run_ngram_probs(train, vocab_size, contexts, smoothing, k, discount):
    model = NGramLM(2, vocab_size, smoothing, k=k, discounts=[discount]).fit(train.tolist())
    return torch.from_numpy(np.stack([model.distribution([int(c)]) for c in contexts]))


# ------------------------------------------------- a whole model: `tinylm evaluate --adapter`
# A tinylm checkpoint behind the whole-model functions: the run directory in the environment
# variable TINYLM_CHECKPOINT, else runs/demo (what `make demo` trains). `tinylm evaluate --adapter`
# on this file gives the numbers `tinylm evaluate --checkpoint` gives on that checkpoint.
@functools.cache
def checkpoint_model():
    model, tokenizer, _ = load_any_checkpoint(os.environ.get("TINYLM_CHECKPOINT", "runs/demo"))
    return model, tokenizer


def model_info():
    model, tokenizer = checkpoint_model()
    return {
        "context_length": model.config.context_length,
        "bos_id": tokenizer.bos_id,
        "stop_ids": list(tokenizer.stop_ids),
    }


def model_encode(text):
    return checkpoint_model()[1].encode(text)


def model_decode(ids):
    return checkpoint_model()[1].decode(ids)


def model_logits(tokens):
    with torch.inference_mode():
        return checkpoint_model()[0](tokens)[0]


def model_generate(prompt, max_new_tokens, use_cache):
    generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, use_cache=use_cache)
    return generate_many(checkpoint_model()[0], [list(prompt)], generation)[0].tokens
