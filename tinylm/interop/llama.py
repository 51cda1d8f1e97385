"""Hugging Face Llama and Qwen3 <-> tinylm GPT of their shape (RMSNorm, rotary positions, SwiGLU,
no biases, optional grouped-query attention). Qwen3 is Llama with QK-norm: an RMSNorm with a
learned gain over each head's queries and keys (``q_norm``, ``k_norm``) before the rotary
positions, which is tinylm's ``model.qk_norm`` with ``model.qk_norm_weight``.

Rotary layout: tinylm (like Meta's and llama2.c's code) rotates consecutive pairs (x0, x1),
(x2, x3), ...; HF Llama and Qwen3 rotate (x_i, x_{i + D/2}). The two agree once the rows of the
q and k projections are permuted inside each head; ``meta_to_hf_rows`` / ``hf_to_meta_rows`` do
that, and Qwen3's q_norm / k_norm gains (one value per position inside a head) are permuted the
same way.

A QK-norm without gain is Qwen3's with gains of ones, but tinylm normalises it with epsilon 1e-6
where Qwen3 has one epsilon (``rms_norm_eps``) for every norm: such a model travels only when its
``model.norm_eps`` is 1e-6 (at 1e-5 the logits of small random models moved by 1.0e-4 and 1.1e-4,
the export tests' whole tolerance); Qwen3 files come back with gains (``qk_norm_weight``).
"""

from __future__ import annotations

import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT, QK_NORM_EPS, state_dict_by_parts


def meta_to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from pair-interleaved to half-split layout."""
    out, inp = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def hf_to_meta_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, inp = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, inp).transpose(1, 2).reshape(out, inp)


def permute_rotary(sd: dict, cfg: ModelConfig, permute_rows) -> dict:
    """``sd`` (tinylm names, parts split) with the rows of q and k, and Qwen3's QK-norm gains (one
    value per position inside a head), reordered by ``permute_rows``: ``meta_to_hf_rows`` to the
    half-split layout, ``hf_to_meta_rows`` back."""
    heads = {"attn.q_proj.weight": cfg.n_heads, "attn.k_proj.weight": cfg.n_kv_heads}
    heads.update({"attn.q_norm": 1, "attn.k_norm": 1})  # a gain is one head's column
    out = dict(sd)
    for i in range(cfg.n_layers):
        for name, n in heads.items():
            w = out.get(f"blocks.{i}.{name}")
            if w is not None:
                out[f"blocks.{i}.{name}"] = permute_rows(w[:, None], n)[:, 0] if w.ndim == 1 else permute_rows(w, n)
    return out


def llama_state(model: GPT) -> dict[str, torch.Tensor]:
    """A Llama-shaped model's weights in float32 under tinylm's names, fused matrices split into
    their parts, and QK-norm gains of ones where the model's QK-norm has none (as Qwen3 holds it)."""
    cfg = model.config
    sd = {k: v.detach().float().cpu() for k, v in state_dict_by_parts(model).items()}
    for i in range(cfg.n_layers if cfg.qk_norm and not cfg.qk_norm_weight else 0):
        sd[f"blocks.{i}.attn.q_norm"] = sd[f"blocks.{i}.attn.k_norm"] = torch.ones(cfg.d_attn // cfg.n_heads)
    return sd


# (HF Llama name, tinylm name) of every per-layer weight; q and k also need their rows permuted
# (``permute_rotary``). tinylm's fused matrices are named by their parts here (attn.q_proj: the q
# rows of attn.qkv; ffn.gate, ffn.up: the halves of ffn.gate_up): ``state_dict_by_parts`` splits a
# model's state that way, and loading a state dict so named joins the parts.
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
QWEN3_QK_NORMS = [("self_attn.q_norm.weight", "attn.q_norm"), ("self_attn.k_norm.weight", "attn.k_norm")]


def _rename_layers(sd: dict, cfg: ModelConfig, to_tinylm: bool) -> dict:
    """Per-layer weights of ``sd`` under the other side's names."""
    out = {}
    for i in range(cfg.n_layers):
        for hf_name, our_name in LAYER_WEIGHTS + (QWEN3_QK_NORMS if cfg.qk_norm else []):
            src, dst = (f"model.layers.{i}.{hf_name}", f"blocks.{i}.{our_name}")
            if not to_tinylm:
                src, dst = dst, src
            out[dst] = sd[src]
    return out


def is_llama_shape(cfg: ModelConfig) -> bool:
    """Llama's layers (with or without Qwen3's QK-norm)."""
    cfg = cfg.resolved()
    return cfg.positions == "rope" and cfg.norm == "rmsnorm" and cfg.ffn == "swiglu" and not cfg.bias


def options_no_format_has(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` that none of the formats tinylm writes (Hugging Face GPT-2, Llama
    and Qwen3, llama.cpp's GGUF, llama2.c) has a place for, each named as the config writes it: a
    file written without them would load as a different model."""
    reasons = {
        f"model.value_embeddings={cfg.value_embeddings} (no other format has value embeddings)": cfg.value_embeddings
        != "none",
        f"model.logit_softcap={cfg.logit_softcap}": cfg.logit_softcap is not None,
    }
    return [name for name, bad in reasons.items() if bad]


def refuse_options_no_format_has(cfg: ModelConfig, target: str, qk_norm: bool = False) -> None:
    """Raise, naming them, when ``cfg`` has options that ``target`` (a format's name) cannot hold;
    ``qk_norm``: whether the target has QK-norm (Qwen3 has, GPT-2 and Llama have not)."""
    bad = options_no_format_has(cfg) + (qwen3_qk_norm_options(cfg) if qk_norm else qk_norm_options(cfg))
    if bad:
        raise TinyLMError(f"this model cannot be written as {target}: " + "; ".join(bad))


def qk_norm_options(cfg: ModelConfig) -> list[str]:
    """QK-norm, named, for a format without it."""
    return ["model.qk_norm=true (normalised queries and keys)"] if cfg.qk_norm else []


def qwen3_qk_norm_options(cfg: ModelConfig) -> list[str]:
    """The QK-norm a Qwen3 file cannot hold: one without gain unless its epsilon is Qwen3's."""
    if not cfg.qk_norm or cfg.qk_norm_weight or cfg.norm_eps == QK_NORM_EPS:
        return []
    return [
        f"model.qk_norm=true without model.qk_norm_weight (tinylm's gainless QK-norm uses epsilon "
        f"{QK_NORM_EPS:g}, Qwen3 model.norm_eps={cfg.norm_eps:g} for every norm; train with "
        "model.qk_norm_weight=true, or model.norm_eps=1e-6)"
    ]


def _layer_options(cfg: ModelConfig) -> list[str]:
    cfg = cfg.resolved()
    reasons = {
        f"model.positions={cfg.positions} (Llama uses rotary positions)": cfg.positions != "rope",
        f"model.norm={cfg.norm} (Llama uses RMSNorm)": cfg.norm != "rmsnorm",
        f"model.ffn={cfg.ffn} (Llama's feed-forward is SwiGLU)": cfg.ffn != "swiglu",
        "model.bias=true (Llama has no biases)": cfg.bias,
        f"model.d_embed={cfg.d_embed} (an embedding projection)": cfg.d_embed != cfg.d_model,
    }
    return [name for name, bad in reasons.items() if bad]


def non_llama_options(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` a Llama-shaped file without QK-norm (llama2.c) has no place for, each
    named as the config writes it."""
    return options_no_format_has(cfg) + qk_norm_options(cfg) + _layer_options(cfg)


def non_qwen3_options(cfg: ModelConfig) -> list[str]:
    """The same for a file that holds Llama and Qwen3 (GGUF: llama.cpp's llama graph, its qwen3
    graph with QK-norm): Llama's, less a QK-norm Qwen3 holds."""
    return options_no_format_has(cfg) + qwen3_qk_norm_options(cfg) + _layer_options(cfg)


def config_from_llama(c) -> ModelConfig:
    """The tinylm config of a HF ``LlamaConfig`` or ``Qwen3Config``."""
    family = "Qwen3" if c.model_type == "qwen3" else "Llama"
    if getattr(c, "hidden_act", "silu") != "silu":
        raise TinyLMError(f"{family} model not supported: activation {c.hidden_act!r}")
    scaling = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise TinyLMError(f"{family} model not supported: rope scaling {scaling}")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise TinyLMError(f"{family} model not supported: attention/MLP biases")
    if getattr(c, "use_sliding_window", False):
        raise TinyLMError(f"{family} model not supported: sliding-window attention")
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
        qk_norm=family == "Qwen3",
        qk_norm_weight=family == "Qwen3",
        tie_weights=bool(getattr(c, "tie_word_embeddings", False)),
        attention="sdpa",
    )


@torch.no_grad()
def from_hf_llama(hf_model) -> GPT:
    """A tinylm GPT with the weights of a ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``."""
    cfg = config_from_llama(hf_model.config)
    model = GPT(cfg)
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    new = {
        "tok_emb.weight": sd["model.embed_tokens.weight"],
        "norm_f.weight": sd["model.norm.weight"],
        "lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
    }
    new.update(permute_rotary(_rename_layers(sd, model.config, True), model.config, hf_to_meta_rows))
    model.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=True)
    return model.eval()


