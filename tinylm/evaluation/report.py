"""`report.md` and `report.html` for a training run (`tinylm train` / `tinylm demo`): configuration,
data, training, evaluation, samples. Every number is read from the run's files; a missing part is
shown as missing, never filled in, and a report with missing parts says so at the top.

The report is a list of blocks (``Doc``) rendered as markdown; the HTML page is that markdown
rendered by markdown-it with its images embedded, so it is one self-contained file. The sections
here are the building blocks of the `tinylm experiments` report too (tinylm.studies.tinystories_report).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import torch
import yaml
from markdown_it import MarkdownIt
from markupsafe import Markup

from tinylm.errors import TinyLMError
from tinylm.evaluation.plots import TEMPLATES
from tinylm.training.metrics import read_metrics

RUN_FILES = ("config.yaml", "metrics.csv", "eval.json", "prepare.json")


def read_json(path: Path):
    """A run file's JSON, or None when it is missing or damaged (its section then says missing)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
        return None


def read_yaml(path: Path):
    """A run file's YAML mapping, or None when it is missing or damaged."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def format_number(v, digits: int | None = 4, *, missing: str = "missing", grouped: bool = False) -> str:
    """A table cell: ``missing`` for None or "", yes / no for a bool, a float with ``digits``
    decimals (``grouped``: 1,234.5), an int as 1,234; with ``digits=None`` any value as its source
    printed it (str)."""
    if v is None or v == "":
        return missing
    if digits is None or isinstance(v, str):
        return str(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.{digits}f}" if grouped else f"{v:.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


# ------------------------------------------------------------------------------------- document
def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


@dataclass
class Doc:
    """A report as markdown blocks, and what it lacks."""

    blocks: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def h(self, text, level=2):
        self.blocks.append("#" * level + " " + text)

    def p(self, text):
        self.blocks.append(text)

    def table(self, headers, rows):
        self.blocks.append(
            "\n".join(
                [
                    _row(headers),
                    "|" + "---|" * len(headers),
                    *(_row(c if isinstance(c, str) else format_number(c) for c in r) for r in rows),
                ]
            )
        )

    def img(self, src: str, alt: str):
        """``src``: a path relative to the run directory."""
        self.blocks.append(f"![{alt}]({src})")

    def code(self, text):
        fence = "`" * max(3, 1 + max(map(len, re.findall("`+", text)), default=0))  # longer than any run in the text
        self.blocks.append(f"{fence}\n{text}\n{fence}")

    def lack(self, what: str):
        self.missing.append(what)
        self.p(f"**missing:** {what}")

    def markdown(self) -> str:
        return "\n\n".join(self.blocks) + "\n"


def _embedded_image(self, tokens, idx, options, env):
    """An image of the run directory goes into the page as a data: URL (one self-contained file)."""
    token = tokens[idx]
    path = env["run_dir"] / unquote(token.attrGet("src"))
    if path.is_file():
        kind = mimetypes.guess_type(path.name)[0] or "image/png"
        token.attrSet("src", f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}")
    return self.image(tokens, idx, options, env)


# raw HTML off: text from the run's files (samples, error messages) is shown, never interpreted
_markdown = MarkdownIt("commonmark", {"html": False}).enable("table")
_markdown.add_render_rule("image", _embedded_image)


# ------------------------------------------------------------------------------------- sections
def stop_rule(train: dict) -> str:
    """What ends a run, from its config's train section: epochs, a token budget, or steps (and minutes)."""
    if train.get("epochs"):
        return f"{train['epochs']} epochs"
    if train.get("max_tokens"):
        return f"{train['max_tokens']:,} tokens"
    return f"{train['max_steps']} steps" + (f" or {train['max_minutes']} minutes" if train.get("max_minutes") else "")


