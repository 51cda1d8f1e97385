"""Quality of TinyStories models under one protocol, side by side with llama2.c's stories260K.

    python benchmarks/bench_quality.py [MODEL ...] [--data FILE] [--quick] [--json PATH]
    python benchmarks/bench_quality.py --recipe v1 --recipe current --minutes M [--train FILE]
    python benchmarks/bench_quality.py --recipe v1 --recipe r2 --recipe current --tokens N [--train FILE]

MODEL is a tinylm checkpoint (or run) directory, or a llama2.c ``.bin`` with its tokenizer
written ``model.bin::tokenizer.bin``. Every model, and the reference stories260K, is scored with
the same protocol (tinylm.evaluation.perplexity.evaluate_texts): each story of the file on its own from the model's
start token (<sos> for tinylm, BOS=1 for llama2.c), a sliding window when a story is longer than
the context, bits per byte over the story's UTF-8 bytes. The reference row is measured in the
same run, through tinylm's own llama2.c importer and evaluator, from ``../shared/anchors/llama2c``
relative to the repository (``--anchors`` to point elsewhere); when it is absent the table says so.

Columns: model, params, bpb, token_ppl, word_ppl, train_minutes (wall minutes of training when the
run's metrics.csv is next to the checkpoint; unknown for llama2.c files), and bpb relative to
stories260K. ``--quick`` scores only the first 40 stories (the number it prints then is not the
full-file figure). llama2.c's documentation gives stories260K 0.993 bits per byte on the shared
valid file; on that full file the script checks its own measurement against it (+-0.005).

``--recipe NAME`` (repeatable) first trains that recipe for ``--minutes`` of wall time, or for
``--tokens`` training tokens (the same amount of training on any machine), in this run, one after
the other on the same machine, then scores the run's result (its ``checkpoints/ema`` when the recipe
averages weights, else ``checkpoints/best``) in the same table. NAME is ``v1`` (the first CPU-hour
recipe, preset ``tinystories-cpu-1h-v1``), ``r2`` / ``r3`` (rounds 2 and 3, ``tinystories-cpu-1h-r2`` /
``-r3``), ``current``
(preset ``tinystories-cpu-1h``) or any preset / config file; the recipe's cosine follows the
shortened clock or the token budget's steps. ``--set KEY=VALUE`` overrides every recipe alike
(e.g. ``train.threads=1``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
DEFAULT_ANCHORS = SHARED / "anchors" / "llama2c"
DEFAULT_DATA = SHARED / "data" / "tinystories" / "valid.txt"
DEFAULT_TRAIN = SHARED / "data" / "tinystories" / "train.txt"
RECIPES = {
    "v1": "tinystories-cpu-1h-v1",
    "r2": "tinystories-cpu-1h-r2",
    "r3": "tinystories-cpu-1h-r3",
    "current": "tinystories-cpu-1h",
}
REFERENCE_NAME = "stories260K (llama2.c)"
REFERENCE_BPB, REFERENCE_TOLERANCE = 0.993, 0.005  # documented for the full shared valid.txt
QUICK_STORIES = 40
COLUMNS = ["model", "params", "bpb", "token_ppl", "word_ppl", "train_minutes"]


def split_spec(spec: str) -> tuple[str, str | None]:
    """``model.bin::tokenizer.bin`` -> (model, tokenizer); a plain path has no tokenizer."""
    path, sep, tok = spec.partition("::")
    return path, (tok if sep else None)


def train_minutes(checkpoint: Path, info: dict) -> float | None:
    """Wall minutes the run had trained when this checkpoint was written (from its metrics.csv).

    A checkpoint lives in RUN/checkpoints/NAME; metrics.csv's elapsed_s counts from the start of a
    training session, so a resumed run reports only its last session."""
    meta = info.get("meta") or {}
    step = meta.get("step")
    for run_dir in (checkpoint, checkpoint.parent.parent):
        metrics = run_dir / "metrics.csv"
        if not metrics.is_file():
            continue
        with open(metrics, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("elapsed_s") and r.get("step", "").isdigit()]
        if step is not None:
            rows = [r for r in rows if int(r["step"]) <= int(step)]
        if rows:
            return float(rows[-1]["elapsed_s"]) / 60.0
    return None


def evaluate_model(name: str, checkpoint: str, tokenizer: str | None, texts: list[str], batch_size: int) -> dict:
    from tinylm.evaluation.perplexity import evaluate_texts
    from tinylm.interop import load_any_checkpoint

    t0 = time.perf_counter()
    model, tok, info = load_any_checkpoint(checkpoint, tokenizer)
    m = evaluate_texts(model, tok, texts, batch_size=batch_size)
    minutes = train_minutes(Path(checkpoint), info) if info["format"] == "tinylm" else None
    return {
        "model": name,
        "params": model.num_parameters(),
        "bpb": m["bpb"],
        "token_ppl": m["token_ppl"],
        "word_ppl": m["word_ppl"],
        "train_minutes": minutes,
        "format": info["format"],
        "tokens": m["tokens"],
        "bytes": m["bytes"],
        "stories": len(texts),
        "eval_seconds": time.perf_counter() - t0,
    }


def budget_overrides(minutes: float, tokens: int | None) -> list[str]:
    """The overrides that make a recipe train for ``tokens`` training tokens (the cosine over the
    steps they make, no wall clock) when given, else for ``minutes`` of wall time."""
    if tokens is not None:
        return [
            f"train.max_tokens={tokens}",
            "train.max_minutes=null",
            "train.epochs=null",
            "train.schedule_clock=steps",
        ]
    return [f"train.max_minutes={minutes}", "train.max_tokens=null"]


def train_recipe(name: str, budget: list[str], train: Path, valid: Path, runs: Path, overrides: list[str]) -> Path:
    """Train one recipe under ``budget`` (``budget_overrides``); returns the checkpoint its run reports."""
    from tinylm.config import build_config
    from tinylm.pipeline import run_pipeline

    out = runs / name.replace("/", "_")
    cfg = build_config(
        RECIPES.get(name, name),
        [f"data.train={train}", f"data.valid={valid}", *budget, "train.progress=false", f"out_dir={out}", *overrides],
    )
    print(f"bench_quality: training recipe {name} ({RECIPES.get(name, name)}) for {' '.join(budget)} -> {out}")
    summary = run_pipeline(cfg, out)
    print(f"bench_quality: recipe {name}: {summary['steps']:,} steps, {summary['tokens_per_s']:,.0f} tokens/s")
    return out / summary["checkpoint"]


def reference_files(anchors: Path) -> tuple[Path, Path] | None:
    model, tok = anchors / "stories260K.bin", anchors / "tok512.bin"
    return (model, tok) if model.is_file() and tok.is_file() else None


def fmt(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows: list[dict], reference: dict | None) -> None:
    print(f"{'model':<34} {'params':>10} {'bpb':>7} {'token_ppl':>10} {'word_ppl':>9} {'train_min':>9} {'bpb/260K':>9}")
    for r in rows:
        ratio = fmt(r["bpb"] / reference["bpb"], 3) if reference else "-"
        print(
            f"{r['model'][:34]:<34} {r['params']:>10,} {r['bpb']:>7.4f} {r['token_ppl']:>10.3f} "
            f"{r['word_ppl']:>9.2f} {fmt(r['train_minutes'], 1):>9} {ratio:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="tinylm checkpoint/run dirs, or llama2.c model.bin::tokenizer.bin")
    ap.add_argument("--data", default=None, help=f"TinyStories-format file (default: {DEFAULT_DATA})")
    ap.add_argument("--anchors", default=str(DEFAULT_ANCHORS), help="directory with stories260K.bin and tok512.bin")
    ap.add_argument("--max-stories", type=int, default=None, help="score only the first N stories")
    ap.add_argument("--quick", action="store_true", help=f"only the first {QUICK_STORIES} stories (under a minute)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", metavar="PATH", help="write the table as a JSON list of row objects")
    ap.add_argument(
        "--recipe",
        action="append",
        default=[],
        help="train this recipe first (v1, current, or a preset / config file); repeatable",
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="wall minutes of training per recipe (default 10)")
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="train each recipe for this many tokens instead of --minutes (equal training on any machine)",
    )
    ap.add_argument("--train", default=None, help=f"training file for --recipe (default: {DEFAULT_TRAIN})")
    ap.add_argument("--runs", default="runs/bench_quality", help="where the recipe runs are written")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every recipe; repeatable",
    )
    args = ap.parse_args(argv)

    import torch

    from tinylm.data.corpora import load_text_file
    from tinylm.errors import TinyLMError

    torch.set_num_threads(args.threads)
    data = Path(args.data) if args.data else DEFAULT_DATA
    if not data.is_file():
        print(
            f"bench_quality: error: data file {data} does not exist"
            + ("" if args.data else " (the shared TinyStories data is absent; give --data FILE)"),
            file=sys.stderr,
        )
        return 2
    train = Path(args.train) if args.train else DEFAULT_TRAIN
    if args.recipe and not train.is_file():
        print(
            f"bench_quality: error: training file {train} does not exist"
            + ("" if args.train else " (the shared TinyStories data is absent; give --train FILE)"),
            file=sys.stderr,
        )
        return 2
    if args.recipe and args.minutes <= 0:
        print(f"bench_quality: error: --minutes must be positive (got {args.minutes})", file=sys.stderr)
        return 2
    if args.tokens is not None and args.tokens <= 0:
        print(f"bench_quality: error: --tokens must be positive (got {args.tokens})", file=sys.stderr)
        return 2
    texts = load_text_file(str(data))
    limit = QUICK_STORIES if args.quick else args.max_stories
    full_file = limit is None or limit >= len(texts)
    texts = texts[:limit] if limit else texts
    print(
        f"bench_quality: {len(texts)} stories of {data.name}{'' if full_file else ' (a subset)'}, "
        f"torch threads {torch.get_num_threads()}; each story scored alone from its start token"
    )

    rows, reference = [], None
    ref_files = reference_files(Path(args.anchors))
    if ref_files is None:
        print(
            f"bench_quality: stories260K reference ABSENT: {args.anchors} has no stories260K.bin + tok512.bin; "
            "the table has no reference row and no ratios"
        )
    try:
        # train first, so that every evaluation below runs after the last training has ended
        budget = budget_overrides(args.minutes, args.tokens)
        recipe_models = [
            str(train_recipe(name, budget, train, data, Path(args.runs), args.overrides)) for name in args.recipe
        ]
        if ref_files is not None:
            reference = evaluate_model(REFERENCE_NAME, str(ref_files[0]), str(ref_files[1]), texts, args.batch_size)
            rows.append(reference)
        for spec in [*recipe_models, *args.models]:
            path, tok = split_spec(spec)
            p = Path(path)
            name = p.name if p.is_file() else "/".join(p.parts[-3:]) if p.parent.name == "checkpoints" else p.name
            rows.append(evaluate_model(name, path, tok, texts, args.batch_size))
    except TinyLMError as exc:
        print(f"bench_quality: error: {exc}", file=sys.stderr)
        return 2
    for r in rows:
        r["bpb_vs_stories260K"] = r["bpb"] / reference["bpb"] if reference else None
    print_table(rows, reference)
    if reference is not None:
        if full_file and data.resolve() == DEFAULT_DATA.resolve():
            ok = abs(reference["bpb"] - REFERENCE_BPB) <= REFERENCE_TOLERANCE
            print(
                f"stories260K reproduction: {reference['bpb']:.4f} bpb here vs {REFERENCE_BPB} documented "
                f"(+-{REFERENCE_TOLERANCE}): {'OK' if ok else 'MISMATCH'}"
            )
        else:
            print(
                f"stories260K: {reference['bpb']:.4f} bpb on these stories (its documented {REFERENCE_BPB} is for the "
                "full shared valid.txt)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"bench_quality: wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
