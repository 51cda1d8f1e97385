"""The study's outputs: results.csv, results.md, learning_curves.png, bigram_curves/*.png,
samples.md, study.json. Every number written here comes from the runs of
tinylm.studies.shakespeare, except the report's published numbers in the summary
(tinylm.studies.shakespeare_summary), which say so."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import platform
import re
from functools import partial
from pathlib import Path

from tinylm.evaluation.plots import pyplot, save_figure
from tinylm.evaluation.report import format_number
from tinylm.studies.shakespeare_summary import mark, summary_lines
from tinylm.training.bigram import BigramConfig

RESULT_COLUMNS = [
    "tokenizer",
    "vocab_size",
    "model",
    "order",
    "smoothing",
    "parameters",
    "valid_ppl",
    "test_ppl",
    "valid_bpb",
    "test_bpb",
    "valid_tokens",
    "test_tokens",
    "seconds",
    "converged",
]
COMPARABILITY_NOTE = (
    "Token perplexity is per token of each tokenizer, so it is **not comparable across tokenizers** "
    "(a character-level model predicts far easier units than a word-level one). Bits per byte "
    "(total NLL / (ln 2 x UTF-8 bytes of the text the tokens stand for)) is, between tokenizers of the "
    "same text: word_bpe tokenizers see the normalised text (lower case, no punctuation), the others "
    "the raw text. Each document is scored from its `<sos>`; every token after it counts, `<eos>` does not."
)
SPLITS = ("train", "valid", "test")


_f = partial(format_number, missing="-", grouped=True)  # the study's cells: "-" for no value, 1,234.5


def _variant(row: dict) -> str:
    if row["model"] == "ngram":
        return f"{row['order']}-gram {row['smoothing']}"
    if row["model"] == "neural_bigram":
        return "neural bigram"
    return f"GPT {row['smoothing']}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", text).strip("_")


def write_outputs(cfg, state: dict, out: Path) -> None:
    rows = state["rows"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    bigram_runs = [{k: v for k, v in r.items() if k != "history"} for r in state["bigram_runs"]]
    (out / "study.json").write_text(
        json.dumps(
            {
                "config": dataclasses.asdict(cfg),
                "seconds": state["seconds"],
                "stage_seconds": state["stage_seconds"],
                "tokenizers": state["tokenizers"],
                "overlap": state["overlap"],
                "rows": rows,
                "bigram_runs": bigram_runs,
                "gpt_runs": state["gpt_runs"],
            },
            indent=2,
            default=float,
        )
    )
    curve_files = plot_bigram_runs(state["bigram_runs"], out / "bigram_curves")
    write_markdown(cfg, state, out, curve_files)
    write_samples(cfg, state, out)
    plot_learning_curves(state, out / "learning_curves.png")


def tokenizer_lines(state: dict) -> list[str]:
    lines = [
        "## Task 1: tokenizers",
        "",
        "Tokens per word: for word_bpe the pieces of each word, not the end-of-word token `__` after it "
        "(the report's definition); for the others every token. Reconstruction: documents for which "
        "decode(encode(doc)) equals the document (for word_bpe, the normalised document). Tokens in use: "
        "distinct tokens in the encoded training split.",
        "",
        "| tokenizer | normalisation | vocabulary | tokens in use | tokens per word train / valid / test | "
        "bytes per token (valid) | `<unk>` rate (valid) | reconstruction train / valid / test |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in state["tokenizers"]:
        s = t["splits"]
        lines.append(
            f"| {t['tokenizer']} | {t['normalization'] or '-'} | {t['vocab_size']:,} | "
            f"{s['train']['distinct_tokens']:,} | "
            + " / ".join(f"{s[n]['tokens_per_word']:.4f}" for n in SPLITS)
            + f" | {s['valid']['bytes_per_token']:.2f} | {s['valid']['unk_rate']:.2%} | "
            + " / ".join(f"{s[n]['reconstructed']}/{s[n]['documents']}" for n in SPLITS)
            + " |"
        )
    if any(t["splits"]["valid"]["unk_rate"] > 0 for t in state["tokenizers"]):
        lines += [
            "",
            "A tokenizer with an `<unk>` rate above 0 is lossy: every rare word becomes one cheap `<unk>` "
            "prediction, so its bits per byte understate what a lossless model would need (a lower bound, "
            "not a fair comparison with the lossless rows).",
        ]
    lines += [
        "",
        "### Compression between merge counts (validation tokens per word)",
        "",
        "| tokenizers | vocabulary growth | tokens per word | reduction |",
        "|---|---|---|---|",
    ]
    families: dict[tuple, list[dict]] = {}
    for t in state["tokenizers"]:
        if t["merges"] is not None or t["type"] == "bpe":
            families.setdefault((t["type"], t["normalization"]), []).append(t)
    for family in families.values():
        family = sorted(family, key=lambda t: t["vocab_size"])
        pairs = list(zip(family, family[1:])) + ([(family[0], family[-1])] if len(family) > 2 else [])
        for a, b in pairs:
            ta, tb = a["splits"]["valid"]["tokens_per_word"], b["splits"]["valid"]["tokens_per_word"]
            growth = b["vocab_size"] - a["vocab_size"]
            lines.append(
                f"| {a['tokenizer']} -> {b['tokenizer']} | +{growth:,} (+{growth / a['vocab_size']:.0%}) | "
                f"{ta:.3f} -> {tb:.3f} | {(ta - tb) / ta:.1%} |"
            )
    if state["overlap"]:
        lines += [
            "",
            "### Verbatim overlap between splits",
            "",
            "Lines of the second split found as lines of the first: in a seeded sample (the report's "
            'x/100 check) and over all distinct lines. Repeated short lines ("Exit.", "My lord?") '
            "overlap in any split of Shakespeare; this is not leakage of passages.",
            "",
            "| splits | sampled lines found | distinct lines found |",
            "|---|---|---|",
        ]
        for pair, o in state["overlap"].items():
            lines.append(
                f"| {pair} | {o['sampled_found']}/{o['sampled']} | {o['distinct_found']:,}/{o['distinct_lines']:,} "
                f"({o['distinct_found'] / max(o['distinct_lines'], 1):.1%}) |"
            )
    return lines


def model_lines(state: dict) -> list[str]:
    rows = state["rows"]
    tok_names = list(dict.fromkeys(r["tokenizer"] for r in rows))
    lines = [
        "## Test bits per byte (lower is better)",
        "",
        "| model | " + " | ".join(tok_names) + " |",
        "|---|" + "---|" * len(tok_names),
    ]
    for v in dict.fromkeys(_variant(r) for r in rows):
        by_tok = {r["tokenizer"]: r for r in rows if _variant(r) == v}
        lines.append(
            f"| {v} | "
            + " | ".join(_f(by_tok[t]["test_bpb"], 4) + mark(by_tok[t]) if t in by_tok else "-" for t in tok_names)
            + " |"
        )
    lines += [
        "",
        "## Tasks 2-4: every model, validation and test perplexity and bits per byte",
        "",
        COMPARABILITY_NOTE,
        "",
        "| tokenizer | model | order | smoothing / setting | parameters | valid ppl | test ppl | valid bpb | test bpb "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokenizer']} | {r['model']} | {_f(r['order'])} | {r['smoothing']}{mark(r)} | "
            f"{_f(r['parameters'])} | "
            f"{_f(r['valid_ppl'], 2)} | {_f(r['test_ppl'], 2)} | {_f(r['valid_bpb'], 4)} | {_f(r['test_bpb'], 4)} | "
            f"{_f(r['seconds'], 1)} |"
        )
    return lines


# the opening of Task 3 names the optimizer the runs used (bigram.optimizer)
BIGRAM_OPTIMIZERS = {"adamw": "AdamW", "adam_l2": "Adam with the weight decay added to the gradient as an L2 term"}


def _bigram_batches(bigram) -> str:
    """What each step of the bigram runs trained on (tinylm.training.bigram's modes)."""
    pairs = f"random minibatches of {bigram.batch_size} pairs"
    if bigram.mode == "auto":
        return (
            f"every pair through the pair-count matrix up to a vocabulary of {BigramConfig.counts_max_vocab:,}, "
            f"{pairs} above it"
        )
    return "every pair through the pair-count matrix" if bigram.mode == "counts" else pairs


def bigram_lines(bigram, state: dict, curve_files: dict) -> list[str]:
    if not state["bigram_runs"]:
        return []
    lines = [
        "",
        "## Task 3: neural bigram runs",
        "",
        f"{BIGRAM_OPTIMIZERS[bigram.optimizer]}, {_bigram_batches(bigram)}, {bigram.schedule} learning rate, "
        f"validation every {bigram.eval_interval or max(10, bigram.max_steps // 30)} steps, early stopping "
        f"after {bigram.patience} evaluations without improvement, at most {bigram.max_steps} steps / "
        f"{bigram.max_seconds:g} s per run; the weights of the best validation loss are kept. The best run "
        f"of each tokenizer is its row above"
        + (
            " (the sweep ran on the first tokenizer; the others use its best setting)."
            if bigram.sweep_on == "first"
            else "."
        ),
        "",
        "| tokenizer | run | lr | embedding | weight decay | best valid loss | valid ppl | test ppl | test bpb | steps "
        "| stopped by | curves |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in state["bigram_runs"]:
        link = curve_files.get((r["tokenizer"], r["label"]))
        lines.append(
            f"| {r['tokenizer']} | {r['label']} | {r['lr']:g} | {r['d_embed']} | {r['weight_decay']:g} | "
            f"{r['best_val_loss']:.4f} | {r['valid_ppl']:.2f} | {r['test_ppl']:.2f} | {r['test_bpb']:.4f} | "
            f"{r['steps']} | {r['stopped']}{mark(r)} | " + (f"[png](bigram_curves/{link})" if link else "-") + " |"
        )
    return lines + ["", weight_decay_note(bigram, state["bigram_runs"])]


def weight_decay_note(bigram, runs: list[dict]) -> str:
    """Why the weight-decay axis of the grid does (or does not) move the numbers, from its settings."""
    decays = [r["weight_decay"] for r in runs if r["weight_decay"] > 0]
    if not decays:
        return "No run used weight decay."
    lr, wd, steps = max(r["lr"] for r in runs), max(decays), max(r["steps"] for r in runs)
    if bigram.optimizer == "adamw":
        shrink = 1 - (1 - lr * wd) ** steps
        effect = (
            "so decays this small cannot change the scores at the precision shown"
            if shrink < 0.01
            else "enough to matter"
        )
        return (
            f"Weight decay here is AdamW's (decoupled): each step multiplies a weight by (1 - lr x decay). At lr "
            f"{lr:g} and decay {wd:g} that is {lr * wd:.1e} per step, at most {shrink:.3%} over {steps:,} steps, "
            f"{effect}. The report trained with Adam "
            "and the decay added to the gradient as an L2 term, where its effect is scaled by Adam's step size "
            "instead; `bigram.optimizer=adam_l2` trains that way for a like-for-like comparison."
        )
    return (
        f"Weight decay here is an L2 term added to the gradient before Adam's normalisation "
        f"(`bigram.optimizer=adam_l2`, as in the report): decay {wd:g} x weight is compared with the loss's own "
        "gradient, so its effect depends on how small those gradients become near the optimum."
    )


def gpt_lines(gpt, state: dict) -> list[str]:
    if not state["gpt_runs"]:
        return []
    cap = f"{gpt.minutes:g} minutes of wall time" if gpt.minutes else "no wall-clock cap"
    recipe = ", ".join(f"`{o}`" for o in gpt.run_overrides) or "none"
    annealed = all(g.get("schedule_clock") == "wall" for g in state["gpt_runs"])
    schedule = (
        f"cosine ending at {gpt.max_steps:,} steps or at the wall-clock cap, whichever comes first, so a "
        "capped GPT finished its schedule"
        if annealed
        else f"cosine over at most {gpt.max_steps:,} steps, which a wall-clock cap cuts short"
    )
    lines = [
        "",
        "## Task 4: GPTs",
        "",
        f"Batch {gpt.batch_size}, lr {gpt.lr:g} ({schedule}), dropout "
        f"{gpt.dropout:g}; validation every {gpt.eval_interval} steps on {gpt.eval_batches} batches, training "
        f"stops after {gpt.patience} evaluations without improvement and the best checkpoint is scored. "
        f'Safety caps: {gpt.max_steps:,} steps and {cap}; a GPT stopped by a cap is marked "not converged" '
        f"in every table. Options beyond the size: {recipe}.",
        "",
        "| tokenizer | size | layers x d_model x heads | context | parameters | train tokens | tokens per parameter | "
        "data fraction | steps | stopped by | train tokens/s | train seconds | valid ppl | test ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in state["gpt_runs"]:
        lines.append(
            f"| {g['tokenizer']} | {g['size']} | {g['layers']} x {g['d_model']} x {g['heads']} | "
            f"{g['context_length']} | {g['parameters']:,} | {g['train_tokens']:,} | {g['tokens_per_parameter']:.3f} | "
            f"{g['data_fraction']:g} | {g['steps']} | {g['stopped']}{mark(g)} | {g['tokens_per_s']:,.0f} | "
            f"{g['train_seconds']:.0f} | {g['valid_ppl']:.2f} | {g['test_ppl']:.2f} |"
        )
    return lines


def write_markdown(cfg, state: dict, out: Path, curve_files: dict) -> None:
    data = cfg.data
    lines = [
        "# Shakespeare study",
        "",
        f"Corpus: {data.source}"
        + (f" (first {data.max_documents} works)" if data.max_documents else " (all works)")
        + f", split into chunks: train {1 - data.valid_fraction - data.test_fraction:.0%}, valid "
        f"{data.valid_fraction:.0%}, test {data.test_fraction:.0%}. Wall time per stage, all tokenizers, as "
        f"computed on {platform.machine()} with {cfg.threads} torch thread(s) for the GPTs (one for the rest): "
        + ", ".join(f"{k} {v:.0f} s" for k, v in state["stage_seconds"].items())
        + f"; total {sum(state['stage_seconds'].values()):.0f} s (this invocation: {state['seconds']:.0f} s, "
        "stages computed earlier are reused).",
        "",
    ]
    lines += summary_lines(cfg, state)
    lines += (
        tokenizer_lines(state)
        + [""]
        + model_lines(state)
        + bigram_lines(cfg.bigram, state, curve_files)
        + gpt_lines(cfg.gpt, state)
    )
    lines += [
        "",
        "Smoothings: laplace = add-1; add_0.1 = add-k with k = 0.1; interpolated = Jelinek-Mercer with EM "
        "weights fitted on the validation split; interpolated_fixed = Jelinek-Mercer with the fixed weights "
        f"{cfg.ngram.fixed_weights} (uniform, unigram, bigram, ...; the first order + 1 of them, scaled to sum to 1); "
        "kneser_ney = interpolated modified Kneser-Ney (D1, D2, D3+ per order, as KenLM). Start of a document: "
        + (
            "one `<sos>` (KenLM's convention)."
            if cfg.ngram.start_padding == "single"
            else "n-1 `<sos>` (the report's padding)."
        )
        + " Learning curves: learning_curves.png and bigram_curves/; samples (temperature "
        f"{cfg.sampling.temperature:g}): samples.md.",
        "",
    ]
    (out / "results.md").write_text("\n".join(lines), encoding="utf-8")


def write_samples(cfg, state: dict, out: Path) -> None:
    lines = [
        "# Samples",
        "",
        f"Every model, each prompt, {cfg.sampling.max_new_tokens} new tokens at temperature "
        f"{cfg.sampling.temperature:g} (word_bpe prompts are shown normalised, as the model saw them).",
        "",
    ]
    for tok, model, prompt, text in state["samples"]:
        lines += [f"## {model}, {tok}: {prompt!r}", "", "```", text, "```", ""]
    (out / "samples.md").write_text("\n".join(lines), encoding="utf-8")


def plot_bigram_runs(runs: list[dict], folder: Path) -> dict:
    """One small PNG per bigram run: training and validation loss per step."""
    if not runs:
        return {}
    plt = pyplot()
    files = {}
    for r in runs:
        hist = r["history"]
        if not hist:
            continue
        name = f"{_slug(r['tokenizer'])}_{_slug(r['label'])}.png"
        fig, ax = plt.subplots(figsize=(4.2, 3.0))
        steps = [h["step"] for h in hist]
        ax.plot(steps, [h["train_loss"] for h in hist], label="train (mean since the last evaluation)")
        ax.plot(steps, [h["val_loss"] for h in hist], label="valid")
        ax.set_title(f"neural bigram, {r['tokenizer']}\n{r['label']}", fontsize=9)
        ax.set(xlabel="step", ylabel="loss (nats per token)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save_figure(fig, folder / name, dpi=80)
        files[(r["tokenizer"], r["label"])] = name
    return files


def tokens_per_byte(row: dict) -> float:
    """Scored tokens per byte of a split, read back from one model's row (bpb = ln(ppl) x tokens / (ln 2 x bytes))."""
    return row["valid_bpb"] * math.log(2) / math.log(row["valid_ppl"])


def reference_lines(rows: list[dict], tokenizer: str) -> list[tuple[str, float]]:
    """(label, test bits per byte) of the highest-order Kneser-Ney n-gram, the best n-gram and the neural bigram."""
    mine = [r for r in rows if r["tokenizer"] == tokenizer]
    kn = [r for r in mine if r["model"] == "ngram" and r["smoothing"] == "kneser_ney"]
    ngrams = [r for r in mine if r["model"] == "ngram"]
    refs = []
    if kn:
        top = max(kn, key=lambda r: r["order"])
        refs.append((f"Kneser-Ney {top['order']}-gram", top["test_bpb"]))
    if ngrams:
        best = min(ngrams, key=lambda r: r["test_bpb"])
        if not kn or best is not top:
            refs.append((f"best n-gram ({best['order']}-gram {best['smoothing']})", best["test_bpb"]))
    refs += [("neural bigram", r["test_bpb"]) for r in mine if r["model"] == "neural_bigram"]
    return refs


def gpt_panels(state: dict) -> list[tuple[str, list, list]]:
    """One panel per tokenizer with GPTs: each GPT's validation curve in bits per byte over its whole
    run, the n-gram and bigram test values as horizontal lines."""
    panels: dict[str, tuple[list, list]] = {}
    for run, (label, curve) in zip(state["gpt_runs"], state["gpt_curves"]):
        tok = run["tokenizer"]
        row = next(
            r for r in state["rows"] if r["tokenizer"] == tok and r["model"] == "gpt" and r["smoothing"] == run["size"]
        )
        scale = tokens_per_byte(row) / math.log(2)
        points = [(h["step"], h["val_loss"] * scale, h["train_loss"] * scale) for h in curve]
        panels.setdefault(tok, ([], reference_lines(state["rows"], tok)))[0].append((run["size"] + mark(run), points))
    return [(tok, curves, refs) for tok, (curves, refs) in panels.items()]


def _draw_gpt_panel(ax, tok: str, curves: list, refs: list) -> None:
    for label, points in curves:
        steps = [p[0] for p in points]
        (line,) = ax.plot(steps, [p[1] for p in points], marker=".", ms=3, label=f"GPT {label}: valid")
        ax.plot(steps, [p[2] for p in points], ls="--", lw=1, color=line.get_color(), label=f"GPT {label}: train")
    for (label, value), color in zip(refs, ("black", "tab:gray", "tab:brown", "tab:olive")):
        ax.axhline(value, color=color, ls=":", lw=1.5, label=f"{label}: test {value:.3f}")
    ax.set_title(f"{tok}: GPT learning curves against the n-grams and the bigram", fontsize=10)
    ax.set(xlabel="optimizer step", ylabel="bits per byte (GPT: loss x tokens per byte)")


def plot_learning_curves(state: dict, path: Path) -> None:
    plt = pyplot()
    sweep_tok = state["bigram_runs"][0]["tokenizer"] if state["bigram_runs"] else None
    best = {}
    for r in state["bigram_runs"]:
        if r["tokenizer"] not in best or r["best_val_loss"] < best[r["tokenizer"]]["best_val_loss"]:
            best[r["tokenizer"]] = r
    gpt = gpt_panels(state) if state["gpt_runs"] else []
    bigram = [
        (title, curves)
        for title, curves in (
            (
                "neural bigram, best run per tokenizer: validation loss",
                [[tok, r["history"]] for tok, r in best.items()],
            ),
            (
                f"neural bigram runs on {sweep_tok}: validation loss",
                [[r["label"], r["history"]] for r in state["bigram_runs"] if r["tokenizer"] == sweep_tok],
            ),
        )
        if curves
    ]
    if not gpt and not bigram:
        return
    cols = max(len(gpt), len(bigram), 1)
    n_rows = (1 if gpt else 0) + (1 if bigram else 0)
    fig, axes = plt.subplots(n_rows, cols, figsize=(6.0 * cols, 4.3 * n_rows), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for ax, (tok, curves, refs) in zip(axes[0], gpt):
        _draw_gpt_panel(ax, tok, curves, refs)
    for ax, (title, curves) in zip(axes[n_rows - 1] if bigram else [], bigram):
        for label, hist in curves:
            if hist:
                ax.plot([h["step"] for h in hist], [h["val_loss"] for h in hist], marker=".", ms=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set(xlabel="step", ylabel="nats per token (not comparable across tokenizers)")
    for ax in axes.flat:
        if ax.lines:
            ax.set_visible(True)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=90)
