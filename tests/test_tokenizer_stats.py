"""`tinylm tokenizer-stats`: numbers checked against direct computation, JSON output, errors."""

from __future__ import annotations

import json

import pytest
from conftest import make_stories

from tinylm.cli import main
from tinylm.tokenizers import BPETokenizer, WordTokenizer
from tinylm.tokenizers.stats import split_stats


@pytest.fixture
def split_files(tmp_path):
    stories = make_stories(60, seed=2)
    paths = {}
    for name, part in (
        ("train", stories[:40]),
        ("valid", stories[40:50] + ["Zebras quietly ate kiwis."]),
        ("test", stories[50:]),
    ):
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text("".join(f"{s}\n<|endoftext|>\n" for s in part), encoding="utf-8")
    return paths, stories


def test_split_stats_by_hand():
    tok = WordTokenizer().train(["the cat sat . the dog"], 8)  # the . cat dog
    stats = split_stats(tok, ["the cat ran .", "the cat"])
    # 6 tokens, 6 words, 1 <unk> (ran); bytes 13 + 7; "the cat" decodes exactly, the other is "the cat <unk>."
    assert stats == {
        "vocab_size": 8,
        "documents": 2,
        "words": 6,
        "tokens": 6,
        "tokens_per_word": 1.0,
        "bytes_per_token": 20 / 6,
        "unk_rate": 1 / 6,
        "roundtrip_exact": 0.5,
    }


def test_cli_json_matches_direct_computation(split_files, capsys, tmp_path):
    paths, stories = split_files
    tok = BPETokenizer().train(stories[:40], 400)
    tok.save(tmp_path / "bpe.json")
    args = [
        "tokenizer-stats",
        "--tokenizer",
        str(tmp_path / "bpe.json"),
        "--train",
        "word:60",
        "--data",
        f"train={paths['train']}",
        "--data",
        f"valid={paths['valid']}",
        "--data",
        str(paths["test"]),
        "--json",
    ]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tokenizer"].split("/")[-1], r["split"]) for r in rows] == [
        ("bpe.json", "train"),
        ("bpe.json", "valid"),
        ("bpe.json", "test"),
        ("word:60", "train"),
        ("word:60", "valid"),
        ("word:60", "test"),
    ]
    valid_docs = stories[40:50] + ["Zebras quietly ate kiwis."]
    ids = [tok.encode(d) for d in valid_docs]
    bpe_valid = rows[1]
    assert bpe_valid["tokens"] == sum(map(len, ids)) and bpe_valid["documents"] == 11
    assert bpe_valid["tokens_per_word"] == pytest.approx(sum(map(len, ids)) / sum(len(d.split()) for d in valid_docs))
    assert bpe_valid["roundtrip_exact"] == 1.0 and bpe_valid["unk_rate"] == 0.0
    word_valid = rows[4]
    assert word_valid["vocab_size"] <= 60 and word_valid["unk_rate"] > 0  # zebras, kiwis are unknown
    assert word_valid["roundtrip_exact"] < 1.0


def test_cli_table_and_more_merges_fewer_tokens_per_word(split_files, capsys):
    paths, _ = split_files
    assert main(["tokenizer-stats", "--train", "bpe:300", "--train", "bpe:500", "--data", str(paths["train"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["tokenizer", "split", "vocab"] and len(out) == 4
    tpw = [float(line.split()[6]) for line in out[2:]]
    assert tpw[0] > tpw[1] >= 1.0


def test_cli_errors_are_one_line(split_files, capsys, tmp_path):
    paths, _ = split_files
    assert main(["tokenizer-stats", "--data", str(paths["train"])]) == 2
    assert "at least one --tokenizer" in capsys.readouterr().err
    assert main(["tokenizer-stats", "--train", "bpe:100", "--data", str(paths["train"])]) == 2
    assert "smaller than the byte alphabet" in capsys.readouterr().err
    assert main(["tokenizer-stats", "--train", "bpe:x", "--data", str(paths["train"])]) == 2
    assert "must be an integer" in capsys.readouterr().err
    assert main(["tokenizer-stats", "--train", "bpe:300", "--data", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "t.json").write_text('{"format": "tinylm-tokenizer", "version": 7, "type": "bpe"}')
    assert main(["tokenizer-stats", "--tokenizer", str(tmp_path / "t.json"), "--data", str(paths["train"])]) == 2
    err = capsys.readouterr().err
    assert "format version 7" in err and len(err.strip().splitlines()) == 1
