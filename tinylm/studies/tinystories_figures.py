"""The figures of `tinylm experiments` that the TinyStories reports show: accumulation loss curves,
checkpointing memory and time, the decoding comparison, and the embedding comparison. Each takes
the part's rows (and the trade-off runs' metrics.csv files) and writes one PNG."""

from __future__ import annotations

from pathlib import Path

from tinylm.evaluation.plots import pyplot, save_figure
from tinylm.training.metrics import read_metrics

MIB = 2**20


def _bar_labels(ax, bars, fmt: str) -> None:
    for bar in bars:
        ax.annotate(
            fmt.format(bar.get_height()),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )


def accumulation_curves(rows: list[dict], runs_dir: Path, path: str | Path) -> Path:
    """Training loss of every accumulation setting in its two comparisons: at equal tokens (every k
    trains the same epochs, against tokens seen) and at equal optimizer updates (k trains k times
    the data, against updates). A row that names no comparison appears in both."""
    plt = pyplot()
    fig, (ax_tokens, ax_steps) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {k: f"C{i}" for i, k in enumerate(sorted({r["accum_steps"] for r in rows}))}
    panels = ((ax_tokens, "tokens", {"equal tokens"}), (ax_steps, "step", {"equal updates"}))
    for row in rows:
        metrics = [
            m for m in read_metrics(runs_dir / row["run_dir"] / "metrics.csv") if m.get("train_loss") is not None
        ]
        epochs = f", {row['epochs']} epoch{'s' if row['epochs'] != 1 else ''}" if row.get("epochs") else ""
        label = f"k={row['accum_steps']} (batch {row['effective_batch']}, {row['optimizer_steps']} updates{epochs})"
        marker = "o-" if len(metrics) < 30 else "-"  # a run of few updates still shows its points
        for ax, x, wanted in panels:
            if row.get("comparison") in (*wanted, "both", "", None):
                ax.plot(
                    [m[x] for m in metrics],
                    [m["train_loss"] for m in metrics],
                    marker,
                    label=label,
                    markersize=3,
                    color=colors[row["accum_steps"]],
                    linewidth=1,
                )
    ax_tokens.set(xlabel="tokens seen", ylabel="training loss (nats / token)", title="equal tokens: the same epochs")
    ax_steps.set(
        xlabel="optimizer updates", ylabel="training loss (nats / token)", title="equal updates: k times the tokens"
    )
    for ax in (ax_tokens, ax_steps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    micro = rows[0]["micro_batch"] if rows else "?"
    fig.suptitle(f"Gradient accumulation: k micro-batches of {micro} stories per update")
    return save_figure(fig, path)


def checkpointing_bars(rows: list[dict], path: str | Path) -> Path:
    """Peak memory (activations saved for backward; CUDA peak when measured) and training time of
    plain training and of each checkpointing implementation."""
    plt = pyplot()
    cuda = all(r.get("cuda_peak_bytes") for r in rows)
    fig, axes = plt.subplots(1, 3 if cuda else 2, figsize=(13 if cuda else 9, 3.8))
    names = [(r.get("label") or r["name"]).replace(" ", "\n") for r in rows]
    colors = ["tab:gray", "tab:blue", "tab:green", "tab:orange"][: len(rows)]
    panels = [
        (
            [r["peak_activation_bytes"] / MIB for r in rows],
            "{:.3g}",
            "MiB",
            "activations saved for backward (one micro-batch)",
        ),
        ([r["seconds"] for r in rows], "{:.3g}", "seconds", f"training time, {rows[0]['micro_batches']} micro-batches"),
    ]
    if cuda:
        panels.append(
            ([r["cuda_peak_bytes"] / MIB for r in rows], "{:.0f}", "MiB", "CUDA peak memory (max_memory_allocated)")
        )
    for ax, (values, fmt, ylabel, title) in zip(axes, panels):
        _bar_labels(ax, ax.bar(names, values, color=colors), fmt)
        ax.set(ylabel=ylabel, title=title)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Gradient checkpointing: memory against time")
    return save_figure(fig, path)


def decoding_chart(settings: list[dict], path: str | Path) -> Path:
    """BLEU-1..4 and tokens/s of each decoding setting (sampling, greedy, beam k)."""
    plt = pyplot()
    fig, (ax_bleu, ax_speed) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    ok = [s for s in settings if "bleu4" in s]
    names = [s["name"] for s in ok]
    width = 0.8 / 4
    for n in range(1, 5):
        xs = [i + (n - 2.5) * width for i in range(len(ok))]
        ax_bleu.bar(xs, [s[f"bleu{n}"] for s in ok], width, label=f"BLEU-{n}")
    ax_bleu.set_xticks(range(len(ok)), names)
    top = max((s["bleu1"] for s in ok), default=1.0)
    ax_bleu.set(ylabel="BLEU (0-1)", title="BLEU against the real continuations", ylim=(0, 1.3 * top or 1.0))
    ax_bleu.legend(fontsize=8, ncols=4)
    _bar_labels(ax_speed, ax_speed.bar(names, [s["tokens_per_s"] for s in ok], color="tab:purple"), "{:.0f}")
    ax_speed.set(ylabel="new tokens / s", title="decoding speed (one prompt at a time)")
    for ax in (ax_bleu, ax_speed):
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8, labelrotation=25)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")  # long names side by side
    fig.suptitle("Decoding comparison")
    return save_figure(fig, path)


def embedding_curves(rows: list[dict], runs_dir: Path, path: str | Path) -> Path:
    """Training loss per step of each embedding initialisation, final validation loss in the legend."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for row in rows:
        metrics = [
            m for m in read_metrics(runs_dir / row["run_dir"] / "metrics.csv") if m.get("train_loss") is not None
        ]
        ax.plot(
            [m["step"] for m in metrics],
            [m["train_loss"] for m in metrics],
            label=f"{row.get('label') or row['name']} (valid {row['final_val_loss']:.3f})",
        )
    ax.set(
        xlabel="step",
        ylabel="training loss (nats / token)",
        title="Token embeddings: FastText frozen / fine-tuned vs random init, equal steps",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
