"""Helpers of the GGUF and llama2.c export tests: a briefly trained Llama-shaped tinylm run (rotary
positions, RMSNorm, SwiGLU, no biases, grouped-query attention, untied head) on the conftest
stories, and prompts in their style."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import make_stories, tiny_run_config

LLAMA_SHAPE = dict(
    positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False, n_kv_heads=2, context_length=64
)
PROMPTS = ["Once upon a time there was", "The dog and the cat", "Lily saw a big tree."]


def train_llama_run(root: Path, steps: int = 80) -> Path:
    """A tinylm run directory holding a Llama-shaped model trained ``steps`` steps with a 320-token BPE
    (~10 s on one core): confident enough that greedy decoding has clear winners."""
    from tinylm.pipeline import run_pipeline

    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories()), encoding="utf-8")
    cfg = tiny_run_config(root / "run", data, max_steps=steps, lr=3e-3, eval_interval=steps)
    cfg.tokenizer.vocab_size = 320
    for key, value in LLAMA_SHAPE.items():
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
