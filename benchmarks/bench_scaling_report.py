"""Tables, plots and the docs page of benchmarks/bench_scaling.py, from its results (a dict, or the
JSON it writes): markdown tables per engine, one PNG per engine, and the rewrite of the
``<!-- scaling:NAME -->`` blocks of docs/scaling.md."""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path

ENGINES = ("training", "decoding", "serve", "bpe", "ngram")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y on log x: the exponent k of y ~ x^k over the rows."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / var, 3) if var else None


# ------------------------------------------------------------------------------------ markdown
def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return (
        f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value)
    )


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def slopes_line(what: str, slopes: dict, names: dict) -> str:
    parts = [f"{names[k]} {v:+.2f}" for k, v in slopes.items() if v is not None and k in names]
    return f"Log-log slope of {what} (least squares over the rows): " + ", ".join(parts) + "." if parts else ""


def markdown_training(res: dict) -> list[str]:
    s = res["setup"]
    lines = [
        f"{s['layers']} layers, context {s['context']}, vocab {s['vocab']}, batch {s['batch']} x {s['context']} "
        f"tokens, {s['steps']} AdamW steps per system and round, {s['rounds']} round(s), fp32; data: {s['data']}.",
        "",
    ]
    lines += table(
        [
            "d_model",
            "heads",
            "parameters",
            "tinylm tok/s",
            "HF GPT-2 tok/s",
            "tinylm / HF",
            "held-out loss tinylm",
            "held-out loss HF",
        ],
        [
            [
                r["d_model"],
                r["heads"],
                fmt(r["parameters"]),
                fmt(r["tinylm_tokens_per_s"], 0),
                fmt(r["hf_tokens_per_s"], 0),
                f"{r['vs_hf']:.2f}x",
                f"{r['tinylm_loss']:.4f}",
                f"{r['hf_loss']:.4f}",
            ]
            for r in res["rows"]
        ],
    )
    return lines + ["", slopes_line("tokens/s against d_model", res["slopes"], {"tinylm": "tinylm", "hf": "HF GPT-2"})]


def markdown_decoding(res: dict) -> list[str]:
    s, by = res["setup"], {(r["context"], r["cache"]): r for r in res["rows"]}
    contexts = sorted({r["context"] for r in res["rows"]})
    new = {c: max((r["new_tokens"] for r in res["rows"] if r["cache"] == c), default="-") for c in (True, False)}
    lines = [
        f"{s['layers']} layers, d_model {s['d_model']}, vocab {s['vocab']}, batch 1, greedy; a prompt of L - n "
        f"random tokens, then n = min({new[True]}, L/2) new tokens with the cache and min({new[False]}, L/2) "
        f"without; rate = (n - 1) / (t(n) - t(1)), the prompt's prefill left out.",
        "",
    ]
    rows = []
    for L in contexts:
        c, n = by.get((L, True), {}), by.get((L, False), {})
        speedup = c["tinylm_tokens_per_s"] / n["tinylm_tokens_per_s"] if c and n else None
        rows.append(
            [
                L,
                fmt(c.get("tinylm_tokens_per_s")),
                fmt(c.get("hf_tokens_per_s")),
                f"{c['vs_hf']:.2f}x" if c else "-",
                fmt(n.get("tinylm_tokens_per_s")),
                fmt(n.get("hf_tokens_per_s")),
                f"{n['vs_hf']:.2f}x" if n else "-",
                f"{speedup:.1f}x" if speedup else "-",
                all(r.get("same_tokens", True) for r in (c, n)),
            ]
        )
    lines += table(
        [
            "context",
            "tinylm cached tok/s",
            "HF cached tok/s",
            "tinylm / HF",
            "tinylm no-cache tok/s",
            "HF no-cache tok/s",
            "tinylm / HF",
            "cache speed-up (tinylm)",
            "same tokens",
        ],
        rows,
    )
    return lines + [
        "",
        slopes_line(
            "tokens/s against the context",
            res["slopes"],
            {
                "tinylm_cache": "tinylm cached",
                "hf_cache": "HF cached",
                "tinylm_nocache": "tinylm without cache",
                "hf_nocache": "HF without cache",
            },
        ),
    ]


def markdown_serve(res: dict) -> list[str]:
    s = res["setup"]
    lines = [
        f"`tinylm serve` on {s['checkpoint']} ({s['model']}, {s['parameters']:,} parameters), "
        f"{s['server_threads']} torch thread(s), streaming completions of "
        f"{s['max_tokens']} tokens ({s['sampling']}). No reference server: the 1-client level is the baseline.",
        "",
    ]
    lines += table(
        ["clients", "requests", "errors", "tokens/s", "vs 1 client", "TTFT p50 ms", "TTFT p95 ms", "per-token p50 ms"],
        [
            [
                r["clients"],
                r["requests"],
                r["errors"],
                fmt(r["tokens_per_s"]),
                f"{r['vs_1_client']:.2f}x",
                fmt(r["ttft_p50_ms"]),
                fmt(r["ttft_p95_ms"]),
                fmt(r["per_token_p50_ms"], 2),
            ]
            for r in res["rows"]
        ],
    )
    return lines + ["", slopes_line("tokens/s against clients", res["slopes"], {"tinylm": "tinylm serve"})]


