"""Word-level tokenizer options: lowercase, punctuation, top-N / min-count, spaCy, coverage."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tinylm.constants import UNK_ID
from tinylm.errors import TinyLMError
from tinylm.tokenizers import WordTokenizer, load_tokenizer

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


@pytest.mark.parametrize(
    "order,at", [(("<sos>", "<eos>", "<pad>", "<unk>"), "start"), (("<pad>", "<unk>", "<sos>", "<eos>"), "end")]
)
def test_special_token_order_and_place_round_trip_through_save_and_load(tmp_path, order, at):
    from tinylm.tokenizers.io import load_tokenizer

    text = "the cat sat on the mat . the dog sat ."
    tok = WordTokenizer(special_tokens=order, specials_at=at).train([text])
    n_words = len(tok.words)
    first = 0 if at == "start" else n_words
    expected = {name: first + order.index(name) for name in ("<pad>", "<unk>", "<sos>", "<eos>")}
    assert (tok.pad_id, tok.unk_id, tok.sos_id, tok.eos_id) == tuple(expected.values())
    assert tok.bos_id == tok.sos_id and tok.stop_ids == (tok.eos_id,)
    assert tok.id_to_piece(tok.sos_id) == "<sos>" and tok.id_to_piece(tok.unk_id) == "<unk>"
    ids = tok.encode("the zebra sat")
    assert ids[1] == tok.unk_id and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode([tok.sos_id, *ids, tok.eos_id, tok.pad_id]) == "the <unk> sat"
    tok.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert (back.pad_id, back.unk_id, back.sos_id, back.eos_id) == tuple(expected.values())
    assert back.encode(text) == tok.encode(text) and back.vocab_size == tok.vocab_size == n_words + 4


def test_oov_bpe_pieces_spell_every_word_of_the_training_alphabet(tmp_path):
    from tinylm.tokenizers.io import load_tokenizer

    train = ["the cat sat on the mat.", "a bird sang in the tree, and the cat listened.", "tom ran home."]
    plain = WordTokenizer(lowercase=True).train(train, vocab_size=10)
    oov = WordTokenizer(lowercase=True, oov="bpe").train(train, vocab_size=10, oov_merges=20)
    assert oov.words == plain.words  # the same word vocabulary; pieces come after it
    unseen = "The cat sang a song to the bird at home."  # "song", "to", "at" are out of the vocabulary
    assert plain.unk_rate([unseen]) > 0.2 and oov.unk_rate([unseen]) == 0.0
    ids = oov.encode(unseen)
    assert oov.decode(ids) == oov.normalize(unseen) == "the cat sang a song to the bird at home."
    assert max(ids) < oov.vocab_size and plain.decode(plain.encode(unseen)).count("<unk>") >= 3
    assert oov.unk_rate(["qqq"]) > 0  # a character never seen in training is still <unk>
    oov.save(tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").encode(unseen) == ids


def test_the_token_cache_uses_the_tokenizers_own_start_and_end_ids(tmp_path):
    from tinylm.data.tokens import encode_split

    tok = WordTokenizer(special_tokens=("<sos>", "<eos>", "<pad>", "<unk>")).train(["a b c"])
    split = encode_split("train", ["a b", "c"], tok, tmp_path)
    assert split.document(0).tolist() == [0, *tok.encode("a b"), 1] and tok.sos_id == 0 and tok.eos_id == 1
