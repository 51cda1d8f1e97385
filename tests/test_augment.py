"""Mojibake augmentation: the exact byte-level rewrite the official TinyStories files carry, on a
seeded fraction of the training stories only."""

import pytest
from conftest import make_stories, tiny_run_config

from tinylm.data.augment import augment_mojibake, curly_punctuation, mojibake, mojibake_punctuation
from tinylm.data.prepare import prepare
from tinylm.errors import TinyLMError


def test_mojibake_is_utf8_read_as_windows_1252():
    assert mojibake("\u201c") == "â€œ" and mojibake("\u2019") == "â€™" and mojibake("\u2014") == "â€”"
    assert mojibake("\u201d") == "â€\x9d"  # 0x9D is undefined in Windows-1252: kept as the Latin-1 control
    assert mojibake("plain ASCII") == "plain ASCII"

    def byte_of(c):
        try:
            return c.encode("cp1252")
        except UnicodeEncodeError:
            return c.encode("latin-1")

    for text in ("\u201cHi,\u201d she said \u2026", "caf\u00e9"):  # reversible: nothing is lost
        assert b"".join(byte_of(c) for c in mojibake(text)).decode("utf-8") == text


def test_punctuation_rewrite():
    assert curly_punctuation('"Hi," she said. "It\'s me."') == "\u201cHi,\u201d she said. \u201cIt\u2019s me.\u201d"
    assert mojibake_punctuation('"No!" Tom\'s dog') == "â€œNo!â€\x9d Tomâ€™s dog"
    assert mojibake_punctuation("no quotes here") == "no quotes here"


def test_fraction_is_seeded_and_counted():
    docs = [f'"Story {i}," said Sam.' for i in range(1000)]
    out, changed = augment_mojibake(docs, 0.2, seed=0)
    assert out == augment_mojibake(docs, 0.2, seed=0)[0]  # the same draw every time
    assert changed == sum(a != b for a, b in zip(docs, out)) and 150 < changed < 250
    assert augment_mojibake(docs, 0.0, seed=0) == (docs, 0)
    with pytest.raises(ValueError, match="fraction"):
        augment_mojibake(docs, 1.5, seed=0)


def test_prepare_rewrites_the_training_split_only(tmp_path):
    data = tmp_path / "stories.txt"
    data.write_text("".join(f'{s} "Yes," said Tom.\n<|endoftext|>\n' for s in make_stories(60)), encoding="utf-8")
    cfg = tiny_run_config(tmp_path / "run", data)
    cfg.data.mojibake_fraction = 1.0
    prepared = prepare(cfg, tmp_path / "run")
    assert prepared.report["augmentation"] == {
        "mojibake_fraction": 1.0,
        "documents_changed": prepared.splits["train"].n_docs,
    }
    tok = prepared.tokenizer
    train_text = tok.decode(prepared.splits["train"].ids.tolist())
    valid_text = tok.decode(prepared.splits["valid"].ids.tolist())
    assert "â€œ" in train_text and '"' not in train_text
    assert "â€œ" not in valid_text and '"Yes,"' in valid_text
    cfg.data.mojibake_fraction = -0.1
    with pytest.raises(TinyLMError, match="mojibake_fraction"):
        prepare(cfg, tmp_path / "bad")
