"""Byte-level BPE: merges identical to a slow reference trainer, lossless on any Unicode,
special tokens never split, long pre-tokens, file format and bad input."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import regex
from conftest import examples, make_stories
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.tokenizers import load_tokenizer
from tinylm.tokenizers.bpe import BYTE_BASE, FIRST_MERGE_ID, GPT2_SPLIT, BPETokenizer
from tinylm.tokenizers.merges import merge_pair as _merge
from tinylm.tokenizers.merges import merge_pairs


def reference_train(texts, vocab_size, pattern=GPT2_SPLIT):
    """The textbook trainer: recount every pair of every pre-token before each merge; take the
    highest count, ties to the smallest (left id, right id); merge left to right."""
    counts = Counter()
    for t in texts:
        counts.update(regex.findall(pattern, t))
    words = {tuple(BYTE_BASE + b for b in w.encode()): c for w, c in counts.items()}
    merges = []
    while len(merges) < vocab_size - FIRST_MERGE_ID:
        pairs = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        new_id = FIRST_MERGE_ID + len(merges)
        merges.append(best)
        merged = Counter()
        for w, c in words.items():
            merged[tuple(_merge(list(w), best, new_id))] += c
        words = merged
    return merges


def reference_encode(tok, text):
    """Encode by the definition: per pre-token, repeatedly merge the lowest-ranked pair."""
    out = []
    for piece in tok.pretokenize(text):
        ids = [BYTE_BASE + b for b in piece.encode("utf-8", "surrogatepass")]
        while True:
            ranked = [(tok.ranks[p], p) for p in zip(ids, ids[1:]) if p in tok.ranks]
            if not ranked:
                break
            rank, pair = min(ranked)
            ids = _merge(ids, pair, FIRST_MERGE_ID + rank)
        out += ids
    return out


@pytest.fixture(scope="module")
def stories():
    return make_stories(150, seed=1) + ["aaaa aaa aa a, banana bandana, 1234 12345!!", "  \n\t x  y\n\n"]


@pytest.fixture(scope="module")
def trained(stories):
    return BPETokenizer().train(stories, 420)


def test_merges_identical_to_reference_trainer(stories, trained):
    assert trained.vocab_size == 420
    assert trained.merges == reference_train(stories, 420)


@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.text(alphabet="ab c\né", max_size=30), min_size=1, max_size=8))
def test_merges_identical_to_reference_on_random_corpora(texts):
    if not "".join(texts):
        return
    assert BPETokenizer().train(texts, 300).merges == reference_train(texts, 300)


def test_known_merges_and_tie_rule():
    a, b, c, d, sp = (BYTE_BASE + ord(ch) for ch in "abcd ")
    # (a, b) and (c, d) both occur 3 times: the tie goes to the smaller pair, (a, b)
    tok = BPETokenizer().train(["cd", "ab"] * 3, FIRST_MERGE_ID + 2)
    assert tok.merges == [(a, b), (c, d)]
    assert tok.encode("abcd") == [FIRST_MERGE_ID, FIRST_MERGE_ID + 1]
    # counts decide before ids: (c, d) x4 beats (a, b) x3
    tok = BPETokenizer().train(["ab"] * 3 + ["cd"] * 4, FIRST_MERGE_ID + 1)
    assert tok.merges == [(c, d)]
    # " ab": pre-tokens keep the leading space, so (space, a) is a pair too
    tok = BPETokenizer().train(["x ab ab ab"], FIRST_MERGE_ID + 2)
    assert tok.merges == [(sp, a), (FIRST_MERGE_ID, b)]


def test_stops_early_when_nothing_left_to_merge():
    tok = BPETokenizer().train(["ab"], 1000)
    assert tok.merges == [(BYTE_BASE + ord("a"), BYTE_BASE + ord("b"))]


def test_encode_matches_definition(trained, stories):
    for text in stories[:40] + ["Once upon a time, a dog named Bandana ran 12345 laps."]:
        assert trained.encode(text) == reference_encode(trained, text)


@settings(max_examples=examples(100), deadline=None)
@given(st.text(alphabet="abn e.,!1\n", max_size=80))
def test_cold_encode_matches_definition_on_random_text(text):
    cold = BPETokenizer(_shared_trained().merges)
    assert cold.encode(text) == reference_encode(cold, text)


def test_cache_seeded_by_training_equals_cold_encoding(trained, stories):
    assert trained._cache  # seeded with the training pre-tokens
    cold = BPETokenizer(trained.merges, trained.pattern)
    assert not cold._cache
    for text in stories:
        assert trained.encode(text) == cold.encode(text)


@pytest.mark.slow  # 200 examples; test_tokenizers.py::test_bpe_round_trip_any_unicode is the fast round trip
@settings(max_examples=200, deadline=None)
@given(st.text())
def test_lossless_on_any_unicode(text):
    tok = _shared_trained()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(BYTE_BASE <= i < tok.vocab_size for i in ids)


def test_lossless_with_lone_surrogates():
    tok = _shared_trained()
    for text in ("\ud800", "a\udfffb", "x \ud83d"):
        assert tok.decode(tok.encode(text)) == text


@settings(max_examples=examples(60), deadline=None)
@given(st.text(alphabet="abn ", min_size=65, max_size=400))
def test_long_pieces_use_heap_merge_with_same_result(text):
    tok = _shared_trained()
    piece = text.replace(" ", "")  # one long pre-token: the heap path
    ids = [BYTE_BASE + b for b in piece.encode()]
    slow = ids
    while True:
        ranked = [(tok.ranks[p], p) for p in zip(slow, slow[1:]) if p in tok.ranks]
        if not ranked:
            break
        rank, pair = min(ranked)
        slow = _merge(slow, pair, FIRST_MERGE_ID + rank)
    assert merge_pairs(ids, tok._pair_merges.get) == slow
    assert tok.encode(piece) == slow


_SHARED = {}


def _shared_trained():
    if "tok" not in _SHARED:
        _SHARED["tok"] = BPETokenizer().train(make_stories(60) + ["banana bandana nnaabb " * 3], 400)
    return _SHARED["tok"]


def test_special_tokens_only_when_allowed_and_never_split(trained):
    text = "The dog<eos>The cat<pad> ran"
    plain = trained.encode(text)
    assert 3 not in plain and trained.decode(plain) == text  # default: plain text, lossless
    ids = trained.encode(text, allowed_special="all")
    assert ids.count(3) == 1 and ids.count(0) == 1
    # the special is one id with the neighbours encoded on their own
    i = ids.index(3)
    assert ids[:i] == trained.encode("The dog") and ids[i + 1 : ids.index(0)] == trained.encode("The cat")
    assert trained.decode(ids, skip_special=False) == text
    assert trained.decode(ids) == "The dogThe cat ran"
    only_eos = trained.encode(text, allowed_special={"<eos>"})
    assert only_eos.count(3) == 1 and 0 not in only_eos
    with pytest.raises(TinyLMError, match="unknown special tokens"):
        trained.encode(text, allowed_special={"<|endoftext|>"})


def test_custom_pattern_stays_lossless():
    tok = BPETokenizer(pattern=r"\p{L}+").train(["hello world, hello there!"] * 3, 280)
    for text in ("hello, world!", "  \n 12 héllo"):
        assert tok.decode(tok.encode(text)) == text
    # skipped characters are single pre-tokens, letters runs are kept whole
    assert tok.pretokenize("ab, c") == ["ab", ",", " ", "c"]


def test_gpt4_pattern_splits_digits_in_threes():
    tok = BPETokenizer(pattern="gpt4")
    assert tok.pretokenize("1234567 it's") == ["123", "456", "7", " it", "'s"]


def test_save_load_round_trip_and_old_files(tmp_path, trained):
    trained.save(tmp_path / "t.json")
    again = load_tokenizer(tmp_path / "t.json")
    assert again.merges == trained.merges and again.pattern == "gpt2"
    assert again.encode("Once upon a time") == trained.encode("Once upon a time")
    # a version-1 file written before "pattern" existed still loads
    data = json.loads((tmp_path / "t.json").read_text())
    del data["pattern"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_tokenizer(tmp_path / "old.json").merges == trained.merges


def test_bad_input_is_one_line_error(tmp_path):
    with pytest.raises(TinyLMError, match="smaller than the byte alphabet plus specials"):
        BPETokenizer().train(["abc"], 200)
    with pytest.raises(TinyLMError, match="empty corpus"):
        BPETokenizer().train([], 300)
    with pytest.raises(TinyLMError, match="empty corpus"):
        BPETokenizer().train(["", ""], 300)
    with pytest.raises(TinyLMError, match="not a valid regex"):
        BPETokenizer(pattern="(unclosed")
    with pytest.raises(TinyLMError, match="capturing groups"):
        BPETokenizer(pattern=r"(\w+)")
    with pytest.raises(TinyLMError, match="does not exist yet"):
        BPETokenizer([(BYTE_BASE, FIRST_MERGE_ID + 5)])
    with pytest.raises(TinyLMError, match="outside the BPE vocabulary"):
        _shared_trained().decode([5, 99999])
    path = tmp_path / "v9.json"
    path.write_text(json.dumps({"format": "tinylm-tokenizer", "version": 9, "type": "bpe", "merges": []}))
    with pytest.raises(TinyLMError, match="format version 9"):
        load_tokenizer(path)
    path.write_text(json.dumps({"format": "tinylm-tokenizer", "version": 1, "type": "bpe", "merges": [1, 2]}))
    with pytest.raises(TinyLMError, match="merges"):
        load_tokenizer(path)
    (tmp_path / "vocab.txt").write_text("hello\nworld\n")
    with pytest.raises(TinyLMError, match="not a tinylm JSON tokenizer"):
        load_tokenizer(tmp_path / "vocab.txt")


def test_single_string_is_one_text_not_characters():
    assert BPETokenizer().train("ab ab ab", 262).merges == BPETokenizer().train(["ab ab ab"], 262).merges


@pytest.mark.slow
def test_benchmark_quick_runs(tmp_path):
    """benchmarks/bench_tokenizers.py --quick on text the test writes (never ../shared)."""
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tokenizers.py"
    spec = importlib.util.spec_from_file_location("bench_tokenizers", bench)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, n in (("train", 150), ("valid", 30)):
        stories = make_stories(n, seed=7 if name == "train" else 8)
        (tmp_path / f"{name}.txt").write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories))
    out = tmp_path / "rows.json"
    assert (
        module.main(
            [
                "--quick",
                "--vocab",
                "400",
                "--threads",
                "1",
                "--data-dir",
                str(tmp_path),
                "--tok512",
                str(tmp_path / "none.bin"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"tinylm_bpe", "hf_tokenizers_bpe", "tinylm_word", "tinylm_char"}
    for r in rows.values():
        assert {
            "system",
            "vocab_size",
            "train_seconds",
            "encode_mb_per_s",
            "tokens_per_word",
            "roundtrip_exact",
        } <= set(r)
    assert rows["tinylm_bpe"]["vocab_size"] == rows["hf_tokenizers_bpe"]["vocab_size"] == 400
    assert rows["tinylm_bpe"]["roundtrip_exact"] == 1.0 and rows["tinylm_char"]["roundtrip_exact"] == 1.0
    assert abs(rows["tinylm_bpe"]["tokens_per_word"] - rows["hf_tokenizers_bpe"]["tokens_per_word"]) < 0.05
