"""llama2.c ``.bin`` checkpoints (karpathy/llama2.c's export, versions 0 and 1) <-> tinylm GPT.

Version 0 (the legacy export, the one run.c reads): a header of 7 int32 (dim, hidden_dim,
n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier is
stored separately), then float32 tensors in this order, each stacked over layers where it has one
per layer:

    token embedding (V, dim) | attention RMSNorm (L, dim) | wq (L, dim, dim) | wk (L, kv, dim)
    wv (L, kv, dim) | wo (L, dim, dim) | FFN RMSNorm (L, dim) | w1 (L, hidden, dim)
    w2 (L, dim, hidden) | w3 (L, hidden, dim) | final RMSNorm (dim)
    freq_cis real and imaginary halves (seq_len, head/2 each; unused, recomputed)
    classifier (V, dim), only when vocab_size was negative

Version 1 (export.py's ``version1_export``): a 256-byte header (uint32 magic "ak42", int32
version, the same 7 int32 with a positive vocab_size, one byte "classifier shared", zeros), then
the norms first (attention RMSNorm, FFN RMSNorm, final RMSNorm), the token embedding, wq, wk, wv,
wo, w1, w2, w3, and the classifier when it is not shared; no freq_cis tables.

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
from tinylm.interop.llama import non_llama_options
from tinylm.models.gpt import GPT, rope_tables, state_dict_by_parts

HEADER = struct.Struct("<7i")
HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")  # HEADER's order
MAGIC = 0x616B3432  # "ak42" read as a little-endian uint32: the start of a version-1+ header
V1_HEADER_SIZE = 256
LLAMA2C_VERSIONS = (0, 1)
BOS_ID, EOS_ID = 1, 2


def read_header(path: str | Path) -> dict:
    """The 7 sizes, ``shared_classifier``, ``version`` and ``offset`` (bytes before the weights)."""
    path = Path(path)
    with open(path, "rb") as fh:
        raw = fh.read(V1_HEADER_SIZE)
    if len(raw) < HEADER.size:
        raise TinyLMError(f"{path} is too short to be a llama2.c checkpoint")
    version, offset = 0, HEADER.size
    if struct.unpack_from("<I", raw)[0] == MAGIC:
        version, offset = struct.unpack_from("<i", raw, 4)[0], V1_HEADER_SIZE
        if version not in LLAMA2C_VERSIONS:
            raise TinyLMError(
                f"{path} is a llama2.c version-{version} checkpoint; tinylm reads versions 0 and 1 "
                "(version 2 is runq.c's int8 format)"
            )
        if len(raw) < V1_HEADER_SIZE:
            raise TinyLMError(f"{path} is too short to be a llama2.c version-1 checkpoint")
    h = dict(zip(HEADER_FIELDS, HEADER.unpack_from(raw, 8 if version else 0)))
    shared = bool(raw[8 + HEADER.size]) if version else h["vocab_size"] > 0
    return {**h, "vocab_size": abs(h["vocab_size"]), "shared_classifier": shared, "version": version, "offset": offset}


def _expected_floats(h: dict) -> int:
    return sum(int(np.prod(shape)) for _, shape in _tensor_shapes(h))


def looks_like_llama2c(path: str | Path) -> bool:
    """A file whose header is plausible and whose size matches the header exactly."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size < HEADER.size:
        return False
    h = read_header(path)
    dims = [h[name] for name in HEADER_FIELDS]
    if min(dims) < 1 or h["dim"] % h["n_heads"] or h["n_heads"] % h["n_kv_heads"] or max(dims) > 1 << 24:
        return False
    return path.stat().st_size == h["offset"] + 4 * _expected_floats(h)


def config_from_header(h: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=h["vocab_size"],
        context_length=h["seq_len"],
        d_model=h["dim"],
        n_layers=h["n_layers"],
        n_heads=h["n_heads"],
        n_kv_heads=h["n_kv_heads"],
        d_ff=h["hidden_dim"],
        dropout=0.0,
        positions="rope",
        rope_theta=10000.0,
        norm="rmsnorm",
        norm_eps=1e-5,
        ffn="swiglu",
        bias=False,
        tie_weights=h["shared_classifier"],
        attention="sdpa",
    )


# (llama2.c name, tinylm name inside a block) of every per-layer tensor; the fused q/k/v and
# gate/up matrices are named by their parts (``state_dict_by_parts``; loading joins them)
LAYER_WEIGHTS = [
    ("rms_att", "norm1.weight"),
    ("wq", "attn.q_proj.weight"),
    ("wk", "attn.k_proj.weight"),
    ("wv", "attn.v_proj.weight"),
    ("wo", "attn.out_proj.weight"),
    ("rms_ffn", "norm2.weight"),
    ("w1", "ffn.gate.weight"),
    ("w2", "ffn.down.weight"),
    ("w3", "ffn.up.weight"),
]


