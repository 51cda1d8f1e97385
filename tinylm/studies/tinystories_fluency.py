"""Fluency beside BLEU: every decoding's continuations scored by a stronger model, the judge.

BLEU counts the n-grams a continuation shares with the one story its author wrote. A different
good story (another name, another event, the same events in other words) shares few 4-grams with
it, so BLEU-4 scores it near zero: it ranks decoders by how close they stay to the average
phrasing of the reference, not by whether they write stories. The ``fluency`` part asks a second
question of the same continuations: how many bits per byte does a stronger model, trained on the
same split, need to encode them, beside the same number for the real continuations?

What the judge reads. The judged model's word tokenizer lowercases the stories and writes rare
words as ``<unk>``; its continuations, and the real continuations as the BLEU part stored them,
are text of that form. Both are scored in exactly that form, with ``<unk>`` removed (counted
apart), each after its own prompt: the judge encodes prompt + " " + continuation and the bits of
the continuation's bytes are summed. The real continuations in the same form are the yardstick.

Lower bits are not better stories: text that repeats itself is very predictable, so a decoding
that loops scores far below real text (the likelihood trap of Holtzman et al., 2020). The part
therefore measures repetition beside the bits: the share of each continuation's word 4-grams
that already occurred earlier in it. A decoding near the real continuations on both reads like
them; below them on bits and above them on repetition is a loop; above them on bits is text the
judge finds unlike stories.
"""

from __future__ import annotations

import csv
import hashlib
import re
import statistics
from pathlib import Path

import torch

from tinylm.errors import TinyLMError
from tinylm.evaluation.byte_bits import score_bytes
from tinylm.evaluation.plots import pyplot, save_figure
from tinylm.evaluation.report import Doc, read_json
from tinylm.models.checkpoint import load_checkpoint
from tinylm.studies.stages import start_part_section

UNK = "<unk>"
REAL = "real continuation"
JUDGE_HOWTO = (
    "train it with `tinylm train --config tinystories-cpu-25m data.train=TRAIN data.valid=VALID` "
    "(the assignment's split), or set experiments.judge=null to skip this part"
)


def judge_stamp(path: str | None) -> str | None:
    """What identifies the judge in the part's key: its checkpoint.json, which changes when it is retrained."""
    meta = Path(path or "") / "checkpoint.json"
    return hashlib.sha256(meta.read_bytes()).hexdigest()[:16] if path and meta.is_file() else None


def without_unk(text: str) -> tuple[str, int]:
    """The text with every ``<unk>`` removed (spaces collapsed), and how many there were."""
    return re.sub(r"\s+", " ", text.replace(UNK, " ")).strip(), text.count(UNK)


