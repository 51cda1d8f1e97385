"""Command-line glue for `tinylm attention`, `tinylm experiments` and `tinylm report`.

The work lives in tinylm.viz, tinylm.experiments and tinylm.report; heavy imports (torch,
matplotlib) happen inside the commands so that building the parser stays fast.
"""

from __future__ import annotations

from pathlib import Path

from tinylm.errors import TinyLMError


# -------------------------------------------------------------------------------------- attention
def add_attention_parser(sub) -> None:
    p = sub.add_parser("attention", help="attention maps of a text: a PNG grid per layer, optionally one HTML page")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory")
    p.add_argument("--text", required=True, help="the sentence to look at (must fit in the context)")
    p.add_argument("--out", default="attention", help="output directory (default: ./attention)")
    p.add_argument("--html", action="store_true", help="also write one self-contained page to browse layers and heads")
    p.set_defaults(func=cmd_attention)


def cmd_attention(args) -> int:
    from tinylm.training.checkpoint import load_checkpoint
    from tinylm.viz import attention_html, attention_maps, save_attention_pngs

    model, tokenizer, _ = load_checkpoint(args.checkpoint)
    maps = attention_maps(model, tokenizer, args.text)
    out = Path(args.out)
    for path in save_attention_pngs(maps, out):
        print(path)
    if args.html:
        print(attention_html(maps, out / "attention.html"))
    print(f"{maps.n_layers} layers x {maps.n_heads} heads over {len(maps.tokens)} tokens: {' '.join(maps.tokens)}")
    return 0


# ------------------------------------------------------------------------------------ experiments
def add_experiments_parser(sub) -> None:
    parts = "baseline,bleu,decoding,generations,kv_cache,accumulation,checkpointing,attention,curves,machine"
    p = sub.add_parser("experiments", help="the TinyStories assignment: train, BLEU, decoding, KV cache, accumulation, "
                                           "checkpointing, attention, curves, then report.md / report.html")
    p.add_argument("--config", default=None, help="experiments YAML (e.g. configs/tinystories-assignment.yaml)")
    p.add_argument("--quick", action="store_true", help="apply the file's `quick` section: minutes, not hours")
    p.add_argument("--out", help="run directory (overrides out_dir)")
    p.add_argument("--only", help=f"comma-separated parts to (re)run, from {parts}; the baseline is always run or cached")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="e.g. data.train=PATH data.valid=PATH experiments.bleu_samples=20")
    p.set_defaults(func=cmd_experiments)


def cmd_experiments(args) -> int:
    from tinylm.experiments import load_experiment_config, run_experiments

    cfg, exp = load_experiment_config(args.config, args.overrides, quick=args.quick)
    if args.out:
        cfg.out_dir = args.out
    only = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else None
    words = ([f"--config {args.config}"] if args.config else []) + (["--quick"] if args.quick else [])
    words += ([f"--out {args.out}"] if args.out else []) + list(args.overrides)
    manifest = run_experiments(cfg, exp, cfg.out_dir, quick=args.quick, only=only,
                               command="tinylm experiments " + " ".join(words))
    for name, status in manifest["parts"].items():
        print(f"  {name:<14} {status}")
    return 0


# ----------------------------------------------------------------------------------------- report
def cmd_report(args) -> int:
    from tinylm.report import build_report, write_report

    run = Path(args.run_dir)
    if not run.is_dir():
        raise TinyLMError(f"run directory {run} does not exist")
    md, page = write_report(run)
    missing = build_report(run).missing
    print(md)
    print(page)
    if missing:
        print(f"INCOMPLETE: {len(missing)} part(s) missing (the report says so at the top):")
        for m in missing:
            print(f"  - {m}")
    return 0