def markdown_bpe(res: dict) -> list[str]:
    s, rep = res["setup"], res["repetition"]
    lines = [
        f"Vocab {s['vocab']}; corpus {s['corpus']} ({s['distinct_bytes'] / 1e6:.1f} MB distinct, repeated above "
        f"that); HF `tokenizers` with {s['hf_threads']} thread(s), tinylm single-threaded Python.",
        "",
    ]
    lines += table(
        ["MB", "distinct MB", "tinylm s", "HF tokenizers s", "tinylm / HF time", "tinylm MB/s", "HF MB/s"],
        [
            [
                fmt(r["bytes"] / 1e6),
                fmt(r["distinct_bytes"] / 1e6),
                fmt(r["tinylm_seconds"], 2),
                fmt(r["hf_seconds"], 2),
                f"{r['vs_hf']:.2f}x",
                fmt(r["bytes"] / 1e6 / r["tinylm_seconds"], 2),
                fmt(r["bytes"] / 1e6 / r["hf_seconds"], 2),
            ]
            for r in res["rows"]
        ],
    )
    return lines + [
        "",
        slopes_line("seconds against bytes", res["slopes"], {"tinylm": "tinylm", "hf": "HF tokenizers"}),
        "",
        f"Repetition: {rep['bytes'] / 1e6:.2f} MB made of {rep['distinct_bytes'] / 1e6:.2f} MB repeated "
        f"twice takes {rep['tinylm_vs_distinct']:.2f}x the time of {rep['bytes'] / 1e6:.2f} MB of distinct "
        f"text for tinylm ({rep['tinylm_seconds']:.2f} s) and {rep['hf_vs_distinct']:.2f}x for HF "
        f"({rep['hf_seconds']:.2f} s).",
    ]


def markdown_ngram(res: dict) -> list[str]:
    s = res["setup"]
    lines = [
        f"Order {s['order']} Kneser-Ney, {s['corpus']} in BPE tokens ({s['merges']} merges, V = {s['vocab']}); "
        f"KenLM: {s['kenlm']}.",
        "",
    ]
    lines += table(
        [
            "tokens",
            "tinylm s",
            "NLTK s",
            "KenLM lmplz s",
            "tinylm tok/s",
            "NLTK tok/s",
            "tinylm speed / NLTK",
            "same top-10 trigram counts",
        ],
        [
            [
                fmt(r["tokens"]),
                fmt(r["tinylm_seconds"], 3),
                fmt(r["nltk_seconds"], 2),
                fmt(r["kenlm_seconds"], 2),
                fmt(r["tinylm_tokens_per_s"]),
                fmt(r["nltk_tokens_per_s"]),
                f"{r['vs_nltk']:.1f}x",
                r["same_top_trigram_counts"],
            ]
            for r in res["rows"]
        ],
    )
    return lines + [
        "",
        slopes_line(
            "seconds against tokens", res["slopes"], {"tinylm": "tinylm", "nltk": "NLTK", "kenlm": "KenLM lmplz"}
        ),
    ]


MARKDOWN = {
    "training": markdown_training,
    "decoding": markdown_decoding,
    "serve": markdown_serve,
    "bpe": markdown_bpe,
    "ngram": markdown_ngram,
}


def markdown_machine(report: dict) -> list[str]:
    m = report["machine"]
    took = ", ".join(f"{e} {s:.0f} s" for e, s in report.get("engine_seconds", {}).items())
    return [
        f"Measured on {m['cpu_model']} ({m['cpu_count']} CPUs), {report['threads']} torch thread(s), "
        f"torch {m['torch']}, Python {m['python']}, {report['date']}"
        + (", --quick sizes" if report["quick"] else "")
        + (f"; {took}." if took else ".")
    ]


def markdown_blocks(report: dict) -> dict[str, list[str]]:
    blocks = {"machine": markdown_machine(report)}
    blocks.update({e: MARKDOWN[e](report["engines"][e]) for e in ENGINES if e in report["engines"]})
    return blocks


def rewrite_page(page: Path, blocks: dict[str, list[str]]) -> None:
    """Replace the text between <!-- scaling:NAME --> and <!-- /scaling:NAME --> for each block."""
    text = page.read_text(encoding="utf-8")
    for name, lines in blocks.items():
        pattern = re.compile(rf"(<!-- scaling:{name} -->\n).*?(<!-- /scaling:{name} -->)", re.S)
        if not pattern.search(text):
            log(f"  {page}: no <!-- scaling:{name} --> block, left out")
            continue
        text = pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), text)
    page.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------- plots