def repeated_ngram_share(text: str, n: int = 4) -> float:
    """Share of the text's word n-grams that already occurred earlier in it (0 for fewer than n words)."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def continuation_bits(judge, tokenizer, prompt: str, continuation: str) -> tuple[float, int]:
    """(bits the judge spends on the continuation's bytes after the prompt, those bytes)."""
    head = prompt + " "
    score = score_bytes(judge, tokenizer, head + continuation, top=0)
    start = len(head.encode("utf-8"))
    return float(score.byte_bits[start:].sum()), score.n_bytes - start


def read_continuations(run_dir: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The 50 prompts and each setting's continuations (the real ones first), from the per-sample
    CSVs the decoding and BLEU parts list in their JSON, which continue the same prompts."""
    files = [
        ((f"sample {s['name']}" if part == "bleu" else s["name"]), run_dir / s["csv"])
        for part in ("decoding", "bleu")
        for s in (read_json(run_dir / f"{part}.json") or {}).get("settings") or []
        if s.get("csv") and (run_dir / s["csv"]).is_file()
    ]
    if not files:
        raise TinyLMError(f"no decoding_samples_*.csv or bleu_samples_*.csv in {run_dir}: run the decoding part first")
    prompts, columns = None, {}
    for name, path in files:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        if prompts is None:
            prompts = [r["prompt"] for r in rows]
            columns[REAL] = [r["reference_continuation"] for r in rows]
        elif [r["prompt"] for r in rows] != prompts:
            raise TinyLMError(f"{path.name} continues other prompts than {files[0][1].name}: run its part again")
        columns[name] = [r["hypothesis_continuation"] for r in rows]
    return prompts, columns


def score_setting(judge, tokenizer, prompts: list[str], texts: list[str]) -> dict:
    bits, nbytes, per_sample, repeats, unks, words = 0.0, 0, [], [], 0, 0
    for prompt, text in zip(prompts, texts):
        clean, n_unk = without_unk(text)
        unks, words = unks + n_unk, words + len(text.split())
        repeats.append(repeated_ngram_share(clean))
        if not clean:
            continue
        b, n = continuation_bits(judge, tokenizer, without_unk(prompt)[0], clean)
        bits, nbytes = bits + b, nbytes + n
        per_sample.append(b / n)
    q1, _, q3 = statistics.quantiles(per_sample, n=4) if len(per_sample) > 1 else (per_sample or [0.0]) * 3
    return {
        "bpb": bits / nbytes if nbytes else float("nan"),
        "bpb_median": statistics.median(per_sample) if per_sample else float("nan"),
        "bpb_q1": q1,
        "bpb_q3": q3,
        "repeated_4gram_share": statistics.mean(repeats),
        "unk_per_100_words": 100 * unks / max(words, 1),
        "words_mean": words / max(len(texts), 1),
        "samples": len(texts),
        "scored_bytes": nbytes,
    }


def _judge_valid_bpb(path: Path) -> float | None:
    """The judge's own bits per byte on its validation stories (its run's eval.json), when it is there."""
    bpb = ((read_json(path.parent.parent / "eval.json") or {}).get("eval") or {}).get("valid", {}).get("bpb")
    return float(bpb) if isinstance(bpb, (int, float)) else None


def part_fluency(study) -> dict:
    """Score every decoding's continuations (and the real ones) with ``experiments.judge``."""
    path = study.exp.judge
    if path is None:
        return {"off": True}
    if not (Path(path) / "checkpoint.json").is_file():
        raise TinyLMError(f"experiments.judge: no checkpoint at {path}; {JUDGE_HOWTO}")
    torch.set_num_threads(study.threads)  # windows of whole stories: matrix work, unlike decoding
    judge, tokenizer, meta = load_checkpoint(path)
    prompts, columns = read_continuations(study.run_dir)
    rows = [{"name": name, **score_setting(judge, tokenizer, prompts, texts)} for name, texts in columns.items()]
    out = {
        "judge": str(path),
        "judge_parameters": judge.num_parameters(),
        "judge_step": meta.get("step"),
        "judge_valid_bpb": _judge_valid_bpb(Path(path)),
        "settings": rows,
    }
    out["png"] = fluency_chart(rows, study.run_dir / "fluency.png").name
    return out


def fluency_chart(rows: list[dict], path: str | Path) -> Path:
    """Judge bits per byte (median and quartiles of the samples, the pooled value as a dot) and the
    repeated 4-gram share of each setting, the real continuations' values as dashed lines."""
    plt = pyplot()
    fig, (ax_bits, ax_rep) = plt.subplots(1, 2, figsize=(11, 0.42 * len(rows) + 1.6), sharey=True)
    ys = list(range(len(rows)))[::-1]
    colours = ["tab:green" if r["name"] == REAL else "tab:blue" for r in rows]
    for y, r, c in zip(ys, rows, colours):
        ax_bits.plot([r["bpb_q1"], r["bpb_q3"]], [y, y], color=c, lw=6, alpha=0.35, solid_capstyle="butt")
        ax_bits.plot(r["bpb_median"], y, "|", color=c, ms=14, mew=2)
        ax_bits.plot(r["bpb"], y, "o", color=c, ms=5)
        ax_bits.annotate(
            f"{r['bpb']:.3f}", (max(r["bpb_q3"], r["bpb"]), y), xytext=(6, -3), textcoords="offset points", fontsize=8
        )
    bars = ax_rep.barh(ys, [100 * r["repeated_4gram_share"] for r in rows], color=colours, height=0.6)
    for bar, r in zip(bars, rows):
        ax_rep.annotate(
            f"{100 * r['repeated_4gram_share']:.1f}%",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            xytext=(3, -3),
            textcoords="offset points",
            fontsize=8,
        )
    real = next((r for r in rows if r["name"] == REAL), None)
    if real:
        ax_bits.axvline(real["bpb"], color="tab:green", ls="--", lw=1)
        ax_rep.axvline(100 * real["repeated_4gram_share"], color="tab:green", ls="--", lw=1)
    ax_bits.set_yticks(ys, [r["name"] for r in rows])
    ax_bits.set(xlabel="judge bits per byte (dot: all samples pooled; bar: quartiles)", title="how predictable")
    ax_rep.set(xlabel="word 4-grams that repeat an earlier one (%)", title="how repetitive")
    for ax in (ax_bits, ax_rep):
        ax.grid(alpha=0.3, axis="x")
    ax_rep.set_xlim(0, 1.25 * max(100 * r["repeated_4gram_share"] for r in rows) + 1)
    low, high = ax_bits.get_xlim()
    ax_bits.set_xlim(low, high + 0.08 * (high - low))  # room for the last label
    fig.suptitle("The continuations of each decoding, read by a stronger model")
    return save_figure(fig, path)


def section_fluency(doc: Doc, run: Path, flu) -> None:
    heading = "Fluency: the continuations scored by a stronger model"
    if not start_part_section(doc, heading, flu, "fluency", "the judge's scores"):
        return
    if flu.get("off"):
        doc.p("Not run (experiments.judge is null).")
        return
    real = next(r for r in flu["settings"] if r["name"] == REAL)
    bpb = flu.get("judge_valid_bpb")
    own = f"; {bpb:.3f} bits per byte on the validation stories as written" if bpb else ""
    doc.p(
        "BLEU counts the n-grams a continuation shares with the one story its author wrote, so any other good "
        "story (another name, another event, the same events in other words) scores near zero. Here a stronger "
        f"model, the judge (`{flu['judge']}`, {flu['judge_parameters']:,} parameters, trained on the same split{own}), "
        "scores every continuation in bits per byte after its prompt, in the form the word tokenizer gives "
        "them (lowercased, `<unk>` removed and counted apart), the real continuations in the same form. "
        "Lower bits are not better stories: text that repeats itself is very predictable, so the repeated "
        "4-gram share stands beside them. A decoding near the real continuations on both reads like them."
    )
    rows = []
    for r in flu["settings"]:
        rows.append(
            (
                r["name"],
                f"{r['bpb']:.3f}",
                f"{r['bpb_median']:.3f} ({r['bpb_q1']:.3f}-{r['bpb_q3']:.3f})",
                f"{r['bpb'] - real['bpb']:+.3f}",
                f"{100 * r['repeated_4gram_share']:.1f}%",
                f"{r['unk_per_100_words']:.2f}",
                f"{r['words_mean']:.0f}",
            )
        )
    doc.table(
        [
            "decoding",
            "judge bits/byte",
            "per sample: median (quartiles)",
            "vs real",
            "repeated 4-grams",
            "<unk> per 100 words",
            "words",
        ],
        rows,
    )
    if bpb:
        doc.p(
            f"In this form the real continuations cost the judge {real['bpb']:.3f} bits per byte, where the "
            f"stories as written cost it {bpb:.3f}: lowercasing and the word tokenizer's spacing make the "
            "difference, so each decoding is read against the real continuations in the same form."
        )
    if flu.get("png") and (run / flu["png"]).is_file():
        doc.img(flu["png"], "judge bits per byte and repetition of each decoding's continuations")
