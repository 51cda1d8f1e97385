"""Pictures: attention maps (PNG grid per layer, one self-contained HTML page) and training curves.

Attention weights come from ``GPT.forward(..., attention_out=list)``, which always runs the
hand-written attention (scores, causal mask, softmax) so the weights exist even for a model
configured with SDPA. Nothing here needs a server or a CDN: the HTML page carries its data and
its script inline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from jinja2 import Environment, PackageLoader

from tinylm.errors import TinyLMError
from tinylm.models.gpt import eval_mode
from tinylm.training.metrics import read_metrics

TEMPLATES = Environment(loader=PackageLoader("tinylm", "evaluation/templates"), autoescape=True)


def pyplot():
    """matplotlib's pyplot drawing into files only, never a window (imported when first drawn:
    matplotlib takes a second to import)."""
    import matplotlib  # deferred: see the docstring

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: see the docstring

    return plt


def save_figure(fig, path: str | Path, dpi: int = 100, tight: bool = True, **savefig) -> Path:
    """Write ``fig`` to ``path`` (its folder made), laid out tightly unless ``tight`` is False, and
    free it: pyplot keeps every open figure until it is closed."""
    if tight:
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, **savefig)
    pyplot().close(fig)
    return path


# ------------------------------------------------------------------------------------ attention
@dataclass
class AttentionMaps:
    text: str
    tokens: list[str]  # one label per position (``<sos>`` first)
    weights: list[np.ndarray]  # per layer, (heads, T, T); row i = where query i looks

    @property
    def n_layers(self) -> int:
        return len(self.weights)

    @property
    def n_heads(self) -> int:
        return self.weights[0].shape[0]


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    labels = []
    for i in ids:
        try:
            piece = tokenizer.id_to_piece(int(i))
        except (NotImplementedError, AttributeError, IndexError):
            piece = tokenizer.decode([int(i)])
        labels.append(piece.replace("\n", "\\n").replace("\u0120", " "))
    return labels


@torch.no_grad()
def attention_maps(model, tokenizer, text: str) -> AttentionMaps:
    """Per-layer attention weights of the start token + ``text`` (one forward pass, no gradients)."""
    ids = tokenizer.encode(text)
    if not ids:
        raise TinyLMError("the text for the attention map encodes to no tokens; give a non-empty --text")
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids
    context_length = model.config.context_length
    if len(ids) > context_length:
        raise TinyLMError(
            f"the text is {len(ids)} tokens with <sos>, longer than the model's context of "
            f"{context_length}; give a shorter --text"
        )
    return attention_maps_of_ids(model, tokenizer, ids, text)


@torch.no_grad()
def attention_maps_of_ids(model, tokenizer, ids: list[int], text: str = "") -> AttentionMaps:
    """Per-layer attention weights of token ids that fit in the context (one forward pass)."""
    device = next(model.parameters()).device
    with eval_mode(model):
        captured: list[torch.Tensor] = []
        model(torch.tensor([ids], device=device), attention_out=captured)
    weights = [w[0].float().cpu().numpy() for w in captured]  # (H, T, T) per layer
    return AttentionMaps(text, token_labels(tokenizer, ids), weights)


ATTENTION_PANELS_PER_ROW = 4
ATTENTION_PANEL_INCHES = 3.3  # a page column holds four panels: about 1,300 pixels wide at 100 dpi


def attention_title(maps: AttentionMaps, layer: int) -> str:
    return f"\u201c{maps.text}\u201d: layer {layer}" if maps.text else f"layer {layer}"


def plot_attention_layer(maps: AttentionMaps, layer: int, path: str | Path) -> Path:
    """One PNG: the layer's heads in rows of four, token labels on both axes, the masked (future)
    triangle drawn in grey so the causal structure is visible, the sentence in the title. The
    figure's width stays that of four panels whatever the number of heads, so it reads in a page."""
    plt = pyplot()
    w = maps.weights[layer]
    H, T, _ = w.shape
    cols = min(H, ATTENTION_PANELS_PER_ROW)
    rows = math.ceil(H / cols)
    side = ATTENTION_PANEL_INCHES
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols + 0.8, side * rows + 0.9), squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")  # masked (future) cells in grey
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    fontsize = 8 if T <= 16 else 6 if T <= 32 else 4
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        im = ax.imshow(np.ma.masked_array(w[h], mask=future), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(T), maps.tokens, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(T), maps.tokens, fontsize=fontsize)
        if h % cols == 0:
            ax.set_ylabel("query", fontsize=8)
        if h >= H - cols:
            ax.set_xlabel("key (attended to)", fontsize=8)
    fig.colorbar(im, ax=list(axes.flat), fraction=0.02, pad=0.01)
    fig.suptitle(attention_title(maps, layer), fontsize=11)
    return save_figure(fig, path, tight=False, bbox_inches="tight")


def save_attention_pngs(maps: AttentionMaps, out_dir: str | Path, prefix: str = "attention") -> list[Path]:
    return [
        plot_attention_layer(maps, layer, Path(out_dir) / f"{prefix}_layer{layer}.png")
        for layer in range(maps.n_layers)
    ]


def attention_html(maps: AttentionMaps, path: str | Path) -> Path:
    """One self-contained page (data and script inline) to browse every layer and head."""
    payload = {"tokens": maps.tokens, "weights": [np.round(w, 4).tolist() for w in maps.weights]}
    page = TEMPLATES.get_template("attention.html.j2").render(text=maps.text, data=payload)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------- curves
def plot_curves(metrics_csv: str | Path, path: str | Path, title: str = "") -> Path:
    """Loss (nats/token) and perplexity (log scale) against step, train and validation."""
    rows = read_metrics(metrics_csv)
    series = {key: [(r["step"], r[key]) for r in rows if r.get(key) is not None] for key in ("train_loss", "val_loss")}
    if not any(series.values()):
        raise TinyLMError(f"{metrics_csv} holds no loss values yet")
    plt = pyplot()
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"train_loss": ("train", "-", "tab:blue"), "val_loss": ("valid", "o-", "tab:orange")}
    for key, (label, style, color) in styles.items():
        if not series[key]:
            continue
        steps, values = zip(*series[key])
        ax_loss.plot(steps, values, style, color=color, label=label, markersize=3)
        ax_ppl.plot(steps, [math.exp(min(v, 50.0)) for v in values], style, color=color, label=label, markersize=3)
    ax_loss.set(xlabel="step", ylabel="loss (nats / token)", title="loss")
    ax_ppl.set(xlabel="step", ylabel="perplexity", title="perplexity", yscale="log")
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
