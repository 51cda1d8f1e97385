"""Hugging Face Llama <-> tinylm GPT of Llama shape (RMSNorm, rotary positions, SwiGLU, no biases,
optional grouped-query attention).

Rotary layout: tinylm (like Meta's and llama2.c's code) rotates consecutive pairs (x0, x1),
(x2, x3), ...; HF Llama rotates (x_i, x_{i + D/2}). The two agree once the rows of the q and k
projections are permuted inside each head; ``meta_to_hf_rows`` / ``hf_to_meta_rows`` do that.
"""

from __future__ import annotations

import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT, state_dict_by_parts


def meta_to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from pair-interleaved to half-split layout."""
    out, inp = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def hf_to_meta_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, inp = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, inp).transpose(1, 2).reshape(out, inp)


# (HF Llama name, tinylm name) of every per-layer weight; q and k also need their rows permuted.
# tinylm's fused matrices are named by their parts here (attn.q_proj: the q rows of attn.qkv;
# ffn.gate, ffn.up: the halves of ffn.gate_up): ``state_dict_by_parts`` splits a model's state
# that way, and loading a state dict so named joins the parts.
LAYER_WEIGHTS = [
    ("self_attn.q_proj.weight", "attn.q_proj.weight"),
    ("self_attn.k_proj.weight", "attn.k_proj.weight"),
    ("self_attn.v_proj.weight", "attn.v_proj.weight"),
    ("self_attn.o_proj.weight", "attn.out_proj.weight"),
    ("mlp.gate_proj.weight", "ffn.gate.weight"),
    ("mlp.up_proj.weight", "ffn.up.weight"),
    ("mlp.down_proj.weight", "ffn.down.weight"),
    ("input_layernorm.weight", "norm1.weight"),
    ("post_attention_layernorm.weight", "norm2.weight"),
]


def _rename_layers(sd: dict, cfg: ModelConfig, to_tinylm: bool, permute_rows) -> dict:
    """Per-layer weights of ``sd`` under the other side's names, q/k rows permuted by ``permute_rows``."""
    heads = {"self_attn.q_proj.weight": cfg.n_heads, "self_attn.k_proj.weight": cfg.n_kv_heads}
    out = {}
    for i in range(cfg.n_layers):
        for hf_name, our_name in LAYER_WEIGHTS:
            src, dst = (f"model.layers.{i}.{hf_name}", f"blocks.{i}.{our_name}")
            if not to_tinylm:
                src, dst = dst, src
            out[dst] = permute_rows(sd[src], heads[hf_name]) if hf_name in heads else sd[src]
    return out


def is_llama_shape(cfg: ModelConfig) -> bool:
    cfg = cfg.resolved()
    return cfg.positions == "rope" and cfg.norm == "rmsnorm" and cfg.ffn == "swiglu" and not cfg.bias


def options_no_format_has(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` that none of the formats tinylm writes (Hugging Face GPT-2 and Llama,
    llama.cpp's GGUF, llama2.c) has a place for, each named as the config writes it: a file
    written without them would load as a different model."""
    reasons = {
        f"model.value_embeddings={cfg.value_embeddings} (no other format has value embeddings)": cfg.value_embeddings
        != "none",
        "model.qk_norm=true (normalised queries and keys)": cfg.qk_norm,
        f"model.logit_softcap={cfg.logit_softcap}": cfg.logit_softcap is not None,
    }
    return [name for name, bad in reasons.items() if bad]


def refuse_options_no_format_has(cfg: ModelConfig, target: str) -> None:
    """Raise, naming them, when ``cfg`` has options that ``target`` (a format's name) cannot hold."""
    bad = options_no_format_has(cfg)
    if bad:
        raise TinyLMError(f"this model cannot be written as {target}: " + "; ".join(bad))


def non_llama_options(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` a Llama-shaped file (llama.cpp's llama graph, llama2.c) has no place
    for, each named as the config writes it."""
    cfg = cfg.resolved()
    reasons = {
        f"model.positions={cfg.positions} (Llama uses rotary positions)": cfg.positions != "rope",
        f"model.norm={cfg.norm} (Llama uses RMSNorm)": cfg.norm != "rmsnorm",
        f"model.ffn={cfg.ffn} (Llama's feed-forward is SwiGLU)": cfg.ffn != "swiglu",
        "model.bias=true (Llama has no biases)": cfg.bias,
        f"model.d_embed={cfg.d_embed} (an embedding projection)": cfg.d_embed != cfg.d_model,
    }
    return options_no_format_has(cfg) + [name for name, bad in reasons.items() if bad]


def config_from_llama(c) -> ModelConfig:
    if getattr(c, "hidden_act", "silu") != "silu":
        raise TinyLMError(f"Llama model not supported: activation {c.hidden_act!r}")
    scaling = getattr(c, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise TinyLMError(f"Llama model not supported: rope scaling {scaling}")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise TinyLMError("Llama model not supported: attention/MLP biases")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = getattr(c, "rope_theta", None)
    if theta is None:
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        vocab_size=c.vocab_size,
        context_length=c.max_position_embeddings,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        d_attn=head_dim * c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        d_ff=c.intermediate_size,
        dropout=0.0,
        positions="rope",
        rope_theta=float(theta),
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        ffn="swiglu",
        bias=False,
        tie_weights=bool(getattr(c, "tie_word_embeddings", False)),
        attention="sdpa",
    )


@torch.no_grad()
def from_hf_llama(hf_model) -> GPT:
    cfg = config_from_llama(hf_model.config)
    model = GPT(cfg)
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    new = {
        "tok_emb.weight": sd["model.embed_tokens.weight"],
        "norm_f.weight": sd["model.norm.weight"],
        "lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
    }
    new.update(_rename_layers(sd, model.config, True, hf_to_meta_rows))
    model.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=True)
    return model.eval()


@torch.no_grad()
def to_hf_llama(model: GPT, bos_id: int = 2, eos_id: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM  # deferred: transformers takes seconds to import

    cfg = model.config
    if not is_llama_shape(cfg):
        raise TinyLMError("only a Llama-shaped tinylm model (rope, RMSNorm, SwiGLU, no biases) exports to Llama")
    refuse_options_no_format_has(cfg, "a Hugging Face Llama model")
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.d_attn // cfg.n_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_weights,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    hf = LlamaForCausalLM(hf_cfg)
    sd = {k: v.detach().float() for k, v in state_dict_by_parts(model).items()}
    new = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm_f.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    new.update(_rename_layers(sd, cfg, False, meta_to_hf_rows))
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise TinyLMError(f"Llama export mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return hf.eval()
