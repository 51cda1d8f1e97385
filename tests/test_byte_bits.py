"""Bits per byte, byte by byte: the per-byte bits of a GPT, an n-gram and a neural bigram sum to
`tinylm evaluate`'s bits per byte on the same text; token spans cover the text's bytes whatever the
tokenizer (byte-level pieces of a character, <unk>, lowercasing, no start token)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import make_stories
from serving_util import make_run

from tinylm.cli import main
from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError
from tinylm.evaluation.byte_bits import char_bits, char_offsets, char_span, score_bytes, token_byte_spans
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.interop.loading import load_any_checkpoint
from tinylm.models.bigram import NeuralBigramLM
from tinylm.models.ngram import NGramLM
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.word import WordTokenizer

STORIES = make_stories(40)
# new pairs of the training sentences, longer than the GPT's context of 32 characters
PASSAGE = " ".join(make_stories(2, seed=3))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A GPT run (character tokenizer), a Kneser-Ney 3-gram and a neural bigram (BPE) as files."""
    root = tmp_path_factory.mktemp("byte_bits")
    gpt = make_run(root)
    tok = BPETokenizer().train(STORIES, 300)
    tok.save(root / "tokenizer.json")
    ids = np.array([i for t in STORIES for i in (SOS_ID, *tok.encode(t), EOS_ID)])
    NGramLM(3, tok.vocab_size, "kneser_ney").fit(ids).smoothed("interpolated").save(root / "ngram-3.npz")
    torch.manual_seed(0)
    NeuralBigramLM(tok.vocab_size, 16).save(root / "bigram.pt")
    (root / "passage.txt").write_text(PASSAGE, encoding="utf-8")
    return {"gpt": gpt, "ngram": root / "ngram-3.npz", "bigram": root / "bigram.pt", "data": root / "passage.txt"}


@pytest.mark.parametrize("kind", ["gpt", "ngram", "bigram"])
def test_per_byte_bits_sum_to_tinylm_evaluate(checkpoints, kind, capsys):
    assert main(["evaluate", "--checkpoint", str(checkpoints[kind]), "--data", str(checkpoints["data"]), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    model, tok, _ = load_any_checkpoint(checkpoints[kind])
    scored = score_bytes(model, tok, PASSAGE, top=5)
    n_bytes = len(PASSAGE.encode("utf-8"))
    assert scored.byte_bits.shape == (n_bytes,) and evaluated["bytes"] == n_bytes
    assert scored.byte_bits.sum() / n_bytes == pytest.approx(evaluated["bpb"], rel=1e-6)
    assert scored.bpb == pytest.approx(evaluated["bpb"], rel=1e-6) and math.isfinite(scored.bpb)
    assert len(scored.token_logprobs) == len(scored.ids) == evaluated["tokens"]
    # each token's top-5 are the five most likely, in order, the token itself among them when it is the best
    for lp, top in zip(scored.token_logprobs, scored.top):
        values = [v for _, v in top]
        assert len(top) == 5 and values == sorted(values, reverse=True) and lp <= values[0] + 1e-6
    if kind == "gpt":  # longer than the context: the strided windows of `tinylm evaluate`
        assert len(scored.ids) > model.config.context_length


def test_byte_level_pieces_of_a_character_get_their_own_bytes():
    text = "Naïve café owners 🙂 said déjà vu, 日本."
    tok = BPETokenizer().train(STORIES + ["café déjà"], 280)
    ids = tok.encode(text)
    spans = token_byte_spans(tok, text, ids)
    data = text.encode("utf-8")
    assert [data[s:e] for s, e in spans] == [tok.token_bytes[i] for i in ids]
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert any(len(tok.token_bytes[i].decode("utf-8", "ignore")) == 0 for i in ids)  # the emoji is split
    offsets = char_offsets(text)
    assert offsets[-1] == len(data) and len(offsets) == len(text) + 1
    # each character goes to the token holding its first byte: the character spans partition the text
    chars = [char_span(span, offsets) for span in spans]
    assert chars[0][0] == 0 and chars[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(chars, chars[1:]))


def test_unknown_words_and_lowercasing_still_cover_every_byte():
    tok = WordTokenizer(lowercase=True).train(STORIES, 40)
    text = "Tom had a Zebra named   Qwerty. The cat liked to play!"
    ids = tok.encode(text)
    assert tok.unk_id in ids
    spans = token_byte_spans(tok, text, ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(text.encode())
    assert all(e > s for s, e in spans)
    assert text[spans[0][0] : spans[0][1]].strip() == "Tom"
    bits = np.zeros(len(text))
    for s, e in spans:  # a token with no bytes of its own shares its neighbour's: nothing is lost
        bits[s:e] += 1.0 / (e - s)
    assert bits.sum() == pytest.approx(len(ids))


def test_without_a_start_token_the_first_token_is_not_predicted(checkpoints):
    model, tok, _ = load_any_checkpoint(checkpoints["gpt"])
    tok.bos_id = None
    scored = score_bytes(model, tok, "The cat sat.", top=3)
    assert scored.token_logprobs[0] is None and scored.top[0] == []
    assert scored.byte_bits[0] == 0 and scored.byte_bits[1:].min() > 0
    m = evaluate_texts(model, tok, ["The cat sat."])
    assert scored.bpb == pytest.approx(m["bpb"], rel=1e-6)


def test_character_bits_are_the_sums_of_their_bytes():
    text = "aé🙂b"
    offsets = char_offsets(text)
    assert offsets.tolist() == [0, 1, 3, 7, 8]
    byte_bits = np.arange(8, dtype=float)
    assert char_bits(byte_bits, offsets).tolist() == [0.0, 3.0, 18.0, 7.0]
    assert char_span((1, 4), offsets) == (1, 3) and char_span((3, 8), offsets) == (2, 4)


def test_a_text_with_nothing_to_score_is_an_error(checkpoints):
    model, tok, _ = load_any_checkpoint(checkpoints["gpt"])
    tok.bos_id = None
    with pytest.raises(TinyLMError, match="no token to score"):
        score_bytes(model, tok, "a")
