"""The study's outputs: results.csv, results.md, learning_curves.png, samples.md, study.json.
Every number written here comes from the runs of tinylm.studies.shakespeare; nothing is filled in."""

from __future__ import annotations

import csv
import dataclasses
import json
import platform
from pathlib import Path

from tinylm.evaluation.plots import pyplot

RESULT_COLUMNS = ["tokenizer", "vocab_size", "model", "order", "smoothing", "parameters", "valid_ppl", "test_ppl",
                  "valid_bpb", "test_bpb", "valid_tokens", "test_tokens", "seconds"]
COMPARABILITY_NOTE = (
    "Token perplexity is per token of each tokenizer, so it is **not comparable across tokenizers** "
    "(a character-level model predicts far easier units than a word-level one). Bits per byte "
    "(total NLL / (ln 2 x UTF-8 bytes of the same text)) is: compare rows with different tokenizers by "
    "bpb. Each document is scored from its `<sos>`; every token after it counts, `<eos>` does not.")


def _f(v, digits=3):
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _variant(row: dict) -> str:
    if row["model"] == "ngram":
        return f"{row['order']}-gram {row['smoothing']}"
    if row["model"] == "neural_bigram":
        return "neural bigram"
    return "GPT"


def write_outputs(cfg, state: dict, out: Path) -> None:
    rows = state["rows"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / "study.json").write_text(json.dumps(
        {"config": dataclasses.asdict(cfg), "seconds": state["seconds"], "tokenizers": state["tokenizers"],
         "rows": rows, "bigram_sweep": state["bigram_sweep"]}, indent=2))
    write_markdown(cfg, state, out)
    write_samples(state, out)
    plot_curves(state, out / "learning_curves.png")


def write_markdown(cfg, state: dict, out: Path) -> None:
    rows = state["rows"]
    tok_names = [t["tokenizer"] for t in state["tokenizers"]]
    lines = ["# Shakespeare study", "",
             f"Corpus: {cfg.source}" + (f" (first {cfg.max_documents} works)" if cfg.max_documents else " (all works)")
             + f", split into chunks: valid {cfg.valid_fraction:.0%}, test {cfg.test_fraction:.0%}. "
             f"Total time {state['seconds']:.0f} s on {platform.machine()} with {cfg.threads} torch thread(s).", "",
             "## Task 1: tokenizers (validation split)", "",
             "| tokenizer | vocabulary | tokens per word | bytes per token | <unk> rate | decode(encode(doc)) == doc | train tokens |",
             "|---|---|---|---|---|---|---|"]
    for t in state["tokenizers"]:
        lines.append(f"| {t['tokenizer']} | {t['vocab_size']:,} | {t['tokens_per_word']:.3f} | {t['bytes_per_token']:.2f} "
                     f"| {t['unk_rate']:.2%} | {t['reconstructed']} | {t['train_tokens']:,} |")
    if any(t["unk_rate"] > 0 for t in state["tokenizers"]):
        lines += ["", "A tokenizer with an `<unk>` rate above 0 is lossy: every rare word becomes one cheap `<unk>` "
                  "prediction, so its bits per byte understate what a lossless model would need (a lower bound, "
                  "not a fair comparison with the lossless BPE and char rows)."]
    lines += ["", "## Test bits per byte (comparable across lossless tokenizers; lower is better)", "",
              "| model | " + " | ".join(tok_names) + " |", "|---|" + "---|" * len(tok_names)]
    variants = list(dict.fromkeys(_variant(r) for r in rows))
    for v in variants:
        by_tok = {r["tokenizer"]: r for r in rows if _variant(r) == v}
        lines.append(f"| {v} | " + " | ".join(_f(by_tok[t]["test_bpb"], 4) if t in by_tok else "-" for t in tok_names) + " |")
    lines += ["", "## All models: validation and test perplexity and bits per byte", "", COMPARABILITY_NOTE, "",
              "| tokenizer | model | order | smoothing / setting | parameters | valid ppl | test ppl | valid bpb | test bpb | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['model']} | {_f(r['order'])} | {r['smoothing']} | {_f(r['parameters'])} | "
                     f"{_f(r['valid_ppl'], 2)} | {_f(r['test_ppl'], 2)} | {_f(r['valid_bpb'], 4)} | {_f(r['test_bpb'], 4)} | "
                     f"{_f(r['seconds'], 1)} |")
    if state["bigram_sweep"]:
        lines += ["", f"## Neural bigram sweep ({state['bigram_sweep'][0]['tokenizer']}, validation loss in nats per token)", "",
                  "| embedding | weight decay | best valid loss | steps | stopped by |", "|---|---|---|---|---|"]
        for s in state["bigram_sweep"]:
            lines.append(f"| {s['d_embed']} | {s['weight_decay']} | {s['best_val_loss']:.4f} | {s['steps']} | {s['stopped']} |")
        lines += ["", "The best setting (first row) is used for every tokenizer."]
    lines += ["", "Smoothings: laplace = add-1; add_0.1 = add-k with k = 0.1; interpolated = "
              "Jelinek-Mercer with EM weights fitted on the validation split; kneser_ney = interpolated modified "
              "Kneser-Ney (D1, D2, D3+ per order, as KenLM). Learning curves: learning_curves.png; samples: samples.md.", ""]
    (out / "results.md").write_text("\n".join(lines), encoding="utf-8")


def write_samples(state: dict, out: Path) -> None:
    lines = ["# Samples", ""]
    for tok, model, prompt, text in state["samples"]:
        lines += [f"## {model}, {tok}: {prompt!r}", "", "```", text, "```", ""]
    (out / "samples.md").write_text("\n".join(lines), encoding="utf-8")


def plot_curves(state: dict, path: Path) -> None:
    plt = pyplot()

    panels = [(key, title) for key, title in (("gpt", "GPT validation loss"), ("bigram", "neural bigram validation loss"),
                                               ("bigram-sweep", "bigram sweep (first tokenizer)"))
              if state["curves"][key]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for label, hist in state["curves"][key]:
            if hist:
                ax.plot([h["step"] for h in hist], [h["val_loss"] for h in hist], marker=".", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("nats per token (not comparable across tokenizers)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