def _tensor_shapes(h: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the file's order; ``freq_cis`` is version 0's unused tables."""
    dim, hid, L, V = h["dim"], h["hidden_dim"], h["n_layers"], h["vocab_size"]
    kv = h["n_kv_heads"] * (dim // h["n_heads"])
    matrices = [("wq", (L, dim, dim)), ("wk", (L, kv, dim)), ("wv", (L, kv, dim)), ("wo", (L, dim, dim))]
    ffn = [("w1", (L, hid, dim)), ("w2", (L, dim, hid)), ("w3", (L, hid, dim))]
    if h["version"] == 0:
        shapes = [
            ("emb", (V, dim)),
            ("rms_att", (L, dim)),
            *matrices,
            ("rms_ffn", (L, dim)),
            *ffn,
            ("rms_final", (dim,)),
            ("freq_cis", (h["seq_len"], dim // h["n_heads"])),
        ]
    else:
        shapes = [
            ("rms_att", (L, dim)),
            ("rms_ffn", (L, dim)),
            ("rms_final", (dim,)),
            ("emb", (V, dim)),
            *matrices,
            *ffn,
        ]
    return shapes + ([] if h["shared_classifier"] else [("wcls", (V, dim))])


def _split_weights(data: torch.Tensor, h: dict) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in _tensor_shapes(h):
        n = int(np.prod(shape))
        out[name] = data[offset : offset + n].view(*shape)
        offset += n
    out.setdefault("wcls", out["emb"])
    return out


def load_llama2c(path: str | Path) -> GPT:
    """Read a llama2.c checkpoint (version 0 or 1) into a tinylm GPT (eval mode, float32)."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"llama2.c checkpoint {path} does not exist")
    if not looks_like_llama2c(path):
        raise TinyLMError(f"{path} is not a llama2.c .bin checkpoint (header and file size disagree)")
    h = read_header(path)
    data = torch.from_numpy(np.fromfile(path, dtype="<f4", offset=h["offset"]).astype(np.float32))
    w = _split_weights(data, h)
    model = GPT(config_from_header(h))
    state = {"tok_emb.weight": w["emb"], "norm_f.weight": w["rms_final"], "lm_head.weight": w["wcls"]}
    for i in range(h["n_layers"]):
        state.update({f"blocks.{i}.{ours}": w[theirs][i] for theirs, ours in LAYER_WEIGHTS})
    model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True)
    return model.eval()


def unsupported_options(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` a llama2.c checkpoint has no place for (run.c fixes eps and theta)."""
    cfg = cfg.resolved()
    reasons = {
        f"model.d_attn={cfg.d_attn} (llama2.c's attention is d_model={cfg.d_model} wide)": cfg.d_attn != cfg.d_model,
        f"model.rope_theta={cfg.rope_theta:g} (run.c uses 10000)": cfg.rope_theta != 10000.0,
        f"model.norm_eps={cfg.norm_eps:g} (run.c uses 1e-5)": cfg.norm_eps != 1e-5,
    }
    return non_llama_options(cfg) + [name for name, bad in reasons.items() if bad]


def save_llama2c(model: GPT, path: str | Path, version: int = 0) -> Path:
    """Write a Llama-shaped tinylm GPT as a llama2.c checkpoint: version 0 is the one run.c reads."""
    cfg = model.config
    bad = unsupported_options(cfg)
    if bad:
        raise TinyLMError("this model cannot be written in llama2.c format: " + "; ".join(bad))
    if version not in LLAMA2C_VERSIONS:
        raise TinyLMError(f"llama2.c version {version} is not one of {LLAMA2C_VERSIONS} (version 2 is runq.c's int8)")
    sd = {k: v.detach().float().cpu() for k, v in state_dict_by_parts(model).items()}
    tensors = {"emb": sd["tok_emb.weight"], "rms_final": sd["norm_f.weight"], "wcls": sd["lm_head.weight"]}
    for theirs, ours in LAYER_WEIGHTS:
        tensors[theirs] = torch.stack([sd[f"blocks.{i}.{ours}"] for i in range(cfg.n_layers)])
    cos, sin = rope_tables(cfg.context_length, cfg.d_model // cfg.n_heads, cfg.rope_theta)
    tensors["freq_cis"] = torch.cat([cos.flatten(), sin.flatten()])
    sizes = (cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads)
    if version == 0:
        header = HEADER.pack(*sizes, cfg.vocab_size if cfg.tie_weights else -cfg.vocab_size, cfg.context_length)
    else:
        header = struct.pack("<Ii", MAGIC, version) + HEADER.pack(*sizes, cfg.vocab_size, cfg.context_length)
        header = (header + bytes([cfg.tie_weights])).ljust(V1_HEADER_SIZE, b"\0")
    h = dict(zip(HEADER_FIELDS, (*sizes, cfg.vocab_size, cfg.context_length)))
    h.update(shared_classifier=cfg.tie_weights, version=version)
    path = Path(path)
    with open(path, "wb") as fh:
        fh.write(header)
        for name, _ in _tensor_shapes(h):
            fh.write(tensors[name].contiguous().numpy().astype("<f4").tobytes())
    return path
