"""Pictures: attention maps (PNG grid per layer, one self-contained HTML page) and training curves.

Attention weights come from ``GPT.forward(..., attention_out=list)``, which always runs the
hand-written attention (scores, causal mask, softmax) so the weights exist even for a model
configured with SDPA. Nothing here needs a server or a CDN: the HTML page carries its data and
its script inline.
"""

from __future__ import annotations

import csv
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinylm.errors import TinyLMError
from tinylm.models.gpt import eval_mode


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


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
    ctx = model.config.context_length
    if len(ids) > ctx:
        raise TinyLMError(f"the text is {len(ids)} tokens with <sos>, longer than the model's context of {ctx}; "
                          "give a shorter --text")
    device = next(model.parameters()).device
    with eval_mode(model):
        captured: list[torch.Tensor] = []
        model(torch.tensor([ids], device=device), attention_out=captured)
    weights = [w[0].float().cpu().numpy() for w in captured]  # (H, T, T) per layer
    return AttentionMaps(text, token_labels(tokenizer, ids), weights)


def plot_attention_layer(maps: AttentionMaps, layer: int, path: str | Path) -> Path:
    """One PNG: the layer's heads side by side, token labels on both axes, the masked (future)
    triangle drawn in grey so the causal structure is visible."""
    plt = _pyplot()
    w = maps.weights[layer]
    H, T, _ = w.shape
    cell = max(0.18, min(0.45, 6.0 / T))
    side = max(2.5, cell * T + 1.2)
    fig, axes = plt.subplots(1, H, figsize=(side * H, side + 0.6), squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")  # masked (future) cells in grey
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    fontsize = 8 if T <= 24 else 6 if T <= 48 else 4
    for h in range(H):
        ax = axes[0, h]
        im = ax.imshow(np.ma.masked_array(w[h], mask=future), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"layer {layer} head {h}", fontsize=9)
        ax.set_xticks(range(T))
        ax.set_yticks(range(T))
        ax.set_xticklabels(maps.tokens, rotation=90, fontsize=fontsize)
        ax.set_yticklabels(maps.tokens, fontsize=fontsize)
        ax.set_xlabel("key (attended to)", fontsize=8)
        if h == 0:
            ax.set_ylabel("query", fontsize=8)
    fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.01)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def save_attention_pngs(maps: AttentionMaps, out_dir: str | Path, prefix: str = "attention") -> list[Path]:
    return [plot_attention_layer(maps, layer, Path(out_dir) / f"{prefix}_layer{layer}.png")
            for layer in range(maps.n_layers)]


_HTML_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>tinylm attention: __TITLE__</title>
<style>
body { font-family: sans-serif; margin: 1.5em; }
table.att { border-collapse: collapse; font-size: 11px; }
table.att td { width: 18px; height: 18px; padding: 0; border: 1px solid #fff; }
table.att td.future { background: #e6e6e6; }
table.att th { font-weight: normal; white-space: nowrap; padding: 0 4px; }
table.att thead th { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; }
#info { height: 1.4em; color: #333; }
</style></head><body>
<h1>Attention maps</h1>
<p>Text: <code>__TEXT__</code></p>
<p>Rows are queries, columns the keys they attend to; grey cells are the future (masked by the
causal triangle). Darker = more weight; each row sums to 1.</p>
<p>Layer <select id="layer"></select> Head <select id="head"></select></p>
<div id="info"></div>
<table class="att" id="grid"></table>
<script type="application/json" id="data">__DATA__</script>
<script>
(function () {
  var data = JSON.parse(document.getElementById("data").textContent);
  var layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
  var grid = document.getElementById("grid"), info = document.getElementById("info");
  function fill(sel, n) { for (var i = 0; i < n; i++) { var o = document.createElement("option"); o.value = i; o.textContent = i; sel.appendChild(o); } }
  fill(layerSel, data.weights.length); fill(headSel, data.weights[0].length);
  function draw() {
    var w = data.weights[+layerSel.value][+headSel.value], toks = data.tokens, T = toks.length;
    grid.innerHTML = "";
    var head = grid.createTHead().insertRow(); head.appendChild(document.createElement("th"));
    toks.forEach(function (t) { var th = document.createElement("th"); th.textContent = t; head.appendChild(th); });
    var body = grid.createTBody();
    for (var i = 0; i < T; i++) {
      var row = body.insertRow(), th = document.createElement("th"); th.textContent = toks[i]; row.appendChild(th);
      for (var j = 0; j < T; j++) {
        var td = row.insertCell();
        if (j > i) { td.className = "future"; continue; }
        var v = w[i][j]; td.style.background = "rgba(40, 60, 160, " + Math.min(1, v).toFixed(3) + ")";
        td.title = toks[i] + " -> " + toks[j] + ": " + v.toFixed(4);
        td.onmouseover = (function (s) { return function () { info.textContent = s; }; })(td.title);
      }
    }
  }
  layerSel.onchange = draw; headSel.onchange = draw; draw();
})();
</script></body></html>
"""


def attention_html(maps: AttentionMaps, path: str | Path) -> Path:
    """One self-contained page (data and script inline) to browse every layer and head."""
    payload = {"tokens": maps.tokens, "weights": [np.round(w, 4).tolist() for w in maps.weights]}
    data = json.dumps(payload).replace("</", "<\\/")  # a token such as "</script>" cannot end the block
    page = (_HTML_TEMPLATE.replace("__TITLE__", html.escape(maps.text[:60]))
            .replace("__TEXT__", html.escape(maps.text)).replace("__DATA__", data))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------- curves
def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of train loss and validation loss from a trainer's metrics.csv."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"no metrics file {path}: this run has not logged any training step")
    series: dict[str, list[tuple[int, float]]] = {"train_loss": [], "val_loss": []}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key in series:
                if row.get(key):
                    series[key].append((int(row["step"]), float(row[key])))
    if not series["train_loss"] and not series["val_loss"]:
        raise TinyLMError(f"{path} holds no loss values yet")
    return series


def plot_curves(metrics_csv: str | Path, path: str | Path, title: str = "") -> Path:
    """Loss (nats/token) and perplexity (log scale) against step, train and validation."""
    plt = _pyplot()
    series = read_metrics(metrics_csv)
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"train_loss": ("train", "-", "tab:blue"), "val_loss": ("valid", "o-", "tab:orange")}
    for key, (label, style, color) in styles.items():
        pts = series[key]
        if not pts:
            continue
        steps, values = zip(*pts)
        ax_loss.plot(steps, values, style, color=color, label=label, markersize=3)
        ax_ppl.plot(steps, [math.exp(min(v, 50.0)) for v in values], style, color=color, label=label, markersize=3)
    ax_loss.set(xlabel="step", ylabel="loss (nats / token)", title="loss")
    ax_ppl.set(xlabel="step", ylabel="perplexity", title="perplexity", yscale="log")
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
