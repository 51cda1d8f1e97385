"""Rounds of `bench_serve.py` run apart (one JSON file per server, temperature and round, servers
alternated by the caller) gathered into the tables of docs/serving.md and a plot of tokens/s
against concurrent clients.

    python benchmarks/serve_rounds.py --series "LABEL=GLOB[@ENGINE]" [--series ...] --reference LABEL
                                      [--panel "TITLE=T" ...] [--plot out.png] [--title TEXT]

Each series is a label and the JSON files of its runs (a glob; ``@ENGINE`` picks the rows of one
engine, ``process`` or ``thread``, from files that hold both). With ``--panel TITLE=T`` (one per
knob setting, e.g. ``"greedy=0"``), ``{T}`` in every glob becomes T: a table and a plot panel
each. A row of the table per series and number of clients: every run's tokens/s, their median, the
median against the series' own one-client median and against the reference series' median at the
same number of clients, the medians of TTFT p50 and p95, and the errors summed. The plot draws
each series' medians with the range of its runs, and the first series' targets (16 clients at 5x
its one-client median, 32 at 7x: issue 41's).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path


def read_series(spec: str) -> tuple[str, dict[int, list[dict]]]:
    """``LABEL=GLOB[@ENGINE]`` -> (label, clients -> the rows of every run)."""
    label, _, pattern = spec.partition("=")
    pattern, _, engine = pattern.partition("@")
    files = sorted(glob.glob(pattern))
    if not label or not files:
        raise SystemExit(f"--series {spec!r}: a label and a glob matching bench_serve.py JSON files are needed")
    by_clients: dict[int, list[dict]] = {}
    for f in files:
        for row in json.loads(Path(f).read_text())["runs"]:
            if not engine or row["engine"] == engine:
                by_clients.setdefault(row["clients"], []).append(row)
    return label, by_clients


def table(series: dict[str, dict[int, list[dict]]], reference: str) -> str:
    ref = {c: statistics.median(r["tokens_per_s"] for r in rows) for c, rows in series[reference].items()}
    lines = [
        f"| server | clients | tokens/s (each run) | median | vs 1 client | vs {reference} "
        "| TTFT p50 / p95 ms | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for label, by_clients in series.items():
        one = statistics.median(r["tokens_per_s"] for r in by_clients.get(1, [])) if 1 in by_clients else None
        for clients, rows in sorted(by_clients.items()):
            tps = [r["tokens_per_s"] for r in rows]
            median = statistics.median(tps)
            ttft = (
                statistics.median(r["ttft_p50_ms"] for r in rows),
                statistics.median(r["ttft_p95_ms"] for r in rows),
            )
            lines.append(
                f"| {label} | {clients} | {', '.join(f'{t:.0f}' for t in tps)} | {median:.0f} | "
                + (f"{median / one:.2f}x" if one else "")
                + " | "
                + (f"{median / ref[clients]:.2f}x" if clients in ref else "")
                + f" | {ttft[0]:.1f} / {ttft[1]:.1f} | {sum(r['errors'] for r in rows)} |"
            )
    return "\n".join(lines)


TARGETS = {16: 5.0, 32: 7.0}  # clients -> tokens/s against one client's (issue 41)
STYLES = [("o", "-"), ("s", "--"), ("^", ":"), ("x", "-.")]


def plot(panels: dict[str, dict[str, dict[int, list[dict]]]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), dpi=110, sharey=True, squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        for k, (label, by_clients) in enumerate(series.items()):
            clients = sorted(by_clients)
            runs = [[r["tokens_per_s"] for r in by_clients[c]] for c in clients]
            marker, line = STYLES[k % len(STYLES)]
            (drawn,) = ax.plot(
                clients, [statistics.median(t) for t in runs], marker=marker, linestyle=line, label=label
            )
            ax.fill_between(
                clients, [min(t) for t in runs], [max(t) for t in runs], color=drawn.get_color(), alpha=0.15
            )
            if k == 0 and 1 in by_clients:
                one = statistics.median(r["tokens_per_s"] for r in by_clients[1])
                shown = [c for c in TARGETS if c in by_clients]
                ax.scatter(
                    shown,
                    [TARGETS[c] * one for c in shown],
                    marker="D",
                    facecolors="none",
                    edgecolors="k",
                    label=f"targets: {', '.join(f'{t:g}x' for t in TARGETS.values())} one client ({label})",
                    zorder=3,
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for s in series.values() for c in s}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens/s (median of runs; band: min-max)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--series", action="append", required=True, help="LABEL=GLOB[@ENGINE], in table order")
    p.add_argument("--reference", required=True, help="the label the other series are compared with")
    p.add_argument("--panel", action="append", help="TITLE=T: a table and a plot panel with {T} in the globs set to T")
    p.add_argument("--plot", help="write the plot here (PNG)")
    p.add_argument("--title", default="tinylm serve: tokens/s against concurrent clients")
    args = p.parse_args(argv)
    panels = {}
    for panel in args.panel or ["="]:
        name, _, value = panel.partition("=")
        panels[name] = dict(read_series(s.replace("{T}", value)) for s in args.series)
        if args.reference not in panels[name]:
            raise SystemExit(
                f"--reference {args.reference!r} is not one of the series' labels: {', '.join(panels[name])}"
            )
        print((f"{name}:\n\n" if name else "") + table(panels[name], args.reference) + "\n")
    if args.plot:
        plot(panels, args.plot, args.title)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
