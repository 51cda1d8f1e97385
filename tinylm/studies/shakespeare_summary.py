"""The summary table of the Shakespeare study beside the four-stage report.

Each row holds a number that "Building GPT from Scratch - A Four-Stage Implementation Report"
published (kept in data/shakespeare_report_numbers.yaml), tinylm's number for the same setting
(the run with ``bpe_type: word_bpe``, the ``shakespeare-report`` preset) and tinylm's best model of
the same kind (the run with byte-level BPE, the ``shakespeare-study`` preset). The two runs are
this study and the one in ``compare_with``; a column stays empty when its run is missing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path

import yaml

REPORT_NUMBERS = resources.files("tinylm") / "studies" / "data" / "shakespeare_report_numbers.yaml"


def report_numbers() -> dict:
    return yaml.safe_load(REPORT_NUMBERS.read_text(encoding="utf-8"))


def _pair(a, b, digits=2) -> str:
    def one(v):
        if v is None:
            return "-"
        return "inf" if math.isinf(v) else f"{v:,.{digits}f}"
    return f"{one(a)} / {one(b)}"


def _runs(cfg, state: dict) -> tuple[dict | None, dict | None]:
    """(the run with the report's settings, the run with tinylm's stronger defaults)."""
    runs = [{"config": dataclasses.asdict(cfg), "tokenizers": state["tokenizers"], "rows": state["rows"],
             "bigram_runs": state["bigram_runs"], "gpt_runs": state["gpt_runs"]}]
    if cfg.compare_with:
        path = Path(cfg.compare_with) / "study.json"
        if path.is_file():
            runs.append(json.loads(path.read_text()))
    report_run = next((r for r in runs if r["config"]["bpe_type"] == "word_bpe"), None)
    best_run = next((r for r in runs if r["config"]["bpe_type"] == "bpe"), None)
    return report_run, best_run


def _corpus(config: dict) -> str:
    works = f"the first {config['max_documents']} works" if config["max_documents"] else "all works"
    train = 1 - config["valid_fraction"] - config["test_fraction"]
    return (f"{works} of the shakespeare package, split {train:.0%} / {config['valid_fraction']:.0%} / "
            f"{config['test_fraction']:.0%}")


def _best(rows: list[dict]) -> dict | None:
    return min(rows, key=lambda r: r["valid_bpb"]) if rows else None


def summary_lines(cfg, state: dict) -> list[str]:
    ours, best = _runs(cfg, state)
    if ours is None and best is None:
        return []
    rep = report_numbers()

    def rows_of(run, **match):
        return [r for r in (run["rows"] if run else []) if all(r.get(k) == v for k, v in match.items())]

    def tok_stats(run, name):
        return next((t for t in (run["tokenizers"] if run else []) if t["tokenizer"] == name), None)

    def best_cells(model, merges, order=None):
        r = _best(rows_of(best, tokenizer=f"bpe-{merges}", model=model, **({"order": order} if order else {})))
        if r is None:
            return "- | - | -"
        label = f"{r['order']}-gram {r['smoothing']}" if model == "ngram" else r["smoothing"]
        return f"bpe-{merges} {label} | {_pair(r['valid_ppl'], r['test_ppl'])} | {_pair(r['valid_bpb'], r['test_bpb'], 3)}"

    def our_cells(r):
        if r is None:
            return "- | -"
        return f"{_pair(r['valid_ppl'], r['test_ppl'])} | {_pair(r['valid_bpb'], r['test_bpb'], 3)}"

    lines = ["## Summary: the report, tinylm with the report's settings, tinylm's best", "",
             f"Report: \"{rep['title']}\" (its published numbers, tinylm/studies/data/shakespeare_report_numbers.yaml). "
             "Perplexities are per token of each column's tokenizer, as the report gives them: the report and the "
             "middle columns use the same kind of token (word_bpe: characters of lower-cased words without punctuation, "
             "`__` after each word), tinylm's best uses byte-level BPE on the raw text, so compare it by bits per byte "
             "(per byte of the normalised text for word_bpe, of the raw text for byte-level BPE; the raw text holds "
             "more information, so the best column's bpb is an upper bound for the same model on normalised text). "
             "The texts differ too: the report's corpus has 968 k characters; "
             + "; ".join(f"{what}: {_corpus(run['config'])}" for what, run in
                         (("tinylm, report settings", ours), ("tinylm best", best)) if run)
             + ". Bits per byte on different test texts compare only roughly.", "",
             "| stage | setting | report: valid / test | tinylm, report settings: valid / test ppl | bpb valid / test "
             "| tinylm best: model | valid / test ppl | bpb valid / test |",
             "|---|---|---|---|---|---|---|---|"]
    for t in rep["tokenizers"]:
        m, tpw = t["merges"], t["tokens_per_word"]
        o, b = tok_stats(ours, f"word_bpe-{m}"), tok_stats(best, f"bpe-{m}")
        o_cell = (f"{_pair(o['splits']['valid']['tokens_per_word'], o['splits']['test']['tokens_per_word'], 4)} | "
                  f"vocab {o['vocab_size']:,}, {o['splits']['train']['distinct_tokens']:,} in use") if o else "- | -"
        b_cell = (f"bpe-{m} | {_pair(b['splits']['valid']['tokens_per_word'], b['splits']['test']['tokens_per_word'], 4)} "
                  f"| vocab {b['vocab_size']:,}") if b else "- | - | -"
        lines.append(f"| 1 tokenizer | {m} merges: tokens per word (vocabulary {t['vocab_size']:,}) | "
                     f"{_pair(tpw['valid'], tpw['test'], 4)} | {o_cell} | {b_cell} |")
    smoothing = rep["ngram_smoothing"]
    for n in rep["ngram"]:
        r = next(iter(rows_of(ours, tokenizer=f"word_bpe-{n['merges']}", model="ngram", order=n["order"],
                              smoothing=smoothing)), None)
        lines.append(f"| 2 n-gram | {n['merges']} merges, {n['order']}-gram {smoothing} | "
                     f"{_pair(n['valid_ppl'], n['test_ppl'])} | {our_cells(r)} | {best_cells('ngram', n['merges'], n['order'])} |")
    our_bigram_runs = ours["bigram_runs"] if ours else []

    def bigram_run(merges, prefix):
        return next((r for r in our_bigram_runs if r["tokenizer"] == f"word_bpe-{merges}" and r["label"].startswith(prefix)),
                    None)
    for b in rep["bigram_lr"]:
        r = bigram_run(b["merges"], f"lr={b['lr']:g} ")
        lines.append(f"| 3 neural bigram | {b['merges']} merges, lr {b['lr']:g}, embedding 64 | "
                     f"{_pair(b['valid_ppl'], b['test_ppl'])} | {our_cells(r)} | {best_cells('neural_bigram', b['merges'])} |")
    for b in rep["bigram_grid"]:
        r = bigram_run(b["merges"], f"d={b['d_embed']} wd={b['weight_decay']:g}")
        lines.append(f"| 3 neural bigram | {b['merges']} merges, embedding {b['d_embed']}, weight decay "
                     f"{b['weight_decay']:g} | {_pair(b['valid_ppl'], None)} | {our_cells(r)} | "
                     f"{best_cells('neural_bigram', b['merges'])} |")
    for b in rep["bigram_extended"]:
        r = next(iter(rows_of(ours, tokenizer=f"word_bpe-{b['merges']}", model="neural_bigram")), None)
        lines.append(f"| 3 neural bigram | {b['merges']} merges, best setting (tinylm: its best run) | "
                     f"{_pair(None, b['test_ppl'])} | {our_cells(r)} | {best_cells('neural_bigram', b['merges'])} |")
    gpt_sizes = rep["gpt_sizes"]
    for g in rep["gpt"]:
        r = next(iter(rows_of(ours, tokenizer=f"word_bpe-{g['merges']}", model="gpt", smoothing=g["size"])), None)
        lines.append(f"| 4 GPT | {g['merges']} merges, {g['size']} ({gpt_sizes[g['size']]}), report: 1% of the data, "
                     f"{g['parameters']:,} parameters | {_pair(g['valid_ppl'], None)} | {our_cells(r)} | "
                     f"{best_cells('gpt', g['merges'])} |")
    lines += ["", "A report value of inf is its failed GPT stage (the context was longer than the validation stream); "
              "tinylm refuses such a split with an error instead. A `-` is a number the report does not give or a "
              "run that is missing.", ""]
    return lines
