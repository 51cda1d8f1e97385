"""llama2.c tokenizer.bin reader: encodes as run.c does (checked against a direct transcription of
run.c's quadratic merge loop, and against sentencepiece on a model trained in the test)."""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.tokenizers import load_tokenizer
from tinylm.tokenizers.llama2c import BOS, EOS, Llama2cTokenizer


def write_bin(path, pieces, scores):
    """A tokenizer.bin in llama2.c's layout, written by the test."""
    blob = [struct.pack("<i", max(len(p) for p in pieces))]
    for p, s in zip(pieces, scores):
        blob.append(struct.pack("<fi", s, len(p)) + p)
    path.write_bytes(b"".join(blob))
    return path


def small_vocab():
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    scores = [0.0] * len(pieces)
    # merged pieces with scores: higher merges first
    extra = [
        (b" ", -1.0),
        (b"a", -2.0),
        (b"b", -3.0),
        (b"c", -4.0),
        (b"h", -5.0),
        (b"e", -6.0),
        (b" a", 0.0),
        (b"ab", -0.5),
        (b" ab", -0.25),
        (b"bc", -0.5),
        (b"abc", -7.0),
        (b"he", -1.5),
        (b" he", -2.5),
        ("é".encode(), -8.0),
        (b"  ", -9.0),
    ]
    for p, s in extra:
        pieces.append(p)
        scores.append(s)
    return pieces, scores


def naive_run_c_encode(tok: Llama2cTokenizer, text: str, bos: bool) -> list[int]:
    """run.c's merge loop as written there: rescan every pair, take the best score (> -1e10,
    first one on ties), merge, repeat."""
    ids = tok.initial_ids(text, bos)
    while True:
        best_score, best_idx, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            j = tok.piece_to_id(tok._cstr[ids[i]] + tok._cstr[ids[i + 1]])
            if j is not None and tok.scores[j] > best_score:
                best_score, best_idx, best_id = tok.scores[j], i, j
        if best_idx == -1:
            return ids
        ids[best_idx : best_idx + 2] = [best_id]


@pytest.fixture
def tok(tmp_path):
    return Llama2cTokenizer.from_file(write_bin(tmp_path / "tokenizer.bin", *small_vocab()))


def test_reads_file_and_specials(tok):
    assert tok.vocab_size == 259 + 15
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    assert tok.max_token_length == 6
    assert tok.piece_to_id(" ab") == 259 + 8


def test_hand_worked_encoding(tok):
    space, a, b, c, ab_sp, bc = (tok.piece_to_id(p) for p in (" ", "a", "b", "c", " ab", "bc"))
    # "abc": [space a b c] -> " a" (0.0) -> then " ab" (-0.25) beats "bc" (-0.5) -> [" ab", c]
    assert tok.encode("abc") == [ab_sp, c]
    assert tok.encode("abc", bos=True, eos=True) == [BOS, ab_sp, c, EOS]
    # "bcb": no " b" piece; "bc" merges; the leading space stays alone
    assert tok.encode("bcb") == [space, bc, b]
    # unknown code point -> one byte-fallback id per UTF-8 byte (byte + 3)
    assert tok.encode("☃") == [space] + [x + 3 for x in "☃".encode()]
    # a known multi-byte code point is one piece
    assert tok.encode("é") == [space, tok.piece_to_id("é")]
    assert tok.encode("") == []
    assert tok.encode("", bos=True) == [BOS]


def test_ties_go_to_the_leftmost_pair(tok):
    # "abab": pairs " a"(0.0) first; then " ab"(-0.25) and "ab"(-0.5) ...
    ids = tok.encode("abab")
    assert ids == naive_run_c_encode(tok, "abab", False) == [tok.piece_to_id(" ab"), tok.piece_to_id("ab")]
    # "bcbc": both "bc" pairs score -0.5; leftmost first, result identical either way but the
    # order matters for overlaps like "bcbcb"
    for text in ("bcbc", "bcbcb", "hehehe", "a  b  c"):
        assert tok.encode(text) == naive_run_c_encode(tok, text, False)


