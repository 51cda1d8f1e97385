"""`tinylm evaluate --bleu`: the BLEU protocol from the command line (arguments and printing).

Imports of torch and the protocol are inside the functions: building the CLI parser stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path



def add_bleu_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("BLEU protocol (with --bleu)")
    g.add_argument("--bleu", action="store_true", help="prompt with the first tokens of each story, continue, score BLEU")
    g.add_argument("--samples", type=int, default=50, help="stories to use (default 50)")
    g.add_argument("--prompt-tokens", type=int, default=5, help="prompt = the story's first N tokens (default 5)")
    g.add_argument("--max-continuation", type=int, default=60, help="cap on continuation tokens (default 60)")
    g.add_argument("--temperature", type=float, action="append",
                   help="sampling temperature, repeatable (default 0.7, 1.0 and 1.2); 0 is greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--beam-width", type=int, action="append", default=[], help="also decode with beam search of this width")
    g.add_argument("--smoothing", default="method1", choices=["method1", "exp", "none"], help="for BLEU-1..4")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--csv-dir", default=".", help="where bleu_samples_<setting>.csv go (default: here)")
    g.add_argument("--decode-threads", type=int, default=1,
                   help="torch threads while decoding (default 1: token-by-token decoding is many small ops, "
                        "which slow down with more threads on a busy CPU)")


def run_bleu_cli(args, model, tokenizer, docs: list[str], info: dict | None = None) -> dict:
    """``info`` is what `tinylm.interop.load_any_checkpoint` reports: the model's start and stop ids."""
    import torch

    from tinylm.evaluation.protocol import BleuProtocol, Decoding, run_bleu

    if args.decode_threads:
        torch.set_num_threads(args.decode_threads)
    protocol = BleuProtocol(args.samples, args.prompt_tokens, args.max_continuation, args.seed, args.smoothing)
    temps = args.temperature or [0.7, 1.0, 1.2]
    settings = [Decoding("greedy" if t == 0 else f"T{t:g}", temperature=t, top_k=args.top_k) for t in temps]
    settings += [Decoding(f"beam{k}", beam_width=k) for k in args.beam_width]
    # quiet: the notes and every number are printed once, in the table of print_bleu
    ids = {"bos_id": info["bos_id"], "stop_ids": tuple(info["stop_ids"])} if info else {}
    return run_bleu(model, tokenizer, docs, protocol, settings, csv_dir=Path(args.csv_dir), log=lambda *_: None, **ids)


def print_bleu(result: dict) -> None:
    from tinylm.evaluation.bleu import BLEU_MEANING

    p = result["protocol"]
    print()
    print(f"BLEU protocol    {result['samples']} stories (asked {result['requested']}), prompt = first "
          f"{p['prompt_tokens']} tokens, continuation <= {p['max_continuation']} tokens, seed {p['seed']}")
    for note in result["notes"]:
        print(f"note             {note}")
    print(f"reference ppl    {result['reference_ppl']:.4f}   (exp mean NLL of the real continuations given "
          f"their prompts, {result['reference_tokens']:,} tokens)")
    print(BLEU_MEANING)
    print(f"BLEU-n: NLTK-style corpus BLEU, smoothing {p['smoothing']}; sacreBLEU: 0-100 with the signature below")
    print(f"{'setting':<10} {'BLEU-1':>7} {'BLEU-2':>7} {'BLEU-3':>7} {'BLEU-4':>7} {'sacreBLEU':>9} {'tok/s':>7}  csv")
    for s in result["settings"]:
        if "missing" in s:
            print(f"{s['name']:<10} missing: {s['missing']}")
            continue
        print(f"{s['name']:<10} {s['bleu1']:7.4f} {s['bleu2']:7.4f} {s['bleu3']:7.4f} {s['bleu4']:7.4f} "
              f"{s['sacrebleu']['bleu']:9.2f} {s['tokens_per_s']:7.0f}  {s.get('csv', '')}")
    sig = next((s["sacrebleu"]["signature"] for s in result["settings"] if "sacrebleu" in s), None)
    if sig:
        print(f"sacreBLEU signature: {sig}")
