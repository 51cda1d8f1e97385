"""`tinylm export-hf`: write a checkpoint as a Hugging Face model directory (tinylm/cli.py registers it)."""

from __future__ import annotations

import argparse


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="tinylm checkpoint/run directory, or a llama2.c .bin")
    p.add_argument("--tokenizer", help="tokenizer file (needed for a llama2.c .bin)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")


def run_export(args) -> int:
    from tinylm.interop import export_hf, load_any_checkpoint

    model, tokenizer, info = load_any_checkpoint(args.checkpoint, args.tokenizer)
    out = export_hf(model, args.out, tokenizer)
    kind = "GPT-2" if model.config.positions == "learned" else "Llama"
    print(f"wrote a Hugging Face {kind} model ({model.num_parameters():,} parameters) to {out}")
    return 0