def _hf_config(cfg: ModelConfig, bos_id: int, eos_id: int):
    """A ``Qwen3Config`` for a model with QK-norm, else a ``LlamaConfig``."""
    from transformers import LlamaConfig, Qwen3Config  # deferred: transformers takes seconds to import

    common = dict(
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
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_weights,
        attention_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if cfg.qk_norm:
        return Qwen3Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, mlp_bias=False)


@torch.no_grad()
def to_hf_llama(model: GPT, bos_id: int = 2, eos_id: int = 3):
    """A ``LlamaForCausalLM``, or a ``Qwen3ForCausalLM`` for a model with QK-norm, with the
    weights of a tinylm GPT of that shape."""
    cfg = model.config
    if not is_llama_shape(cfg):
        raise TinyLMError(
            "only a Llama-shaped tinylm model (rope, RMSNorm, SwiGLU, no biases) exports to Llama or Qwen3"
        )
    family = "Qwen3" if cfg.qk_norm else "Llama"
    refuse_options_no_format_has(cfg, f"a Hugging Face {family} model", qk_norm=cfg.qk_norm)
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM  # deferred: transformers takes seconds to import

    hf_cfg = _hf_config(cfg, bos_id, eos_id)
    hf = (Qwen3ForCausalLM if cfg.qk_norm else LlamaForCausalLM)(hf_cfg)
    sd = permute_rotary(llama_state(model), cfg, meta_to_hf_rows)
    new = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm_f.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    new.update(_rename_layers(sd, cfg, False))
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise TinyLMError(f"{family} export mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return hf.eval()