COLORS = {"tinylm": "tab:blue", "reference": "tab:orange", "kenlm": "tab:green"}


def short_number(v: float) -> str:
    """Axis labels: 2,048 and 0.05 as written, 10k and 1.63M from 10,000 up (no 10^k)."""
    if v >= 1e6:
        return f"{v / 1e6:.3g}M"
    if v >= 1e4:
        return f"{v / 1e3:.3g}k"
    return f"{v:,.0f}" if v >= 1 else f"{v:g}"


def line_plot(
    path: Path, title: str, xlabel: str, ylabel: str, series: list[tuple], mark: tuple[float, str] | None = None
) -> None:
    """One PNG of 800 x 450 pixels, log-log axes: each series is (label, xs, ys, matplotlib style,
    colour key); tinylm in one colour, the reference in another; ``mark``: a labelled vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    xs_all = sorted({x for _, xs, _, _, _ in series for x in xs})
    for label, xs, ys, style, color in series:
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and not (isinstance(y, float) and math.isnan(y))]
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], style, label=label, color=COLORS[color], linewidth=2, markersize=6
        )
    if mark:
        ax.axvline(mark[0], color="grey", linestyle=":", linewidth=1.5, label=mark[1])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(xs_all))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: short_number(v)))
    low, high = ax.get_ylim()
    decades = math.log10(high / low)  # ticks at 1, 2, 5 x 10^k when they fit, fewer when they would crowd
    if decades <= 1:  # within one decade: evenly spaced round numbers
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.yaxis.set_minor_locator(NullLocator())
    else:
        subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0, 3.0) if decades <= 4 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: short_number(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_report(report: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    engines, written = report["engines"], []

    def col(rows, key):
        return [r[key] for r in rows]

    if "training" in engines:
        rows = engines["training"]["rows"]
        xs = col(rows, "d_model")
        written.append(folder / "scaling-training.png")
        line_plot(
            written[-1],
            "Training throughput against model width (6 layers, context 256)",
            "d_model",
            "training tokens/s",
            [
                ("tinylm", xs, col(rows, "tinylm_tokens_per_s"), "o-", "tinylm"),
                ("HF GPT-2 (reference)", xs, col(rows, "hf_tokens_per_s"), "s--", "reference"),
            ],
        )
    if "decoding" in engines:
        rows = engines["decoding"]["rows"]
        series = []
        for cache, tag, style in ((True, "cached", "-"), (False, "no cache", ":")):
            part = [r for r in rows if r["cache"] == cache]
            series += [
                (f"tinylm, {tag}", col(part, "context"), col(part, "tinylm_tokens_per_s"), "o" + style, "tinylm"),
                (
                    f"HF generate, {tag} (reference)",
                    col(part, "context"),
                    col(part, "hf_tokens_per_s"),
                    "s" + style,
                    "reference",
                ),
            ]
        written.append(folder / "scaling-decoding.png")
        line_plot(
            written[-1],
            "Greedy decoding at batch 1 against the context length",
            "context length (tokens)",
            "decoding tokens/s",
            series,
        )
    if "serve" in engines:
        rows = engines["serve"]["rows"]
        written.append(folder / "scaling-serve.png")
        line_plot(
            written[-1],
            "tinylm serve: streamed tokens/s against concurrent clients (no reference server)",
            "concurrent clients",
            "aggregate tokens/s",
            [("tinylm serve", col(rows, "clients"), col(rows, "tokens_per_s"), "o-", "tinylm")],
        )
    if "bpe" in engines:
        rows = engines["bpe"]["rows"]
        xs = [r["bytes"] / 1e6 for r in rows]
        written.append(folder / "scaling-bpe.png")
        line_plot(
            written[-1],
            f"BPE training time against corpus size (vocab {engines['bpe']['setup']['vocab']})",
            "corpus size (MB)",
            "training seconds",
            [
                ("tinylm", xs, col(rows, "tinylm_seconds"), "o-", "tinylm"),
                ("HF tokenizers (reference)", xs, col(rows, "hf_seconds"), "s--", "reference"),
            ],
            mark=(engines["bpe"]["setup"]["distinct_bytes"] / 1e6, "distinct text ends (repeated beyond)"),
        )
    if "ngram" in engines:
        rows = engines["ngram"]["rows"]
        xs = col(rows, "tokens")
        series = [
            ("tinylm", xs, col(rows, "tinylm_seconds"), "o-", "tinylm"),
            ("NLTK (reference)", xs, col(rows, "nltk_seconds"), "s--", "reference"),
        ]
        if any(r["kenlm_seconds"] for r in rows):
            series.append(("KenLM lmplz (reference)", xs, col(rows, "kenlm_seconds"), "^-.", "kenlm"))
        written.append(folder / "scaling-ngram.png")
        line_plot(
            written[-1],
            "Counting a Kneser-Ney trigram model against training tokens",
            "training tokens",
            "seconds",
            series,
        )
    return written
