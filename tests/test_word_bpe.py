"""word_bpe, the four-stage report's BPE: merges identical to a slow reference trainer, encoding
identical to applying the merges one after the other (the report's way), the normalisations on
hand-written strings, tokens per word on a hand-checked text, lossless on normalised text,
save/load."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tinylm.config import TokenizerConfig
from tinylm.constants import UNK_ID
from tinylm.data.tokens import encode_split
from tinylm.errors import TinyLMError
from tinylm.studies.shakespeare import report_split_stats
from tinylm.tokenizers import load_tokenizer, train_from_config
from tinylm.tokenizers.merges import merge_pair
from tinylm.tokenizers.word_bpe import EOW_ID, FIRST_CHAR_ID, WordBPETokenizer, normalize_text

CORPUS = [
    "To be, or not to be: that is the question.",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep; No more;",
]


def reference_train(texts, n_merges, normalization="lower_nopunct"):
    """The textbook trainer on words: recount every pair before each merge; the highest count,
    ties to the smallest (left id, right id); merge left to right."""
    counts = Counter(w for t in texts for w in normalize_text(t, normalization).split())
    alphabet = sorted(set("".join(counts)))
    first_merge = FIRST_CHAR_ID + len(alphabet)
    words = {tuple(FIRST_CHAR_ID + alphabet.index(c) for c in w): n for w, n in counts.items()}
    merges = []
    while len(merges) < n_merges:
        pairs = Counter()
        for w, n in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = Counter()
        for w, n in words.items():
            merged[tuple(merge_pair(list(w), best, first_merge + len(merges) - 1))] += n
        words = merged
    return alphabet, merges


def report_encode(tok, text):
    """The report's encoding: each word's characters, every merge applied in the order learned,
    then the end-of-word token."""
    out = []
    for word in tok.normalize(text).split():
        ids = [tok.char_ids.get(c, UNK_ID) for c in word]
        for i, pair in enumerate(tok.merges):
            ids = merge_pair(ids, pair, tok.first_merge_id + i)
        out += [*ids, EOW_ID]
    return out


def random_corpus(seed, n_words=300):
    rng = random.Random(seed)
    syllables = ["ba", "na", "an", "th", "e", "the", "ing", "a", "aa", "st", "o", "ro", "me"]
    return [
        " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n_words // 10))
        for _ in range(10)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_merges", [1, 10, 60])
def test_merges_equal_the_slow_reference(seed, n_merges):
    texts = CORPUS if seed == 0 else random_corpus(seed)
    tok = WordBPETokenizer().train(texts, merges=n_merges)
    alphabet, merges = reference_train(texts, n_merges)
    assert tok.alphabet == alphabet
    assert tok.merges == merges
    held_out = "the banana stings, roaming to nobler aaaa sea ZZ"
    assert tok.encode(held_out) == report_encode(tok, held_out)


def test_the_merges_stop_when_no_pair_is_left():
    tok = WordBPETokenizer().train(["ab ab a b"], merges=50)
    assert tok.merges == [(FIRST_CHAR_ID, FIRST_CHAR_ID + 1)]  # only (a, b) exists
    assert tok.vocab_size == FIRST_CHAR_ID + 2 + 1


def test_normalisations_on_hand_written_strings():
    text = "  Hello, World! It's 2 o'clock -- ROMEO.\nCafé & co. | 3½ ~x  "
    assert normalize_text(text, "lower_nopunct") == "hello world its 2 oclock romeo café co | 3½ ~x"
    assert normalize_text(text, "aggressive") == "hello world its 2 oclock romeo café co 3½ x"
    assert normalize_text(text, "none") == "Hello, World! It's 2 o'clock -- ROMEO. Café & co. | 3½ ~x"
    with pytest.raises(TinyLMError, match="normalization 'upper' is not one of"):
        WordBPETokenizer(normalization="upper")


def test_end_of_word_token_decodes_as_a_space_and_text_comes_back_normalised():
    tok = WordBPETokenizer().train(CORPUS, merges=40)
    ids = tok.encode("To be, or NOT to be!")
    assert ids.count(EOW_ID) == 6 and ids[-1] == EOW_ID
    assert tok.id_to_piece(EOW_ID) == "__"
    for text in CORPUS + ["  the   sea\tof\nmind  ", "arrows, arrows; ARROWS"]:
        assert tok.decode(tok.encode(text)) == tok.normalize(text)
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert tok.decode(tok.encode("to be quixotic")) == "to be qui<unk>oti<unk>"  # no x or c in training


def test_tokens_per_word_on_a_hand_checked_text(tmp_path):
    # "aaa aaa ab": merge 1 is (a, a) (count 4), merge 2 is (aa, a) (count 2); so "aaa" is one
    # piece and "ab" two: 4 pieces for 3 words (the `__` after each word is not counted)
    tok = WordBPETokenizer().train(["aaa aaa ab"], merges=2)
    assert [tok.id_to_piece(i) for i in tok.encode("aaa aaa ab")] == ["aaa", "__", "aaa", "__", "a", "b", "__"]
    docs = ["AAA, aaa ab!", "ab"]
    split = encode_split("valid", docs, tok, tmp_path)
    stats = report_split_stats(tok, split, docs)
    assert stats["tokens_per_word"] == pytest.approx(6 / 4)  # 1 + 1 + 2 pieces, then 2 pieces
    assert stats["reconstructed"] == 2 and stats["documents"] == 2
    assert split.n_bytes == len("aaa aaa ab") + len("ab")  # bytes of the normalised text


def test_save_load_round_trip_and_config(tmp_path):
    cfg = TokenizerConfig(type="word_bpe", merges=30, normalization="aggressive")
    tok = train_from_config(cfg, CORPUS)
    assert tok.normalization == "aggressive" and len(tok.merges) == 30
    tok.save(tmp_path / "tokenizer.json")
    back = load_tokenizer(tmp_path)
    assert type(back) is WordBPETokenizer and back.vocab_size == tok.vocab_size
    assert back.merges == tok.merges and back.alphabet == tok.alphabet and back.normalization == "aggressive"
    text = "The mind of outrageous troubles, to sleep."
    assert back.encode(text) == tok.encode(text)
    assert back.decode(back.encode(text)) == "the mind of outrageous troubles to sleep"
    by_size = train_from_config(
        TokenizerConfig(type="word_bpe", vocab_size=tok.vocab_size, normalization="aggressive"), CORPUS
    )
    assert by_size.merges == tok.merges  # vocab_size instead of merges: the same tokenizer
    with pytest.raises(TinyLMError, match="smaller than the specials"):
        WordBPETokenizer().train(CORPUS, vocab_size=10)
