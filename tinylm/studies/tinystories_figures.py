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


def _train_losses(runs_dir: Path, row: dict) -> list[dict]:
    return [m for m in read_metrics(runs_dir / row["run_dir"] / "metrics.csv") if m.get("train_loss") is not None]


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start): one
    micro-batch's loss is too noisy to tell close curves apart."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def accumulation_curves(rows: list[dict], runs_dir: Path, path: str | Path, start: dict | None = None) -> Path:
    """Training loss of every accumulation setting in its two comparisons: at equal tokens (every k
    trains the same epochs, against tokens seen) and at equal optimizer updates (every k makes the
    largest k's updates, against updates). A row that names no comparison appears in both; runs
    continued from a trained model show the validation loss they started from."""
    plt = pyplot()
    fig, (ax_tokens, ax_steps) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {k: f"C{i}" for i, k in enumerate(sorted({r["accum_steps"] for r in rows}))}
    panels = ((ax_tokens, "tokens", {"equal tokens"}), (ax_steps, "step", {"equal updates"}))
    for row in rows:
        metrics = _train_losses(runs_dir, row)
        window = max(1, len(metrics) // 25)
        n = row.get("epochs")
        epochs = f", {n:g} epoch{'' if n == 1 else 's'}" if n else ""
        valid = f"; valid {row['final_val_loss']:.3f}" if row.get("final_val_loss") is not None else ""
        label = (
            f"k={row['accum_steps']} (batch {row['effective_batch']}, {row['optimizer_steps']} updates{epochs}{valid})"
        )
        marker = "o-" if len(metrics) < 30 else "-"  # a run of few updates still shows its points
        for ax, x, wanted in panels:
            if row.get("comparison") in (*wanted, "both", "", None):
                ax.plot(
                    [m[x] for m in metrics],
                    moving_average([m["train_loss"] for m in metrics], window),
                    marker,
                    label=label,
                    markersize=3,
                    color=colors[row["accum_steps"]],
                    linewidth=1,
                )
    k_max = max(colors) if colors else "k"
    smoothed = "training loss (nats / token, moving mean)"
    ax_tokens.set(xlabel="tokens seen (thousands)", ylabel=smoothed, title="equal tokens: the same epochs")
    ax_tokens.xaxis.set_major_formatter(lambda x, _: f"{x / 1e3:g}")
    ax_steps.set(xlabel="optimizer updates", ylabel=smoothed, title=f"equal updates: k / {k_max} of the tokens")
    for ax in (ax_tokens, ax_steps):
        if start and start.get("val_loss") is not None:
            ax.axhline(start["val_loss"], color="gray", linestyle="--", linewidth=1, label="valid loss at the start")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    micro = rows[0]["micro_batch"] if rows else "?"
    where = " (continued from the trained model)" if start and start.get("val_loss") is not None else ""
    fig.suptitle(f"Gradient accumulation: k micro-batches of {micro} rows per update{where}")
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
        (
            [r["seconds"] for r in rows],
            "{:.3g}",
            "seconds",
            f"training time, {rows[0]['micro_batches']} micro-batches a run",
        ),
    ]
    if cuda:
        panels.append(
            ([r["cuda_peak_bytes"] / MIB for r in rows], "{:.0f}", "MiB", "CUDA peak memory (max_memory_allocated)")
        )
    for ax, (values, fmt, ylabel, title) in zip(axes, panels):
        _bar_labels(ax, ax.bar(names, values, color=colors), fmt)
        ax.set(ylabel=ylabel, title=title)
    for i, row in enumerate(rows):  # every timed run beside its median: the spread the ratio sits in
        each = row.get("seconds_each") or []
        axes[1].plot([i + 0.3] * len(each), each, "k.", markersize=5, label="each run" if i == 0 else None)
    if any(len(r.get("seconds_each") or []) > 1 for r in rows):
        axes[1].legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Gradient checkpointing: memory against time (bars: medians)")
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
    """Training loss per step of each embedding initialisation (moving mean, final validation loss
    in the legend), and each run's loss minus the first run's, where curves that lie on top of
    each other in the left panel come apart."""
    plt = pyplot()
    fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(12, 4))
    styles = ["-", "--", ":", "-."]
    losses = {}
    for i, row in enumerate(rows):
        metrics = _train_losses(runs_dir, row)
        window = max(1, len(metrics) // 25)
        steps = [m["step"] for m in metrics]
        losses[row["name"]] = (steps, moving_average([m["train_loss"] for m in metrics], window))
        ax.plot(
            *losses[row["name"]],
            styles[i % len(styles)],
            color=f"C{i}",
            linewidth=1.5,
            label=f"{row.get('label') or row['name']} (valid {row['final_val_loss']:.3f})",
        )
    first = rows[0] if rows else None
    for i, row in enumerate(rows):
        steps, values = losses[row["name"]]
        base = dict(zip(*losses[first["name"]]))
        pairs = [(s, v - base[s]) for s, v in zip(steps, values) if s in base]
        ax_gap.plot(
            [s for s, _ in pairs],
            [d for _, d in pairs],
            styles[i % len(styles)],
            color=f"C{i}",
            linewidth=1.5,
            label=row.get("label") or row["name"],
        )
    ax.set(xlabel="step", ylabel="training loss (nats / token, moving mean)", title="training loss, equal steps")
    name = (first.get("label") or first["name"]) if first else ""
    ax_gap.set(xlabel="step", ylabel="difference (nats / token)", title=f"each run's loss minus {name}'s")
    for a in (ax, ax_gap):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("Token embeddings: FastText frozen / fine-tuned vs random init")
    return save_figure(fig, path)
