"""The summary table of the Shakespeare study beside the four-stage report.

Each row holds a number that "Building GPT from Scratch - A Four-Stage Implementation Report"
published (kept in data/shakespeare_report_numbers.yaml), tinylm's number for the same setting
(the run with ``tokenizers.bpe_type: word_bpe``, the ``shakespeare-report`` preset) and tinylm's
best model of the same kind (the run with byte-level BPE, the ``shakespeare-study`` preset). The
two runs are this study and the one in ``compare_with``; a column stays empty when its run is missing.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import yaml

from tinylm.evaluation.report import format_number

REPORT_NUMBERS = resources.files("tinylm") / "studies" / "data" / "shakespeare_report_numbers.yaml"


def report_numbers() -> dict:
    return yaml.safe_load(REPORT_NUMBERS.read_text(encoding="utf-8"))


def _pair(a, b, digits=2) -> str:
    return " / ".join(format_number(None if v is None else float(v), digits, missing="-", grouped=True) for v in (a, b))


def _runs(cfg, state: dict) -> tuple[dict | None, dict | None]:
    """(the run with the report's settings, the run with tinylm's stronger defaults), each None
    when missing."""
    this_run = {part: state[part] for part in ("tokenizers", "rows", "bigram_runs", "gpt_runs")}
    runs = [{"config": dataclasses.asdict(cfg), **this_run}]
    path = Path(cfg.compare_with or "") / "study.json"
    if cfg.compare_with and path.is_file():
        runs.append(json.loads(path.read_text()))
    report_run = next((r for r in runs if r["config"]["tokenizers"]["bpe_type"] == "word_bpe"), None)
    best_run = next((r for r in runs if r["config"]["tokenizers"]["bpe_type"] == "bpe"), None)
    return report_run, best_run


def _corpus(config: dict) -> str:
    data = config["data"]
    works = f"the first {data['max_documents']} works" if data["max_documents"] else "all works"
    train = 1 - data["valid_fraction"] - data["test_fraction"]
    return (
        f"{works} of the shakespeare package, split {train:.0%} / {data['valid_fraction']:.0%} / "
        f"{data['test_fraction']:.0%}"
    )


def _matching(run: dict | None, part: str, **match) -> list[dict]:
    """The entries of a run's ``part`` (rows, tokenizers, bigram_runs) with these values."""
    return [r for r in (run[part] if run else []) if all(r.get(k) == v for k, v in match.items())]


def _one(run: dict | None, part: str, **match) -> dict | None:
    return next(iter(_matching(run, part, **match)), None)


def mark(entry: dict | None) -> str:
    """The tag every table puts after a model stopped by its step or wall-clock cap rather than by
    early stopping; an entry without the flag is not marked."""
    return " (not converged)" if entry is not None and entry.get("converged") is False else ""


def _best_cells(best, model: str, merges: int, **match) -> str:
    """tinylm's best model of this kind on byte-level BPE with as many merges: the lowest test bits per byte."""
    rows = _matching(best, "rows", tokenizer=f"bpe-{merges}", model=model, **match)
    if not rows:
        return "- | - | -"
    r = min(rows, key=lambda r: r["test_bpb"])
    label = f"{r['order']}-gram {r['smoothing']}" if model == "ngram" else r["smoothing"]
    return (
        f"bpe-{merges} {label}{mark(r)} | {_pair(r['valid_ppl'], r['test_ppl'])} | "
        f"{_pair(r['valid_bpb'], r['test_bpb'], 3)}"
    )


def _line(stage: str, setting: str, report_cell: str, our_row: dict | None, best_cell: str) -> str:
    ours = (
        "- | -"
        if our_row is None
        else f"{_pair(our_row['valid_ppl'], our_row['test_ppl'])}{mark(our_row)} | "
        f"{_pair(our_row['valid_bpb'], our_row['test_bpb'], 3)}"
    )
    return f"| {stage} | {setting} | {report_cell} | {ours} | {best_cell} |"


