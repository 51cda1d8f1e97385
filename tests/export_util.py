"""Helpers of the GGUF, llama2.c and Qwen3 export tests: a briefly trained Llama-shaped tinylm run
(rotary positions, RMSNorm, SwiGLU, no biases, grouped-query attention, untied head) on the conftest
stories, prompts in their style, and reading GGUF files back (the `gguf` package's reader, and
llama.cpp itself through llama-cpp-python)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import make_stories, tiny_run_config

from tinylm.config import ModelConfig
from tinylm.models.gpt import GPT

LLAMA_SHAPE = dict(
    positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False, n_kv_heads=2, context_length=64
)
PROMPTS = ["Once upon a time there was", "The dog and the cat", "Lily saw a big tree."]


def train_llama_run(root: Path, steps: int = 80, tokenizer: dict | None = None, **model) -> Path:
    """A tinylm run directory holding a Llama-shaped model trained ``steps`` steps with a 320-token BPE
    (~10 s on one core): confident enough that greedy decoding has clear winners. ``tokenizer`` and
    ``model`` set other fields of those config sections (e.g. a word tokenizer, QK-norm)."""
    from tinylm.pipeline import run_pipeline

    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories()), encoding="utf-8")
    cfg = tiny_run_config(root / "run", data, max_steps=steps, lr=3e-3, eval_interval=steps)
    for key, value in {"vocab_size": 320, **(tokenizer or {})}.items():
        setattr(cfg.tokenizer, key, value)
    for key, value in {**LLAMA_SHAPE, **model}.items():
        setattr(cfg.model, key, value)
    run_pipeline(cfg, cfg.out_dir)
    return Path(cfg.out_dir)


def separate_matrices(model) -> dict[str, np.ndarray]:
    """A Llama-shaped model's weights as arrays, its fused q/k/v and gate/up weights split here by
    hand into the separate matrices llama.cpp and llama2.c store (attn.q_proj, ..., ffn.up)."""
    cfg, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    q_rows, kv_rows = cfg.d_attn, cfg.n_kv_heads * (cfg.d_attn // cfg.n_heads)
    for i in range(cfg.n_layers):
        q, k, v = np.split(sd.pop(f"blocks.{i}.attn.qkv.weight"), [q_rows, q_rows + kv_rows])
        gate, up = np.split(sd.pop(f"blocks.{i}.ffn.gate_up.weight"), 2)
        sd.update(
            {
                f"blocks.{i}.attn.q_proj.weight": q,
                f"blocks.{i}.attn.k_proj.weight": k,
                f"blocks.{i}.attn.v_proj.weight": v,
                f"blocks.{i}.ffn.gate.weight": gate,
                f"blocks.{i}.ffn.up.weight": up,
            }
        )
    return sd


def read_gguf(path) -> tuple[dict, dict]:
    """(metadata key -> value, tensor name -> ReaderTensor) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def llama_cpp_model(path, n_ctx=64, **kw):
    import llama_cpp  # a dev extra, compiled from its sdist

    # float32 keys and values in llama.cpp's cache, as in tinylm's
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, verbose=False, type_k=0, type_v=0, **kw)


def llama_cpp_greedy(llm, ids, limit, stop_ids):
    """llama.cpp's greedy continuation of ``ids``: at most ``limit`` tokens, none of ``stop_ids``."""
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if token in stop_ids or len(out) == limit:
            return out
        out.append(token)


def llama_gpt(vocab=330, tie=False, seed=0, **overrides) -> GPT:
    """A small random Llama-shaped GPT (grouped kv heads), ``overrides`` on its config."""
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=44,
        positions="rope",
        norm="rmsnorm",
        ffn="swiglu",
        bias=False,
        tie_weights=tie,
    )
    return GPT(ModelConfig(**{**cfg, **overrides})).eval()