@pytest.mark.slow  # 150 examples
@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abche é☃\n\t") + ["\U0001f600"]), max_size=40), st.booleans())
def test_matches_naive_run_c_loop(tmp_path_factory, text, bos):
    pieces, scores = small_vocab()
    tok = Llama2cTokenizer(pieces, scores)
    assert tok.encode(text, bos=bos) == naive_run_c_encode(tok, text, bos)


@pytest.mark.slow  # 150 examples
@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_unicode(text):
    tok = Llama2cTokenizer(*small_vocab())
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == text


def test_decode_piece_follows_run_c(tok):
    he = tok.piece_to_id(" he")
    assert tok.decode_piece(BOS, he) == b"he"  # space stripped after BOS
    assert tok.decode_piece(5, he) == b" he"
    assert tok.decode_piece(5, 3 + 0x41) == b"A"  # <0x41> is the byte 'A'
    assert tok.decode([he, he], strip_dummy_prefix=False) == " he he"


def test_save_is_byte_identical_and_load_tokenizer_sniffs(tmp_path, tok):
    src = write_bin(tmp_path / "a.bin", *small_vocab())
    tok.save(tmp_path / "b.bin")
    assert (tmp_path / "b.bin").read_bytes() == src.read_bytes()
    again = load_tokenizer(tmp_path / "b.bin")
    assert isinstance(again, Llama2cTokenizer) and again.encode("abc he") == tok.encode("abc he")


def test_vocab_size_limits_pieces_read(tmp_path):
    path = write_bin(tmp_path / "t.bin", *small_vocab())
    assert Llama2cTokenizer.from_file(path, vocab_size=260).vocab_size == 260
    with pytest.raises(TinyLMError, match="fewer than the vocab_size 9999"):
        Llama2cTokenizer.from_file(path, vocab_size=9999)


def test_bad_files(tmp_path):
    with pytest.raises(TinyLMError, match="does not exist"):
        Llama2cTokenizer.from_file(tmp_path / "missing.bin")
    (tmp_path / "j.bin").write_text('{"format": "x"}')
    with pytest.raises(TinyLMError, match="JSON"):
        Llama2cTokenizer.from_file(tmp_path / "j.bin")
    good = write_bin(tmp_path / "g.bin", *small_vocab()).read_bytes()
    (tmp_path / "cut.bin").write_bytes(good[:-1])
    with pytest.raises(TinyLMError, match=r"piece 273 at byte \d+ has length"):
        Llama2cTokenizer.from_file(tmp_path / "cut.bin")
    (tmp_path / "neg.bin").write_bytes(struct.pack("<i", -5) + good[4:])
    with pytest.raises(TinyLMError, match="max_token_length -5"):
        Llama2cTokenizer.from_file(tmp_path / "neg.bin")


def test_matches_sentencepiece_bpe_trained_in_test():
    """A sentencepiece BPE model (byte fallback) exported the way llama2.c's tokenizer.py does:
    "▁" becomes a space, BOS/EOS become "\\n<s>\\n" / "\\n</s>\\n", scores kept."""
    spm = pytest.importorskip("sentencepiece")
    from conftest import make_stories

    lines = make_stories(200, seed=3) + ["Hello there, 123 numbers; ümlaut and café!"] * 5
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    special = {1: "\n<s>\n", 2: "\n</s>\n"}
    pieces = [special.get(i, sp.id_to_piece(i)).replace("\u2581", " ").encode() for i in range(sp.vocab_size())]
    tok = Llama2cTokenizer(pieces, [sp.get_score(i) for i in range(sp.vocab_size())])
    texts = lines[:60] + ["Once upon a time, héllo 日本!", "  two  spaces", "tab\there", "x" * 30, "9876543210"]
    for text in texts:
        assert tok.encode(text, bos=True) == [1] + sp.encode(text), text
        assert tok.decode(tok.encode(text, bos=True)) == sp.decode(sp.encode(text)) == text