def _head_lines(rep: dict, ours, best) -> list[str]:
    return [
        "## Summary: the report, tinylm with the report's settings, tinylm's best",
        "",
        f'Report: "{rep["title"]}" (its published numbers, tinylm/studies/data/shakespeare_report_numbers.yaml). '
        "Perplexities are per token of each column's tokenizer, as the report gives them: the report and the "
        "middle columns use the same kind of token (word_bpe: characters of lower-cased words without punctuation, "
        "`__` after each word), tinylm's best uses byte-level BPE on the raw text, so compare it by bits per byte "
        "(per byte of the normalised text for word_bpe, of the raw text for byte-level BPE; the raw text holds "
        "more information, so the best column's bpb is an upper bound for the same model on normalised text). "
        "The texts differ too: the report's corpus has 968 k characters; "
        + "; ".join(
            f"{what}: {_corpus(run['config'])}"
            for what, run in (("tinylm, report settings", ours), ("tinylm best", best))
            if run
        )
        + ". Bits per byte on different test texts compare only roughly.",
        "",
        "| stage | setting | report: valid / test | tinylm, report settings: valid / test ppl | bpb valid / test "
        "| tinylm best: model | valid / test ppl | bpb valid / test |",
        "|---|---|---|---|---|---|---|---|",
    ]


def _tokenizer_lines(rep: dict, ours, best) -> list[str]:
    def tokens_per_word(t: dict) -> str:
        return _pair(t["splits"]["valid"]["tokens_per_word"], t["splits"]["test"]["tokens_per_word"], 4)

    lines = []
    for t in rep["tokenizers"]:
        m, tpw = t["merges"], t["tokens_per_word"]
        o, b = _one(ours, "tokenizers", tokenizer=f"word_bpe-{m}"), _one(best, "tokenizers", tokenizer=f"bpe-{m}")
        in_use = f"{o['splits']['train']['distinct_tokens']:,} in use" if o else ""
        o_cell = f"{tokens_per_word(o)} | vocab {o['vocab_size']:,}, {in_use}" if o else "- | -"
        b_cell = f"bpe-{m} | {tokens_per_word(b)} | vocab {b['vocab_size']:,}" if b else "- | - | -"
        lines.append(
            f"| 1 tokenizer | {m} merges: tokens per word (vocabulary {t['vocab_size']:,}) | "
            f"{_pair(tpw['valid'], tpw['test'], 4)} | {o_cell} | {b_cell} |"
        )
    return lines


def _ngram_lines(rep: dict, ours, best) -> list[str]:
    smoothing = rep["ngram_smoothing"]
    return [
        _line(
            "2 n-gram",
            f"{n['merges']} merges, {n['order']}-gram {smoothing}",
            _pair(n["valid_ppl"], n["test_ppl"]),
            _one(
                ours, "rows", tokenizer=f"word_bpe-{n['merges']}", model="ngram", order=n["order"], smoothing=smoothing
            ),
            _best_cells(best, "ngram", n["merges"], order=n["order"]),
        )
        for n in rep["ngram"]
    ]


def _bigram_lines(rep: dict, ours, best) -> list[str]:
    def line(b: dict, setting: str, report_cell: str, our_row: dict | None) -> str:
        return _line(
            "3 neural bigram",
            f"{b['merges']} merges, {setting}",
            report_cell,
            our_row,
            _best_cells(best, "neural_bigram", b["merges"]),
        )

    def our_run(b: dict, label_start: str) -> dict | None:
        runs = _matching(ours, "bigram_runs", tokenizer=f"word_bpe-{b['merges']}")
        return next((r for r in runs if r["label"].startswith(label_start)), None)

    return (
        [
            line(
                b, f"lr {b['lr']:g}, embedding 64", _pair(b["valid_ppl"], b["test_ppl"]), our_run(b, f"lr={b['lr']:g} ")
            )
            for b in rep["bigram_lr"]
        ]
        + [
            line(
                b,
                f"embedding {b['d_embed']}, weight decay {b['weight_decay']:g}",
                _pair(b["valid_ppl"], None),
                our_run(b, f"d={b['d_embed']} wd={b['weight_decay']:g}"),
            )
            for b in rep["bigram_grid"]
        ]
        + [
            line(
                b,
                "best setting (tinylm: its best run)",
                _pair(None, b["test_ppl"]),
                _one(ours, "rows", tokenizer=f"word_bpe-{b['merges']}", model="neural_bigram"),
            )
            for b in rep["bigram_extended"]
        ]
    )


