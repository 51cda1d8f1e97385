"""Helpers of the GGUF and llama2.c export tests: a briefly trained Llama-shaped tinylm run (rotary
positions, RMSNorm, SwiGLU, no biases, grouped-query attention, untied head) on the conftest
stories, and prompts in their style."""
from __future__ import annotations

from pathlib import Path

from conftest import make_stories, tiny_run_config

LLAMA_SHAPE = dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, tie_weights=False, n_kv_heads=2,
                   context_length=64)
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
