"""Rounds of `bench_serve.py` run apart (one JSON file per server, temperature and round, servers
alternated by the caller) gathered into the tables of docs/serving.md and a plot of tokens/s
against concurrent clients.

    python benchmarks/serve_rounds.py --series "LABEL=GLOB[@ENGINE]" [--series ...] --reference LABEL
                                      [--plot out.png] [--title TEXT]

Each series is a label and the JSON files of its runs (a glob; ``@ENGINE`` picks the rows of one
engine, ``process`` or ``thread``, from files that hold both). A row of the table per series and
number of clients: every run's tokens/s, their median, the median against the series' own
one-client median and against the reference series' median at the same number of clients, the
medians of TTFT p50 and p95, and the errors summed. The plot draws each series' medians with the
range of its runs.
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


def plot(series: dict[str, dict[int, list[dict]]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, by_clients in series.items():
        clients = sorted(by_clients)
        runs = [[r["tokens_per_s"] for r in by_clients[c]] for c in clients]
        medians = [statistics.median(t) for t in runs]
        low = [m - min(t) for m, t in zip(medians, runs)]
        high = [max(t) - m for m, t in zip(medians, runs)]
        ax.errorbar(clients, medians, yerr=[low, high], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for s in series.values() for c in s}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("tokens/s (median; bars: the runs' range)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--series", action="append", required=True, help="LABEL=GLOB[@ENGINE], in table order")
    p.add_argument("--reference", required=True, help="the label the other series are compared with")
    p.add_argument("--plot", help="write the plot here (PNG)")
    p.add_argument("--title", default="tinylm serve: tokens/s against concurrent clients")
    args = p.parse_args(argv)
    series = dict(read_series(s) for s in args.series)
    if args.reference not in series:
        raise SystemExit(f"--reference {args.reference!r} is not one of the series' labels: {', '.join(series)}")
    print(table(series, args.reference))
    if args.plot:
        plot(series, args.plot, args.title)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