def _gpt_lines(rep: dict, ours, best) -> list[str]:
    return [
        _line(
            "4 GPT",
            f"{g['merges']} merges, {g['size']} ({rep['gpt_sizes'][g['size']]}), report: 1% of the "
            f"data, {g['parameters']:,} parameters",
            _pair(g["valid_ppl"], None),
            _one(ours, "rows", tokenizer=f"word_bpe-{g['merges']}", model="gpt", smoothing=g["size"]),
            _best_cells(best, "gpt", g["merges"]),
        )
        for g in rep["gpt"]
    ]


def _verdict(run: dict, what: str) -> list[str]:
    """For each tokenizer with a GPT: does its best GPT beat the Kneser-Ney 4-gram (or the highest
    order fitted), the best n-gram and the neural bigram on test bits per byte, and by how much."""
    lines = []
    for tok in dict.fromkeys(r["tokenizer"] for r in run["rows"] if r["model"] == "gpt"):
        rows = _matching(run, "rows", tokenizer=tok)
        gpt = min((r for r in rows if r["model"] == "gpt"), key=lambda r: r["test_bpb"])
        kn = [r for r in rows if r["model"] == "ngram" and r["smoothing"] == "kneser_ney"]
        others = (
            ([max(kn, key=lambda r: r["order"])] if kn else [])
            + [min((r for r in rows if r["model"] == "ngram"), key=lambda r: r["test_bpb"], default=None)]
            + [next((r for r in rows if r["model"] == "neural_bigram"), None)]
        )
        parts, seen, wins = [], set(), True
        for r in others:
            if r is None or id(r) in seen:
                continue
            seen.add(id(r))
            name = "the neural bigram" if r["model"] == "neural_bigram" else f"the {r['order']}-gram {r['smoothing']}"
            gap = r["test_bpb"] - gpt["test_bpb"]
            wins = wins and gap > 0
            verb = "beats" if gap > 0 else "does not beat"
            value = f"{r['test_bpb']:.3f}" + (", not converged" if mark(r) else "")
            parts.append(
                f"{verb} {name} ({value}) by {gap:.3f} bits per byte ({gap / r['test_bpb']:.1%})"
                if gap > 0
                else f"{verb} {name} ({value}): it is {-gap:.3f} bits per byte worse"
            )
        lines.append(
            f"- {what}, {tok}: the best GPT, {gpt['smoothing']}{mark(gpt)} at {gpt['test_bpb']:.3f} test bits "
            "per byte, " + "; ".join(parts) + "." + _cap_caveat(gpt, wins)
        )
    return lines


def _cap_caveat(gpt: dict, wins: bool) -> str:
    """What a cap on the GPT means for the answer: training on could only lower its best
    validation loss, so a win is a lower bound on the margin and a loss may be the cap's doing."""
    if not mark(gpt):
        return ""
    return (
        " It was stopped by a cap while still improving, so these margins are what the cap allowed, not the "
        "most it could reach."
        if wins
        else " It was stopped by a cap while still improving, so where it loses the cap may be the reason."
    )


def answer_lines(ours, best) -> list[str]:
    """The report's question answered from this study's numbers."""
    lines = [
        f
        for what, run in (("tinylm best settings", best), ("report settings", ours))
        if run
        for f in _verdict(run, what)
    ]
    if not lines:
        return []
    return (
        [
            "### Does the GPT beat the n-grams and the neural bigram?",
            "",
            "Test bits per byte on the same test text with the same tokenizer (lower is better); a model marked "
            '"not converged" was stopped by a cap while its validation loss may still have been falling.',
            "",
        ]
        + lines
        + [""]
    )


def summary_lines(cfg, state: dict) -> list[str]:
    """The summary's heading, its table (a row per number the report published) and its notes."""
    ours, best = _runs(cfg, state)
    if ours is None and best is None:
        return []
    rep = report_numbers()
    lines = _head_lines(rep, ours, best)
    for stage_lines in (_tokenizer_lines, _ngram_lines, _bigram_lines, _gpt_lines):
        lines += stage_lines(rep, ours, best)
    lines += [
        "",
        'The "tinylm best" columns hold, for each kind of model, the one with the lowest test bits per byte.',
        "",
    ]
    lines += answer_lines(ours, best)
    return lines + [
        "",
        "A report value of inf is its failed GPT stage (the context was longer than the validation "
        "stream); tinylm refuses such a split with an error instead. A `-` is a number the report does "
        "not give or a run that is missing.",
        "",
    ]
