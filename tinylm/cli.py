"""`tinylm` command line: one function per subcommand, all the work done by the library.

A ``TinyLMError`` (bad file, config, checkpoint, prompt) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tinylm.errors import TinyLMError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML/TOML file whose keys are RunConfig fields")
    p.add_argument("--out", help="run directory (overrides out_dir)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. model.d_model=128 train.max_steps=200")


def _load_config(args, base: dict | None = None):
    from tinylm.config import build_config

    cfg = build_config(args.config, args.overrides, base=base)
    if args.out:
        cfg.out_dir = args.out
    return cfg


def _demo_preset(quick: bool) -> dict:
    from tinylm.config import load_config_file

    name = "demo-quick.yaml" if quick else "demo.yaml"
    path = CONFIGS_DIR / name
    if path.is_file():
        return load_config_file(path)
    return _builtin_demo(quick)  # installed without the repo's configs/ folder


def _builtin_demo(quick: bool) -> dict:
    base = {
        "out_dir": "runs/demo",
        "data": {"source": "shakespeare", "split_by": "chunk", "valid_fraction": 0.05, "test_fraction": 0.05},
        "tokenizer": {"type": "bpe", "vocab_size": 1024},
        "model": {"context_length": 128, "d_model": 192, "n_layers": 4, "n_heads": 6, "dropout": 0.0},
        "train": {"batch_size": 16, "max_steps": 1000, "max_minutes": 3.0, "lr": 2e-3, "min_lr": 2e-4,
                  "warmup_steps": 50, "eval_interval": 200, "eval_batches": 20, "threads": 2},
        "sample": {"prompts": ["ROMEO:", "To be, or not to be", "KING HENRY.\nOnce more"], "max_new_tokens": 80},
    }
    if quick:
        base["data"]["max_documents"] = 6
        base["tokenizer"]["vocab_size"] = 512
        base["model"].update(context_length=64, d_model=64, n_layers=2, n_heads=4)
        base["train"].update(max_steps=60, max_minutes=0.5, warmup_steps=10, eval_interval=30, eval_batches=5)
        base["sample"]["max_new_tokens"] = 30
    return base


def cmd_demo(args) -> int:
    from tinylm.pipeline import run_pipeline

    cfg = _load_config(args, base=_demo_preset(args.quick))
    if args.quick and not args.out and cfg.out_dir == "runs/demo":
        cfg.out_dir = "runs/demo-quick"
    summary = run_pipeline(cfg, cfg.out_dir)
    print(f"\ndemo finished in {summary['total_seconds']:.0f} s; everything is in {cfg.out_dir}/ "
          f"(report.md, metrics.csv, samples.txt, checkpoints/)")
    return 0


def cmd_train(args) -> int:
    from tinylm.pipeline import run_pipeline

    if args.resume:
        from tinylm.training.resume import resume_run_config

        cfg, ckpt, _ = resume_run_config(args.resume, args.config, args.overrides, force=args.force)
        if args.out:
            cfg.out_dir = args.out
        run_pipeline(cfg, cfg.out_dir, resume=ckpt, force=args.force)
        return 0
    if args.force:
        raise TinyLMError("--force only applies together with --resume DIR")
    cfg = _load_config(args)
    run_pipeline(cfg, cfg.out_dir)
    return 0


def cmd_prepare(args) -> int:
    from tinylm.data.prepare import prepare

    cfg = _load_config(args)
    prepare(cfg, cfg.out_dir)
    return 0


def cmd_generate(args) -> int:
    from tinylm.generation.cli import run_generate

    return run_generate(args)


def load_eval_documents(path: str) -> list[str]:
    from tinylm.data.corpora import load_text_file

    return load_text_file(path)


def cmd_evaluate(args) -> int:
    # tinylm dirs, llama2.c .bin (+ --tokenizer) and HF dirs: each story scored from the model's own start token
    from tinylm.interop import load_any_checkpoint, score_texts

    model, tokenizer, info = load_any_checkpoint(args.checkpoint, getattr(args, "tokenizer", None))
    docs = load_eval_documents(args.data)
    if args.max_docs:
        docs = docs[: args.max_docs]
    m = score_texts(model, tokenizer, docs, info, batch_size=args.batch_size)
    keys = ("token_ppl", "bpb", "word_ppl", "tokens", "bytes", "words")
    bleu = None
    if getattr(args, "bleu", False):  # issue 7: the BLEU protocol (tinylm/evaluation/bleu_cli.py)
        from tinylm.evaluation.bleu_cli import run_bleu_cli

        bleu = run_bleu_cli(args, model, tokenizer, docs, info)
    if args.json:
        print(json.dumps({**{k: m[k] for k in keys}, **({"bleu": bleu} if bleu else {})}))
    else:
        print(f"documents        {len(docs):,}")
        print(f"token perplexity {m['token_ppl']:.4f}   (exp of mean NLL over {m['tokens']:,} tokens)")
        print(f"bits per byte    {m['bpb']:.4f}   (over {m['bytes']:,} UTF-8 bytes)")
        print(f"word perplexity  {m['word_ppl']:.4f}   (over {m['words']:,} whitespace-separated words)")
        if bleu:
            from tinylm.evaluation.bleu_cli import print_bleu

            print_bleu(bleu)
    return 0


def cmd_report(args) -> int:
    from tinylm.commands import cmd_report as write_and_describe

    return write_and_describe(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinylm", description="Build, train, evaluate and run small language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="Shakespeare end to end: corpus, tokenizer, GPT, perplexity, samples, report")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (under a minute)")
    _add_config_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("prepare", help="corpus + cleaning + splits + tokenizer + token cache")
    _add_config_args(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="prepare (cached), train, evaluate, sample and report")
    _add_config_args(p)
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (or the newest one in a run directory)")
    p.add_argument("--force", action="store_true", help="with --resume: accept changed keys such as train.max_steps")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="continue prompts (tinylm, llama2.c .bin or Hugging Face checkpoints)")
    from tinylm.generation.cli import add_generate_args

    add_generate_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export-hf", help="write a GPT-2- or Llama-shaped checkpoint as a Hugging Face model directory")
    from tinylm.interop.cli import add_export_args, run_export

    add_export_args(p)
    p.set_defaults(func=run_export)

    p = sub.add_parser("evaluate", help="token perplexity, bits per byte and word perplexity on a file")
    p.add_argument("--checkpoint", required=True, help="tinylm checkpoint/run dir, llama2.c .bin or Hugging Face dir")
    p.add_argument("--tokenizer", default=None, help="tokenizer file (required for a llama2.c .bin, e.g. tok512.bin)")
    p.add_argument("--data", required=True, help="text file (TinyStories format: each story scored alone), or .jsonl")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from tinylm.evaluation.bleu_cli import add_bleu_args

    add_bleu_args(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("report", help="(re)write report.md and report.html for a run directory")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_report)

    from tinylm.commands import add_attention_parser, add_experiments_parser

    add_attention_parser(sub)
    add_experiments_parser(sub)

    from tinylm.study import add_study_parser  # `tinylm study shakespeare` (issue 6)

    add_study_parser(sub)

    from tinylm.tokenizers.stats import add_parser as add_tokenizer_stats_parser  # issue 5

    add_tokenizer_stats_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `tinylm train --out DIR model.d_model=96` puts overrides after an option; argparse's plain
    # parse_args stops collecting the positional list there, so pick the stragglers up by hand.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = list(args.overrides or []) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except TinyLMError as exc:
        print(f"tinylm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