def section_config(doc: Doc, run: Path, ev, baseline, prep):
    doc.h("Configuration")
    cfg = read_yaml(run / "config.yaml")
    if not cfg:
        doc.lack("config.yaml (the run's configuration)")
        return
    m, t, d, tok = cfg["model"], cfg["train"], cfg["data"], cfg["tokenizer"]
    rows = [
        ("data source", d["source"]),
        ("tokenizer", f"{tok['type']}{' (lowercased)' if tok.get('lowercase') else ''}"),
        ("vocabulary", m["vocab_size"]),
        ("d_model", m["d_model"]),
        ("attention width (d_attn)", m["d_attn"]),
        ("layers", m["n_layers"]),
        ("heads", m["n_heads"]),
        ("d_ff", m["d_ff"]),
        ("context length", m["context_length"]),
        ("dropout", str(m["dropout"])),
        ("positions", m["positions"]),
        ("feed-forward / init", f"{m.get('ffn', 'gelu')} / {m.get('init', 'gpt2')}"),
        ("weights tied (embedding = output layer)", m.get("tie_weights")),
        ("batch x accumulation", f"{t['batch_size']} x {t['grad_accum_steps']}"),
        ("learning rate", f"{t['lr']} (warmup {t['warmup_steps']}, {t['schedule']} to {t['min_lr']})"),
        (
            "stop",
            stop_rule(t),
        ),
        ("label smoothing", t.get("label_smoothing", 0.0)),
    ]
    emb = cfg.get("embeddings") or {}
    if emb.get("kind", "none") != "none":
        info = read_json(run / "embeddings.json")
        where = (
            f"{info['source']}: {info['found']:,} of {info['vocab_size'] - info['specials']:,} words found "
            f"({info['coverage']:.1%}), {info['subword']:,} from subwords, {info['random']:,} random"
            + (f"; trained in {info['train_seconds']:.1f} s" if info.get("train_seconds") else "")
            + (f" (read back from the cache {info['cached']})" if info.get("cached") else "")
            if isinstance(info, dict) and "coverage" in info
            else "embeddings.json missing"
        )
        rows.append(
            (
                "token embeddings",
                f"{emb['kind']}{' ' + emb['path'] if emb.get('path') else ''}, "
                f"{'frozen' if emb.get('freeze') else 'fine-tuned'}; {where}",
            )
        )
    rows.append(("parameters (total)", (baseline or {}).get("parameters_total") or (ev or {}).get("parameters")))
    if baseline:
        rows.append(("parameters (trainable)", baseline.get("parameters_trainable")))
    doc.table(["setting", "value"], rows)
    doc.h("Data", 3)
    if prep:
        doc.table(
            ["split", "documents", "tokens", "bytes"],
            [(s, prep["documents"][s], prep["tokens"][s], prep["bytes"][s]) for s in prep["splits"]],
        )
        if prep.get("unk_rate_valid") is not None:
            doc.p(f"Share of validation tokens that are `<unk>` (word vocabulary): {prep['unk_rate_valid']:.2%}.")
    else:
        doc.lack("prepare.json (data sizes)")


def section_training(doc: Doc, run: Path, ev, want_curves: bool = False):
    doc.h("Training")
    if ev:
        doc.table(
            ["steps", "seconds", "tokens/s", "stopped by", "best valid loss", "final train loss"],
            [
                (
                    ev["steps"],
                    f"{ev['train_seconds']:.1f}",
                    f"{ev['tokens_per_s']:.0f}",
                    ev["stopped_because"],
                    ev["best_val_loss"],
                    ev["final_train_loss"],
                )
            ],
        )
    if (run / "metrics.csv").is_file():
        evals = [r for r in read_metrics(run / "metrics.csv") if r.get("val_loss") is not None]
        if evals:
            doc.table(
                ["step", "train loss", "valid loss", "valid ppl"],
                [
                    (str(r["step"]), r.get("train_loss"), r["val_loss"], format_number(r.get("val_ppl"), 2))
                    for r in evals
                ],
            )
        else:
            doc.lack("validation rows in metrics.csv (training stopped before its first evaluation)")
    else:
        doc.lack("metrics.csv (no training step was logged in this directory)")
    if (run / "epochs.csv").is_file():
        doc.p("Per epoch (train loss: the epoch's mean over its steps, with dropout; valid: after the epoch):")
        doc.table(
            ["epoch", "step", "train loss", "valid loss", "train ppl", "valid ppl", "elapsed s"],
            [
                (
                    r["epoch"],
                    r["step"],
                    r["train_loss"],
                    r["val_loss"],
                    format_number(r["train_ppl"], 2),
                    format_number(r["val_ppl"], 2),
                    format_number(r["elapsed_s"], 1),
                )
                for r in read_metrics(run / "epochs.csv")
            ],
        )
    if (run / "curves.png").is_file():
        doc.img("curves.png", "loss and perplexity curves")
    elif want_curves:
        doc.lack("curves.png (loss and perplexity curves)")


