"""`report.md` and `report.html` for a run directory. Every number is read from the run's files; a
missing part is shown as missing, never filled in, and a report with missing parts says so at the top.

A training run (`tinylm train` / `tinylm demo`) gets configuration, data, training, evaluation and
samples. A `tinylm experiments` run (it has ``experiments.json``) gets every table and figure of the
TinyStories assignment as well. The report is built once as a list of blocks and rendered twice.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from tinylm.errors import TinyLMError

CORE_FILES = ("config.yaml", "metrics.csv", "eval.json")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def _fmt(v, digits=4):
    if v is None:
        return "missing"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _mib(n) -> str:
    return "missing" if n is None else f"{n / 2**20:.2f} MiB"


# ------------------------------------------------------------------------------------- document
@dataclass
class Doc:
    blocks: list[tuple] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def h(self, text, level=2):
        self.blocks.append(("h", level, text))

    def p(self, text):
        self.blocks.append(("p", text))

    def table(self, headers, rows):
        self.blocks.append(("table", list(headers), [[_fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]))

    def img(self, path: Path, alt: str):
        self.blocks.append(("img", path, alt))

    def code(self, text):
        self.blocks.append(("code", text))

    def lack(self, what: str):
        self.missing.append(what)
        self.blocks.append(("p", f"**missing:** {what}"))


def render_markdown(doc: Doc, run: Path) -> str:
    out = []
    for b in doc.blocks:
        if b[0] == "h":
            out += ["#" * b[1] + " " + b[2], ""]
        elif b[0] == "p":
            out += [b[1], ""]
        elif b[0] == "table":
            esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            out += ["| " + " | ".join(b[1]) + " |", "|" + "---|" * len(b[1])]
            out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in b[2]] + [""]
        elif b[0] == "img":
            out += [f"![{b[2]}]({b[1].relative_to(run).as_posix()})", ""]
        elif b[0] == "code":
            out += ["```", b[1], "```", ""]
    return "\n".join(out)


def _inline(text: str) -> str:
    """The little markdown the blocks use: **bold** and `code`."""
    import re

    t = html.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    t = re.sub(r"`(.+?)`", r"<code>\1</code>", t)
    return re.sub(r"\[(.+?)\]\((.+?)\)", r'<a href="\2">\1</a>', t)


def render_html(doc: Doc, run: Path, title: str) -> str:
    out = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
           "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
           "table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;"
           "text-align:left}th{background:#f0f0f0}pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap}"
           "img{max-width:100%}</style></head><body>"]
    for b in doc.blocks:
        if b[0] == "h":
            out.append(f"<h{b[1]}>{html.escape(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            out.append(f"<p>{_inline(b[1])}</p>")
        elif b[0] == "table":
            out.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in b[1]) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in b[2]]
            out.append("</table>")
        elif b[0] == "img":  # embedded, so the page is one self-contained file
            data = base64.b64encode(b[1].read_bytes()).decode()
            out.append(f"<p><img alt='{html.escape(b[2])}' src='data:image/png;base64,{data}'></p>")
        elif b[0] == "code":
            out.append(f"<pre>{html.escape(b[1])}</pre>")
    out.append("</body></html>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------- sections
def _section_config(doc: Doc, run: Path, cfg, ev, baseline, prep):
    doc.h("Configuration")
    if not cfg:
        doc.lack("config.yaml (the run's configuration)")
        return
    m, t, d = cfg["model"], cfg["train"], cfg["data"]
    rows = [("data source", d["source"]), ("tokenizer", f"{cfg['tokenizer']['type']}"
                                                        f"{' (lowercased)' if cfg['tokenizer'].get('lowercase') else ''}"),
            ("vocabulary", m["vocab_size"]), ("d_model", m["d_model"]), ("attention width (d_attn)", m["d_attn"]),
            ("layers", m["n_layers"]), ("heads", m["n_heads"]), ("d_ff", m["d_ff"]),
            ("context length", m["context_length"]), ("dropout", str(m["dropout"])), ("positions", m["positions"]),
            ("batch x accumulation", f"{t['batch_size']} x {t['grad_accum_steps']}"),
            ("learning rate", f"{t['lr']} (warmup {t['warmup_steps']}, {t['schedule']} to {t['min_lr']})")]
    total = (baseline or {}).get("parameters_total") or (ev or {}).get("parameters")
    rows.append(("parameters (total)", total))
    if baseline:
        rows.append(("parameters (trainable)", baseline.get("parameters_trainable")))
    doc.table(["setting", "value"], rows)
    doc.h("Data", 3)
    if prep:
        doc.table(["split", "documents", "tokens", "bytes"],
                  [(s, prep["documents"][s], prep["tokens"][s], prep["bytes"][s]) for s in prep["splits"]])
        if prep.get("unk_rate_valid") is not None:
            doc.p(f"Share of validation tokens that are `<unk>` (word vocabulary): {prep['unk_rate_valid']:.2%}.")
    else:
        doc.lack("prepare.json (data sizes)")


def _section_training(doc: Doc, run: Path, ev, want_curves: bool = False):
    doc.h("Training")
    if ev:
        doc.table(["steps", "seconds", "tokens/s", "stopped by", "best valid loss", "final train loss"],
                  [(ev["steps"], f"{ev['train_seconds']:.1f}", f"{ev['tokens_per_s']:.0f}", ev["stopped_because"],
                    ev["best_val_loss"], ev["final_train_loss"])])
    metrics_path = run / "metrics.csv"
    if metrics_path.is_file():
        with open(metrics_path) as f:
            evals = [r for r in csv.DictReader(f) if r.get("val_loss")]
        if evals:
            num = lambda v, d: f"{float(v):.{d}f}" if v not in (None, "") else "missing"  # noqa: E731
            doc.table(["step", "train loss", "valid loss", "valid ppl"],
                      [(r["step"], num(r.get("train_loss"), 4), num(r["val_loss"], 4), num(r.get("val_ppl"), 2))
                       for r in evals])
        else:
            doc.lack("validation rows in metrics.csv (training stopped before its first evaluation)")
    else:
        doc.lack("metrics.csv (no training step was logged in this directory)")
    if (run / "curves.png").is_file():
        doc.img(run / "curves.png", "loss and perplexity curves")
    elif want_curves:
        doc.lack("curves.png (loss and perplexity curves)")


def _section_eval(doc: Doc, ev):
    doc.h("Evaluation (best checkpoint, each document scored from `<sos>`)")
    if ev and ev.get("eval"):
        doc.table(["split", "token ppl", "bits per byte", "word ppl", "tokens"],
                  [(s, m["token_ppl"], m["bpb"], m["word_ppl"], m["tokens"]) for s, m in ev["eval"].items()])
    else:
        doc.lack("eval.json (perplexity of the best checkpoint)")


def _bleu_rows(settings):
    rows = []
    for s in settings:
        if "missing" in s:
            rows.append((s["name"], *(["missing"] * 5), "missing: " + s["missing"]))
            continue
        rows.append((s["name"], s["bleu1"], s["bleu2"], s["bleu3"], s["bleu4"], f"{s['sacrebleu']['bleu']:.2f}",
                     f"{s['tokens_per_s']:.0f}"))
    return rows


def _part_ok(doc: Doc, part, name: str, what: str) -> bool:
    if part is None:
        doc.lack(f"{name}.json ({what}: this part has not run)")
        return False
    if part.get("error"):
        doc.lack(f"{what}: the part failed: {part['error']}")
        return False
    return True


def _section_bleu(doc: Doc, run: Path, bleu, ev):
    doc.h("BLEU and perplexity")
    if not _part_ok(doc, bleu, "bleu", "the BLEU protocol"):
        return
    pr = bleu["protocol"]
    doc.p(f"{bleu['samples']} validation stories (of {bleu['requested']} requested), prompt = their first "
          f"{pr['prompt_tokens']} tokens, continuation = the next tokens up to {pr['max_continuation']}; seed {pr['seed']}. "
          f"BLEU-1..4: cumulative, uniform weights, NLTK-style corpus BLEU with smoothing `{pr['smoothing']}` "
          f"(SmoothingFunction().method1: zero counts become 0.1) on tokens `{bleu['bleu_tokenization']}`. "
          f"sacreBLEU: 0-100, signature `{(bleu['settings'] or [{}])[0].get('sacrebleu', {}).get('signature', 'missing')}`.")
    doc.p(bleu["meaning"])
    for note in bleu.get("notes", []):
        doc.p(f"**note:** {note}")
    doc.table(["temperature", "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "sacreBLEU", "tokens/s"], _bleu_rows(bleu["settings"]))
    valid = (ev or {}).get("eval", {}).get("valid", {})
    doc.table(["perplexity", "value", "meaning"], [
        ("validation token ppl", valid.get("token_ppl"), "every validation story, from <sos>"),
        ("validation word ppl", valid.get("word_ppl"), "same NLL per whitespace word"),
        ("reference continuation ppl", bleu["reference_ppl"],
         f"the {bleu['reference_tokens']:,} real continuation tokens given their prompts (not the model's own samples)"),
        ("mean per-sample ppl", bleu["mean_per_sample_ppl"], "mean of the CSV's per_sample_ppl column")])
    files = ", ".join(f"`{s['csv']}`" for s in bleu["settings"] if s.get("csv"))
    doc.p(f"Per-sample CSVs (prompt, reference_continuation, hypothesis_continuation, per_sample_ppl): {files}")


def _section_samples(doc: Doc, samples, run_samples, experiments: bool = False):
    doc.h("Example generations" if experiments else "Samples")
    if samples and not samples.get("error"):
        doc.p(f"top-k {samples['top_k']}, top-p {samples['top_p']}, at most {samples['max_new_tokens']} new tokens.")
        for s in samples["samples"]:
            doc.p(f"**T={s['temperature']}**, prompt `{s['prompt']}`")
            doc.code(s.get("text") or f"{s['prompt_as_tokenized']} {s['continuation']}".strip())
        return
    if experiments:
        doc.lack("generations.json (example generations at several temperatures)")
    if run_samples:
        for s in run_samples:
            doc.p(f"**{s['prompt']}**")
            doc.code(f"{s['prompt']}{s['continuation']}")
    elif not experiments:
        doc.lack("samples.json (samples)")


def _section_decoding(doc: Doc, dec):
    doc.h("Decoding comparison")
    if not _part_ok(doc, dec, "decoding", "the decoding comparison"):
        return
    doc.p(f"The same {dec['samples']} prompts; BLEU as above; tokens/s = new tokens / generation time, "
          f"torch threads: {dec.get('threads')}, one prompt at a time.")
    rows = []
    for s, base in zip(dec["settings"], _bleu_rows(dec["settings"])):
        rows.append((*base, f"{s['speed_vs_sampling']:.2f}x" if "speed_vs_sampling" in s else "missing"))
    doc.table(["decoding", "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "sacreBLEU", "tokens/s", "speed vs sampling"], rows)
    for s in dec["settings"]:
        if "missing" in s:
            doc.missing.append(f"decoding {s['name']}: {s['missing']}")


def _section_kv(doc: Doc, kv):
    doc.h("KV cache")
    if not _part_ok(doc, kv, "kv_cache", "the KV-cache timing"):
        return
    doc.p(f"Greedy decoding, torch threads: {kv['threads']}, median of {kv['repeats']} alternated runs (cache, no cache, ...); "
          f"context {kv['context_length']}. Past the context the two paths slide differently (the cache is "
          "re-filled with the last half context, the uncached path keeps the last full context), so their tokens "
          "may differ there.")
    doc.table(["prompt", "new tokens", "with cache tok/s", "without tok/s", "speed-up", "same tokens", "beyond context"],
              [(r["prompt_tokens"], r["new_tokens"], f"{r['cache_tokens_per_s']:.0f}", f"{r['nocache_tokens_per_s']:.0f}",
                f"{r['speedup']:.2f}x", r["same_tokens"], r["beyond_context"]) for r in kv["rows"]])


def _each(row) -> str:
    return ", ".join(f"{x:.1f}" for x in row.get("seconds_each", [row["seconds"]]))


def _section_accum(doc: Doc, acc):
    doc.h("Gradient accumulation")
    if not _part_ok(doc, acc, "accumulation", "the accumulation runs"):
        return
    r0 = acc["rows"][0] if acc["rows"] else {}
    doc.p(f"Each run trains a fresh model on the same {r0.get('micro_batches')} micro-batches of {r0.get('micro_batch')} "
          f"sequences (torch threads: {acc['threads']}; seconds and tokens/s: median of {acc.get('repeats', 1)} runs in "
          "alternated rounds, training steps only); accumulation k makes "
          f"{r0.get('micro_batches')}/k optimizer steps of an "
          "effective batch k times larger. Epoch time is projected from the measured time per micro-batch. Activation "
          "memory is per micro-batch (bytes autograd saves), so accumulation does not change it.")
    doc.table(["accumulation", "effective batch", "steps", "final train loss", "final valid loss", "seconds",
               "each run (s)", "tokens/s", "projected s / epoch", "peak activation memory"],
              [(r["accum_steps"], r["effective_batch"], r["optimizer_steps"], r["final_train_loss"], r["final_val_loss"],
                f"{r['seconds']:.1f}", _each(r), f"{r['tokens_per_s']:.0f}", f"{r['projected_epoch_seconds']:.0f}",
                _mib(r["peak_activation_bytes"])) for r in acc["rows"]])
    if acc.get("missing"):
        doc.lack(acc["missing"])


def _section_ckpt(doc: Doc, ck):
    doc.h("Gradient checkpointing")
    if not _part_ok(doc, ck, "checkpointing", "the checkpointing runs"):
        return
    if ck.get("missing"):
        doc.lack(ck["missing"])
        doc.table(["run", "peak activation memory"], [(r["name"], _mib(r["peak_activation_bytes"])) for r in ck["rows"]])
        return
    doc.p(f"Plain vs `{ck['impl']}` checkpointing (every block recomputed in backward), the same micro-batches, "
          f"torch threads: {ck['threads']}, median of {ck.get('repeats', 1)} runs each in alternated rounds. Memory: peak bytes autograd holds for backward "
          "in one micro-batch step.")
    doc.table(["run", "peak activation memory", "memory vs plain", "seconds", "each run (s)", "time vs plain",
               "tokens/s", "final train loss"],
              [(r["name"], _mib(r["peak_activation_bytes"]),
                f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "missing", f"{r['seconds']:.1f}", _each(r),
                f"{r['time_ratio']:.2f}", f"{r['tokens_per_s']:.0f}", r["final_train_loss"]) for r in ck["rows"]])


def _section_attention(doc: Doc, run: Path, att):
    doc.h("Attention maps")
    if not _part_ok(doc, att, "attention", "the attention maps"):
        return
    for i, t in enumerate(att["texts"]):
        if "missing" in t:
            doc.lack(f"attention map for `{t['text']}`: {t['missing']}")
            continue
        doc.p(f"`{t['text']}`: {t['layers']} layers x {t['heads']} heads; rows sum to 1 within "
              f"{t['max_row_sum_error']:.1e}, largest weight above the diagonal {t['max_weight_above_diagonal']:.1e}. "
              f"Browse every layer and head: [{t['html']}]({t['html']})")
        for png in t["pngs"]:
            if (run / png).is_file():
                doc.img(run / png, png)
            else:
                doc.lack(f"{png}")


def _section_machine(doc: Doc, machine):
    doc.h("Machine")
    if machine and not machine.get("error"):
        doc.table(["", ""], [("CPU", machine["cpu"]), ("cores", machine["cpu_count"]), ("torch threads (training / decoding)",
                                                               f"{machine.get('train_threads', machine['torch_threads'])} / "
                                                               f"{machine.get('decode_threads', machine['torch_threads'])}"),
                             ("CUDA", machine["cuda"] or "no"), ("platform", machine["platform"]),
                             ("Python / torch", f"{machine['python']} / {machine['torch']}"),
                             ("load average (1 min) at the end", str(machine.get("load_average_1m"))),
                             ("date", machine["date_utc"])])
    else:
        doc.p(f"(no machine.json; the machine writing this report:) {platform.platform()}, Python "
              f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"CUDA {'yes' if torch.cuda.is_available() else 'no'}")


# ----------------------------------------------------------------------------------------- entry
def _safely(doc: Doc, section, *args, **kwargs) -> None:
    """A file of an unexpected shape (another tinylm version, a hand edit) makes its section
    missing, not the whole report."""
    try:
        section(doc, *args, **kwargs)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        doc.lack(f"{section.__name__[len('_section_'):]}: a file has an unexpected format ({type(exc).__name__}: {exc})")


def build_report(run_dir: str | Path) -> Doc:
    run = Path(run_dir)
    if not run.is_dir():
        raise TinyLMError(f"run directory {run} does not exist")
    present = [f for f in (*CORE_FILES, "prepare.json", "experiments.json") if (run / f).is_file()]
    if not present:
        raise TinyLMError(f"{run} is not a tinylm run directory (none of config.yaml, metrics.csv, eval.json, "
                          "prepare.json, experiments.json is in it)")
    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else None
    read = lambda name: _read_json(run / name)  # noqa: E731
    ev, prep, manifest = read("eval.json"), read("prepare.json"), read("experiments.json")
    baseline = read("baseline.json")
    doc = Doc()
    _safely(doc, _section_config, run, cfg, ev, baseline, prep)
    _safely(doc, _section_training, run, ev, want_curves=manifest is not None)
    _safely(doc, _section_eval, ev)
    if manifest is not None:
        _safely(doc, _section_bleu, run, read("bleu.json"), ev)
        _safely(doc, _section_samples, read("generations.json"), read("samples.json"), experiments=True)
        _safely(doc, _section_decoding, read("decoding.json"))
        _safely(doc, _section_kv, read("kv_cache.json"))
        _safely(doc, _section_accum, read("accumulation.json"))
        _safely(doc, _section_ckpt, read("checkpointing.json"))
        _safely(doc, _section_attention, run, read("attention.json"))
        _safely(doc, _section_machine, read("machine.json"))
    else:
        _safely(doc, _section_samples, None, read("samples.json"))
        _safely(doc, _section_machine, None)
    for part, status in ((manifest or {}).get("parts") or {}).items():
        if status == "stale":  # left alone by --only although its settings changed
            doc.missing.append(f"{part}.json is stale (computed with other settings; re-run without --only)")
    # the title and the completeness verdict go first, after every section has said what it lacks
    head = Doc()
    head.h(f"tinylm {'experiments' if manifest is not None else 'run'}: {run.name}", 1)
    if manifest and manifest.get("command"):
        head.p(f"Produced by `{manifest['command']}`{' (quick)' if manifest.get('quick') else ''}; "
               f"every number below is read from the files in this directory.")
    if doc.missing:
        head.p(f"**INCOMPLETE REPORT: {len(doc.missing)} part(s) missing**: " + "; ".join(doc.missing))
    doc.blocks = head.blocks + doc.blocks
    return doc


def write_report(run_dir: str | Path) -> tuple[Path, Path, list[str]]:
    """Write report.md and report.html; returns both paths and what the report lacks."""
    run = Path(run_dir)
    doc = build_report(run)
    md, page = run / "report.md", run / "report.html"
    md.write_text(render_markdown(doc, run), encoding="utf-8")
    page.write_text(render_html(doc, run, f"tinylm report: {run.name}"), encoding="utf-8")
    return md, page, doc.missing
