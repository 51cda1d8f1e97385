"""Attention maps (weights, PNG grid, self-contained HTML, CLI) and training curves."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import make_stories

from tinylm.cli import main
from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.evaluation.plots import attention_html, attention_maps, plot_curves, save_attention_pngs
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.tokenizers import WordTokenizer
from tinylm.training.metrics import read_metrics

TEXT = "Tom had a red ball. He threw the ball to his dog."


@pytest.fixture
def model_and_tokenizer():
    tok = WordTokenizer(lowercase=True).train(make_stories(30), 120)
    model = GPT(
        ModelConfig(
            vocab_size=tok.vocab_size,
            context_length=24,
            d_model=32,
            n_layers=2,
            n_heads=4,
            attention="sdpa",
            positions="rope",
        )
    )
    return model.eval(), tok


def test_attention_rows_sum_to_one_and_nothing_above_the_diagonal(model_and_tokenizer):
    model, tok = model_and_tokenizer
    maps = attention_maps(model, tok, TEXT)
    T = len(tok.encode(TEXT)) + 1
    assert maps.tokens[0] == "<sos>" and len(maps.tokens) == T and maps.tokens[1] == "tom"
    assert len(maps.weights) == 2
    for w in maps.weights:
        assert w.shape == (4, T, T)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        assert np.all(np.triu(w, k=1) == 0.0)
        assert np.all(np.diagonal(w, axis1=1, axis2=2) > 0)
        assert w[:, 0, 0] == pytest.approx(1.0)  # the first token can only look at itself


def test_weights_come_from_the_same_computation_as_sdpa(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = torch.tensor([[2, *tok.encode(TEXT)]])
    captured = []
    with torch.no_grad():
        with_weights, _ = model(ids, attention_out=captured)
        sdpa, _ = model(ids)  # the SDPA path, which returns no weights
    torch.testing.assert_close(with_weights, sdpa, atol=1e-5, rtol=1e-5)
    assert len(captured) == 2 and captured[0].shape[1] == 4


def test_kv_cache_path_returns_the_same_rows(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = torch.tensor([[2, *tok.encode(TEXT)]])
    T, split = ids.shape[1], 5
    full = []
    with torch.no_grad():
        model(ids, attention_out=full)
        cache = model.new_kv_cache(1)
        model(ids[:, :split], kv_cache=cache)
        tail = []
        model(ids[:, split:], kv_cache=cache, attention_out=tail)
    for f, t in zip(full, tail):
        assert t.shape == (1, 4, T - split, T)  # (B, H, new tokens, keys cached + new)
        torch.testing.assert_close(t, f[:, :, split:, :], atol=1e-5, rtol=1e-5)


def test_text_longer_than_the_context_is_a_clear_error(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(TinyLMError, match="longer than the model's context of 24"):
        attention_maps(model, tok, " ".join(["the dog ran"] * 10))
    with pytest.raises(TinyLMError, match="no tokens"):
        attention_maps(model, tok, "   ")


@pytest.mark.slow  # draws a PNG per head
def test_png_grid_and_self_contained_html(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    maps = attention_maps(model, tok, TEXT)
    maps.tokens[3] = "</script><b>"  # a hostile label must not break out of the page's data block
    pngs = save_attention_pngs(maps, tmp_path)
    assert [p.name for p in pngs] == ["attention_layer0.png", "attention_layer1.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in pngs)
    page = attention_html(maps, tmp_path / "a.html").read_text()
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", page)  # no CDN, no remote anything
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1))
    assert data["tokens"][3] == "</script><b>"
    maps.text = "a <b>bold</b> & plain text"
    page = attention_html(maps, tmp_path / "b.html").read_text()
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; plain text" in page and "<b>bold" not in page  # autoescaped
    w = np.array(data["weights"][1][2])  # layer 1, head 2
    np.testing.assert_allclose(w, maps.weights[1][2], atol=1e-4)


@pytest.mark.slow  # draws a PNG
def test_eight_heads_fit_a_page_and_the_sentence_is_the_title(tmp_path):
    from matplotlib import image

    from tinylm.evaluation.plots import AttentionMaps, attention_title, plot_attention_layer

    words = "there was a brave explorer he wanted to explore".split()
    rng = np.random.default_rng(0)
    w = np.tril(rng.random((8, 10, 10)))
    maps = AttentionMaps(" ".join(words), ["<sos>", *words], [w / w.sum(-1, keepdims=True)])
    png = plot_attention_layer(maps, 0, tmp_path / "a.png")
    height, width = image.imread(png).shape[:2]
    assert 900 < width < 1500 and 500 < height < 1000  # two rows of four heads, not one 8-panel strip
    assert attention_title(maps, 0) == "\u201cthere was a brave explorer he wanted to explore\u201d: layer 0"


@pytest.mark.slow  # draws a PNG
def test_curves_from_metrics_csv(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text(
        "step,tokens,lr,train_loss,val_loss,val_ppl,tokens_per_s,elapsed_s\n"
        "10,100,1e-3,5.0,,,10,1\n20,200,1e-3,4.0,4.5,90.0,10,2\n30,300,1e-3,3.5,,,10,3\n"
        "40,400,1e-3,3.0,3.6,36.6,10,4\n"
    )
    rows = read_metrics(csv_path)
    assert [(r["step"], r["train_loss"]) for r in rows] == [(10, 5.0), (20, 4.0), (30, 3.5), (40, 3.0)]
    assert [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None] == [(20, 4.5), (40, 3.6)]
    assert rows[0]["val_loss"] is None and rows[0]["val_ppl"] is None and rows[1]["lr"] == 1e-3  # empty cell: None
    png = plot_curves(csv_path, tmp_path / "curves.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(TinyLMError, match="no metrics file"):
        plot_curves(tmp_path / "nope.csv", tmp_path / "x.png")
    with pytest.raises(TinyLMError, match="no metrics file"):
        read_metrics(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("step,train_loss,val_loss\n")
    with pytest.raises(TinyLMError, match="no loss values"):
        plot_curves(tmp_path / "empty.csv", tmp_path / "x.png")
    (tmp_path / "bad.csv").write_text("step,train_loss,val_loss\n10,oops,\n")
    with pytest.raises(TinyLMError, match="not a number"):
        read_metrics(tmp_path / "bad.csv")


@pytest.mark.slow  # draws a PNG per head
def test_attention_cli(model_and_tokenizer, tmp_path, capsys):
    model, tok = model_and_tokenizer
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tok)
    out = tmp_path / "att"
    assert main(["attention", "--checkpoint", str(ckpt), "--text", TEXT, "--out", str(out), "--html"]) == 0
    assert (out / "attention_layer0.png").is_file() and (out / "attention.html").is_file()
    assert "2 layers x 4 heads" in capsys.readouterr().out
    assert main(["attention", "--checkpoint", str(ckpt), "--text", "word " * 40, "--out", str(out)]) == 2
    assert "longer than the model's context" in capsys.readouterr().err
