import json

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.constants import UNK_ID
from tinylm.errors import TinyLMError
from tinylm.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer, load_tokenizer, new_tokenizer
from tinylm.tokenizers.base import ContinuationText

CORPUS = ["The cat sat on the mat. The dog sat on the log.", "Ünïcödé ✓ and emoji 🙂 too", "a b c " * 20]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer().train(CORPUS, 300)


@pytest.fixture(scope="module")
def char():
    return CharTokenizer().train(CORPUS)


@settings(max_examples=examples(200), deadline=None)
@given(st.text())
def test_bpe_round_trip_any_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=examples(200), deadline=None)
@given(st.text())
def test_char_round_trip_any_unicode(char, text):
    assert char.decode(char.encode(text)) == text


def test_bpe_learns_merges_and_compresses(bpe):
    assert bpe.vocab_size == 300
    text = "The cat sat on the mat."
    assert len(bpe.encode(text)) < len(text.encode()) / 2


def test_bpe_vocab_too_small():
    with pytest.raises(TinyLMError, match="smaller than the byte alphabet plus specials"):
        BPETokenizer().train(CORPUS, 100)


def test_word_tokenizer_top_n_and_unk_rate():
    tok = WordTokenizer(lowercase=True).train(["the cat, the dog. The end!"], vocab_size=4 + 3)
    assert tok.words == ["the", "!", ","]  # "the" x3, then the count-1 ties in alphabetical order
    ids = tok.encode("The cat")
    assert ids[0] == tok.encode("the")[0] and ids[1] == UNK_ID
    assert tok.unk_rate(["the cat"]) == 0.5
    full = WordTokenizer().train(["Hello, world! It's fine."], 100)
    assert full.decode(full.encode("Hello, world! It's fine.")) == "Hello, world! It's fine."


@pytest.mark.parametrize("kind", ["bpe", "char", "word"])
def test_save_load_identical(tmp_path, kind):
    tok = new_tokenizer(kind).train(CORPUS, 290)
    path = tmp_path / "tok.json"
    tok.save(path)
    again = load_tokenizer(path)
    assert type(again) is type(tok) and again.vocab_size == tok.vocab_size
    for text in CORPUS:
        assert again.encode(text) == tok.encode(text)
    data = json.loads(path.read_text())
    assert data["format"] == "tinylm-tokenizer" and data["version"] == 1 and data["type"] == kind


def test_bad_tokenizer_files(tmp_path):
    p = tmp_path / "t.json"
    with pytest.raises(TinyLMError, match="does not exist"):
        load_tokenizer(p)
    p.write_text("not json")
    with pytest.raises(TinyLMError, match="not a tinylm JSON tokenizer"):
        load_tokenizer(p)
    p.write_text(json.dumps({"format": "tinylm-tokenizer", "version": 1, "type": "sentencepiece"}))
    with pytest.raises(TinyLMError, match="unknown tokenizer type 'sentencepiece'"):
        load_tokenizer(p)
    p.write_text(json.dumps({"format": "tinylm-tokenizer", "version": 99, "type": "bpe"}))
    with pytest.raises(TinyLMError, match="version 99"):
        load_tokenizer(p)
    with pytest.raises(TinyLMError, match="unknown tokenizer type 'wordpiece'"):
        new_tokenizer("wordpiece")


def test_empty_corpus():
    for kind in ("bpe", "char", "word"):
        with pytest.raises(TinyLMError, match="empty corpus"):
            new_tokenizer(kind).train([], 300)


def test_decode_continuation_keeps_the_word_space():
    word = WordTokenizer().train(["once upon a time there was a cat"], 50)
    prompt = word.encode("once upon a time")
    assert word.decode_continuation(prompt, word.encode("there was")) == " there was"
    bpe = BPETokenizer().train(CORPUS, 290)
    assert bpe.decode_continuation(bpe.encode("The cat"), bpe.encode(" sat")) == " sat"


def test_continuation_text_is_decode_continuation_after_every_token(bpe):
    """Streamed text (``ContinuationText``: a window per update) equals decoding the whole
    continuation after every token: byte-level tokens splitting characters (held until complete),
    the space between words, special tokens, random ids."""
    import random

    word = WordTokenizer().train(["once upon a time there was a cat who sat on a mat"], 50)
    char = CharTokenizer().train(["héllo wörld ✓"], 50)
    rng = random.Random(0)
    for tok in (bpe, word, char):
        for trial in range(40):
            prompt = tok.encode("Once upon ✓ a time" if tok is bpe else "once upon a time")
            if trial % 2:  # random ids, special tokens included
                tokens_all = [rng.randrange(tok.vocab_size) for _ in range(60)]
            else:
                tokens_all = tok.encode(
                    "é ✓ there was a cat 🐈 who sat — on a mat" if tok is not word else "there was a cat"
                )
            stream, tokens = ContinuationText(tok.decode, prompt), []
            for t in tokens_all:
                tokens.append(t)
                assert stream.update(tokens) == tok.decode_continuation(prompt, tokens)
