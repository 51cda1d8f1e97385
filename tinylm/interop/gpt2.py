"""Hugging Face GPT-2 <-> tinylm GPT.

GPT-2 is tinylm's default architecture (pre-LN, learned positions, LayerNorm, tanh-GELU, biases,
tied head), so the mapping is one tensor to one tensor: GPT-2's ``Conv1D`` layers store weights
as (in, out) and are transposed; its fused ``c_attn`` is tinylm's ``qkv`` (q, k, v rows in the
same order).
"""

from __future__ import annotations

import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.interop.llama import refuse_options_no_format_has
from tinylm.models.gpt import GPT


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise TinyLMError(f"GPT-2 model not supported by tinylm: {what}")


def config_from_gpt2(c) -> ModelConfig:
    _check(
        c.activation_function in ("gelu_new", "gelu_pytorch_tanh"),
        f"activation {c.activation_function!r} (tinylm uses tanh GELU)",
    )
    _check(bool(getattr(c, "scale_attn_weights", True)), "scale_attn_weights=False")
    _check(not getattr(c, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=True")
    return ModelConfig(
        vocab_size=c.vocab_size,
        context_length=c.n_positions,
        d_model=c.n_embd,
        n_layers=c.n_layer,
        n_heads=c.n_head,
        d_ff=c.n_inner or 4 * c.n_embd,
        dropout=0.0,
        positions="learned",
        norm="layernorm",
        norm_eps=c.layer_norm_epsilon,
        ffn="gelu",
        bias=True,
        tie_weights=bool(getattr(c, "tie_word_embeddings", True)),
        attention="sdpa",
    )


# (HF GPT-2 name, tinylm name, transposed?) of every per-layer weight;
# HF's Conv1D stores weights as (in, out), nn.Linear as (out, in)
LAYER_WEIGHTS = [
    ("attn.c_attn.weight", "attn.qkv.weight", True),
    ("attn.c_attn.bias", "attn.qkv.bias", False),
    ("attn.c_proj.weight", "attn.out_proj.weight", True),
    ("attn.c_proj.bias", "attn.out_proj.bias", False),
    ("mlp.c_fc.weight", "ffn.up.weight", True),
    ("mlp.c_fc.bias", "ffn.up.bias", False),
    ("mlp.c_proj.weight", "ffn.down.weight", True),
    ("mlp.c_proj.bias", "ffn.down.bias", False),
    ("ln_1.weight", "norm1.weight", False),
    ("ln_1.bias", "norm1.bias", False),
    ("ln_2.weight", "norm2.weight", False),
    ("ln_2.bias", "norm2.bias", False),
]


def _rename_layer(sd: dict, i: int, to_tinylm: bool) -> dict:
    out = {}
    for hf_name, our_name, transposed in LAYER_WEIGHTS:
        src, dst = f"transformer.h.{i}.{hf_name}", f"blocks.{i}.{our_name}"
        if not to_tinylm:
            src, dst = dst, src
        out[dst] = sd[src].t() if transposed else sd[src]
    return out


@torch.no_grad()
def from_hf_gpt2(hf_model) -> GPT:
    """A tinylm GPT with the weights of a ``transformers`` ``GPT2LMHeadModel``."""
    cfg = config_from_gpt2(hf_model.config)
    model = GPT(cfg)
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    new = {
        "tok_emb.weight": sd["transformer.wte.weight"],
        "pos_emb.weight": sd["transformer.wpe.weight"],
        "norm_f.weight": sd["transformer.ln_f.weight"],
        "norm_f.bias": sd["transformer.ln_f.bias"],
        "lm_head.weight": sd.get("lm_head.weight", sd["transformer.wte.weight"]),
    }
    for i in range(cfg.n_layers):
        new.update(_rename_layer(sd, i, to_tinylm=True))
    model.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=True)
    return model.eval()


def is_gpt2_shape(cfg: ModelConfig) -> bool:
    cfg = cfg.resolved()
    return (
        cfg.positions == "learned"
        and cfg.norm == "layernorm"
        and cfg.ffn == "gelu"
        and cfg.bias
        and cfg.n_kv_heads == cfg.n_heads
        and cfg.d_attn == cfg.d_model
    )


@torch.no_grad()
def to_hf_gpt2(model: GPT):
    """A ``GPT2LMHeadModel`` with the weights of a tinylm GPT of GPT-2 shape."""
    from transformers import GPT2Config, GPT2LMHeadModel  # deferred: transformers takes seconds to import

    cfg = model.config
    if not is_gpt2_shape(cfg):
        raise TinyLMError(
            "only a GPT-2-shaped tinylm model (learned positions, LayerNorm, GELU, biases, "
            "no GQA, d_attn == d_model) exports to GPT-2; Llama-shaped models export to Llama"
        )
    refuse_options_no_format_has(cfg, "a Hugging Face GPT-2 model")
    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context_length,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.d_ff,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=cfg.tie_weights,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    hf = GPT2LMHeadModel(hf_cfg)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    new = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["norm_f.weight"],
        "transformer.ln_f.bias": sd["norm_f.bias"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        new.update(_rename_layer(sd, i, to_tinylm=False))
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and not k.endswith("masked_bias")]
    if missing or unexpected:
        raise TinyLMError(f"GPT-2 export mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return hf.eval()
