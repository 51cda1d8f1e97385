"""Word-level tokenizer options: lowercase, punctuation, top-N / min-count, spaCy, coverage."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from tinylm.errors import TinyLMError
from tinylm.tokenizers import WordTokenizer, load_tokenizer
from tinylm.constants import UNK_ID

TEXTS = [
    "The cat sat. The cat ran! A dog, a DOG, and the Cat.",
    "Don't stop: Lily's dog isn't here. The end.",
    "the the the cat cat dog",
]


def test_split_keeps_contractions_and_punctuation():
    tok = WordTokenizer()
    assert tok.split("Don't stop, Lily's dog!") == ["Don't", "stop", ",", "Lily's", "dog", "!"]
    assert WordTokenizer(keep_punctuation=False).split("Don't stop, Lily's dog!") == ["Don't", "stop", "Lily's", "dog"]
    assert WordTokenizer(lowercase=True).split("The DOG.") == ["the", "dog", "."]


def test_top_n_by_frequency_ties_alphabetical():
    tok = WordTokenizer(lowercase=True).train(TEXTS, 4 + 3)
    counts = Counter(w for t in TEXTS for w in WordTokenizer(lowercase=True).split(t))
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    assert tok.words == [w for w, _ in top] == ["the", "cat", "."]
    assert tok.encode("The cat barked.") == [4, 5, UNK_ID, 6]
    assert tok.decode(tok.encode("The cat barked.")) == "the cat <unk>."


def test_min_count_and_no_cap():
    tok = WordTokenizer(lowercase=True).train(TEXTS, None, min_count=3)
    counts = Counter(w for t in TEXTS for w in WordTokenizer(lowercase=True).split(t))
    assert set(tok.words) == {w for w, c in counts.items() if c >= 3}
    capped = WordTokenizer(lowercase=True).train(TEXTS, 6, min_count=3)
    assert capped.words == tok.words[:2]


def test_coverage_counts_tokens_and_types():
    tok = WordTokenizer(lowercase=True).train(TEXTS, 4 + 3)  # the, cat, .
    cov = tok.coverage(["the cat and the dog."])
    # running words: the cat and the dog . -> 6, covered: the cat the . -> 4; types: 5, covered 3
    assert (cov.n_tokens, cov.tokens_covered, cov.n_types, cov.types_covered) == (6, 4, 5, 3)
    assert cov.token_coverage == pytest.approx(4 / 6) and cov.type_coverage == pytest.approx(3 / 5)
    assert tok.unk_rate(["the cat and the dog."]) == pytest.approx(2 / 6)
    assert cov.as_dict()["unk_rate"] == pytest.approx(2 / 6)


@pytest.mark.slow  # imports spaCy
def test_spacy_splitter_matches_spacy():
    spacy = pytest.importorskip("spacy")
    nlp = spacy.blank("en")
    text = "Don't stop, Lily's dog! It's 3.5 km away... \"Yes,\" she said."
    tok = WordTokenizer(splitter="spacy")
    assert tok.split(text) == [t.text for t in nlp(text) if not t.is_space]
    trained = tok.train(TEXTS + [text], 100)
    assert "n't" in trained.words and "Do" in trained.words


def test_save_load_options_and_old_files(tmp_path):
    tok = WordTokenizer(lowercase=True, keep_punctuation=False).train(TEXTS, 20)
    tok.save(tmp_path / "w.json")
    again = load_tokenizer(tmp_path / "w.json")
    assert (again.words, again.lowercase, again.keep_punctuation, again.splitter) == (tok.words, True, False, "regex")
    data = json.loads((tmp_path / "w.json").read_text())
    for key in ("keep_punctuation", "splitter"):
        del data[key]  # a file from before these options
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_tokenizer(tmp_path / "old.json")
    assert old.keep_punctuation is True and old.words == tok.words


def test_bad_input():
    with pytest.raises(TinyLMError, match="empty corpus"):
        WordTokenizer().train(["", "  "], 10)
    with pytest.raises(TinyLMError, match="no room for words"):
        WordTokenizer().train(TEXTS, 3)
    with pytest.raises(TinyLMError, match="min_count must be at least 1"):
        WordTokenizer().train(TEXTS, 10, min_count=0)
    with pytest.raises(TinyLMError, match="splitter 'nltk' is not one of"):
        WordTokenizer(splitter="nltk")
    with pytest.raises(TinyLMError, match="not a valid regex"):
        WordTokenizer(pattern="[unclosed")


def test_config_options_reach_the_tokenizer():
    from tinylm.config import TokenizerConfig
    from tinylm.tokenizers import train_from_config

    cfg = TokenizerConfig(type="word", vocab_size=0, lowercase=True, min_count=3, keep_punctuation=False)
    tok = train_from_config(cfg, TEXTS)
    assert tok.lowercase and not tok.keep_punctuation and "." not in tok.words
    assert tok.words == ["the", "cat", "dog"]  # the x7, cat x5, dog x4; "a" x2 is below min_count
    bpe = train_from_config(TokenizerConfig(type="bpe", vocab_size=270, pattern="gpt4"), TEXTS)
    assert bpe.pattern == "gpt4" and bpe.vocab_size == 270
