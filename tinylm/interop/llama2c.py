"""llama2.c legacy ``.bin`` checkpoints (version 0 of karpathy/llama2.c's export) <-> tinylm GPT.

Layout: a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len; a negative vocab_size means the classifier is stored separately), then float32
tensors in this order, each stacked over layers where it has one per layer:

    token embedding (V, dim) | attention RMSNorm (L, dim) | wq (L, dim, dim) | wk (L, kv, dim)
    wv (L, kv, dim) | wo (L, dim, dim) | FFN RMSNorm (L, dim) | w1 (L, hidden, dim)
    w2 (L, dim, hidden) | w3 (L, hidden, dim) | final RMSNorm (dim)
    freq_cis real and imaginary halves (seq_len, head/2 each; unused, recomputed)
    classifier (V, dim), only when vocab_size was negative

Weights are (out, in) like ``nn.Linear``; the FFN is w2(silu(w1 x) * w3 x), so w1 -> gate,
w3 -> up, w2 -> down. Rotary pairs are interleaved, as in tinylm. RMSNorm eps is 1e-5 and
rope theta 10000 (run.c's constants); llama2.c has no biases.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.interop.llama import is_llama_shape
from tinylm.models.gpt import GPT, rope_tables

HEADER = struct.Struct("<7i")
BOS_ID, EOS_ID = 1, 2


def read_header(path: str | Path) -> dict:
    path = Path(path)
    with open(path, "rb") as fh:
        raw = fh.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise TinyLMError(f"{path} is too short to be a llama2.c checkpoint")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = HEADER.unpack(raw)
    return {"dim": dim, "hidden_dim": hidden, "n_layers": n_layers, "n_heads": n_heads,
            "n_kv_heads": n_kv_heads, "vocab_size": abs(vocab), "shared_classifier": vocab > 0, "seq_len": seq_len}


def _expected_floats(h: dict) -> int:
    dim, hid, L, V = h["dim"], h["hidden_dim"], h["n_layers"], h["vocab_size"]
    head = dim // h["n_heads"]
    kv = h["n_kv_heads"] * head
    n = V * dim + L * dim + L * dim * dim + 2 * L * kv * dim + L * dim * dim + L * dim
    n += 3 * L * hid * dim + dim + h["seq_len"] * head  # freq_cis real + imag: seq_len * head/2 each
    return n + (0 if h["shared_classifier"] else V * dim)


def looks_like_llama2c(path: str | Path) -> bool:
    """A file whose header is plausible and whose size matches the header exactly."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size < HEADER.size:
        return False
    h = read_header(path)
    dims = (h["dim"], h["hidden_dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"], h["vocab_size"], h["seq_len"])
    if min(dims) < 1 or h["dim"] % h["n_heads"] or h["n_heads"] % h["n_kv_heads"] or max(dims) > 1 << 24:
        return False
    return path.stat().st_size == HEADER.size + 4 * _expected_floats(h)


def config_from_header(h: dict) -> ModelConfig:
    return ModelConfig(vocab_size=h["vocab_size"], context_length=h["seq_len"], d_model=h["dim"],
                       n_layers=h["n_layers"], n_heads=h["n_heads"], n_kv_heads=h["n_kv_heads"],
                       d_ff=h["hidden_dim"], dropout=0.0, positions="rope", rope_theta=10000.0,
                       norm="rmsnorm", norm_eps=1e-5, ffn="swiglu", bias=False,
                       tie_weights=h["shared_classifier"], attention="sdpa")


def load_llama2c(path: str | Path) -> GPT:
    """Read a legacy llama2.c checkpoint into a tinylm GPT (eval mode, float32)."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"llama2.c checkpoint {path} does not exist")
    if not looks_like_llama2c(path):
        raise TinyLMError(f"{path} is not a legacy llama2.c .bin checkpoint (header and file size disagree)")
    h = read_header(path)
    data = torch.from_numpy(np.fromfile(path, dtype="<f4", offset=HEADER.size).astype(np.float32))
    dim, hid, L, V = h["dim"], h["hidden_dim"], h["n_layers"], h["vocab_size"]
    head = dim // h["n_heads"]
    kv = h["n_kv_heads"] * head
    offset = 0

    def take(*shape):
        nonlocal offset
        n = int(np.prod(shape))
        t = data[offset : offset + n].view(*shape)
        offset += n
        return t

    emb = take(V, dim)
    rms_att, wq, wk, wv, wo = take(L, dim), take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
    rms_ffn, w1, w2, w3 = take(L, dim), take(L, hid, dim), take(L, dim, hid), take(L, hid, dim)
    rms_final = take(dim)
    take(h["seq_len"], head)  # legacy freq_cis tables: tinylm recomputes the same angles
    wcls = emb if h["shared_classifier"] else take(V, dim)

    model = GPT(config_from_header(h))
    state = {"tok_emb.weight": emb, "norm_f.weight": rms_final, "lm_head.weight": wcls}
    for i in range(L):
        b = f"blocks.{i}."
        state.update({b + "norm1.weight": rms_att[i], b + "attn.q_proj.weight": wq[i], b + "attn.k_proj.weight": wk[i],
                      b + "attn.v_proj.weight": wv[i], b + "attn.out_proj.weight": wo[i],
                      b + "norm2.weight": rms_ffn[i], b + "ffn.gate.weight": w1[i], b + "ffn.down.weight": w2[i],
                      b + "ffn.up.weight": w3[i]})
    model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True)
    return model.eval()


def save_llama2c(model: GPT, path: str | Path) -> Path:
    """Write a Llama-shaped tinylm GPT as a legacy llama2.c checkpoint (run.c can load it)."""
    cfg = model.config
    if not is_llama_shape(cfg) or cfg.d_attn != cfg.d_model:
        raise TinyLMError("only a Llama-shaped model with d_attn == d_model can be written in llama2.c format")
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    L = cfg.n_layers
    stack = lambda name: torch.stack([sd[f"blocks.{i}.{name}"] for i in range(L)])  # noqa: E731
    cos, sin = rope_tables(cfg.context_length, cfg.d_model // cfg.n_heads, cfg.rope_theta)
    parts = [sd["tok_emb.weight"], stack("norm1.weight"), stack("attn.q_proj.weight"), stack("attn.k_proj.weight"),
             stack("attn.v_proj.weight"), stack("attn.out_proj.weight"), stack("norm2.weight"),
             stack("ffn.gate.weight"), stack("ffn.down.weight"), stack("ffn.up.weight"), sd["norm_f.weight"],
             cos, sin]
    if not cfg.tie_weights:
        parts.append(sd["lm_head.weight"])
    vocab = cfg.vocab_size if cfg.tie_weights else -cfg.vocab_size
    path = Path(path)
    with open(path, "wb") as fh:
        fh.write(HEADER.pack(cfg.d_model, cfg.d_ff, L, cfg.n_heads, cfg.n_kv_heads, vocab, cfg.context_length))
        for t in parts:
            fh.write(t.contiguous().numpy().astype("<f4").tobytes())
    return path