def section_eval(doc: Doc, ev):
    doc.h("Evaluation (each document scored from `<sos>`)")
    if ev and ev.get("eval"):
        scored = ev.get("checkpoint", "checkpoints/best")
        average = " (the weight average; the best raw weights score as `eval_best` in eval.json)"
        doc.p(f"The run's result, `{scored}`" + (average if scored.endswith("ema") else "") + ":")
        doc.table(
            ["split", "token ppl", "bits per byte", "word ppl", "tokens"],
            [(s, m["token_ppl"], m["bpb"], m["word_ppl"], m["tokens"]) for s, m in ev["eval"].items()],
        )
    else:
        doc.lack("eval.json (perplexity of the run's result checkpoint)")


def sample_blocks(doc: Doc, samples) -> bool:
    """The run's samples.json, prompt by prompt; False when there is none."""
    for s in samples or []:
        doc.p(f"**{s['prompt']}**")
        doc.code(f"{s['prompt']}{s['continuation']}")
    return bool(samples)


def section_samples(doc: Doc, samples):
    doc.h("Samples")
    if not sample_blocks(doc, samples):
        doc.lack("samples.json (samples)")


def this_machine() -> str:
    return (
        f"{platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, CUDA {'yes' if torch.cuda.is_available() else 'no'}"
    )


def section_machine(doc: Doc):
    doc.h("Machine")
    doc.p(f"The machine that wrote this report (the run records no machine of its own): {this_machine()}")


# ----------------------------------------------------------------------------------------- entry
def safely(doc: Doc, section, *args, **kwargs) -> None:
    """A file of an unexpected shape (another tinylm version, a hand edit) makes its section
    missing, not the whole report."""
    try:
        section(doc, *args, **kwargs)
    except (KeyError, TypeError, ValueError, IndexError, TinyLMError) as exc:
        name = section.__name__.lstrip("_").removeprefix("section_")
        doc.lack(f"{name}: a file has an unexpected format ({type(exc).__name__}: {exc})")


def open_run(run_dir: str | Path, markers=RUN_FILES) -> Path:
    run = Path(run_dir)
    if not run.is_dir():
        raise TinyLMError(f"run directory {run} does not exist")
    if not any((run / f).is_file() for f in markers):
        raise TinyLMError(f"{run} is not a tinylm run directory (none of {', '.join(markers)} is in it)")
    return run


def with_head(doc: Doc, title: str, intro: str | None = None) -> Doc:
    """The title and the completeness verdict go first, after every section has said what it lacks."""
    head = Doc()
    head.h(title, 1)
    if intro:
        head.p(intro)
    if doc.missing:
        head.p(f"**INCOMPLETE REPORT: {len(doc.missing)} part(s) missing**: " + "; ".join(doc.missing))
    doc.blocks = head.blocks + doc.blocks
    return doc


def build_report(run_dir: str | Path) -> Doc:
    run = open_run(run_dir)
    ev = read_json(run / "eval.json")
    doc = Doc()
    safely(doc, section_config, run, ev, None, read_json(run / "prepare.json"))
    safely(doc, section_training, run, ev)
    safely(doc, section_eval, ev)
    safely(doc, section_samples, read_json(run / "samples.json"))
    safely(doc, section_machine)
    return with_head(doc, f"tinylm run: {run.name}")


def save_report(doc: Doc, run: Path) -> tuple[Path, Path, list[str]]:
    """Write report.md and report.html; returns both paths and what the report lacks."""
    md, page = run / "report.md", run / "report.html"
    md.write_text(doc.markdown(), encoding="utf-8")
    body = Markup(_markdown.render(doc.markdown(), {"run_dir": run}))
    page.write_text(
        TEMPLATES.get_template("report.html.j2").render(title=f"tinylm report: {run.name}", body=body),
        encoding="utf-8",
    )
    return md, page, doc.missing


def write_run_report(run_dir: str | Path) -> tuple[Path, Path, list[str]]:
    """Write report.md and report.html of a training run; returns both paths and what the report lacks."""
    return save_report(build_report(run_dir), Path(run_dir))
