"""tinylm BPE <-> Hugging Face tokenizers: exported files encode identically in `tokenizers`,
imported HF byte-level BPE files split text into the same pieces."""

from __future__ import annotations

import json
import warnings

import pytest
from conftest import examples, make_stories
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.errors import TinyLMError
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.hf_interop import byte_to_unicode, import_hf, save_hf_tokenizer_json

tokenizers = pytest.importorskip("tokenizers")

CORPUS = make_stories(120, seed=5) + ["naïve café, 日本語のテキスト, emoji \U0001f600\U0001f600 1234567"]
SAMPLES = CORPUS[:30] + ["a<eos>b <pad>x", "héllo 日本 ☃ \U0001f600", "  \n\n  x\t\ty", "it's 12345 don't"]


def hf_pieces(hf, text):
    """The byte strings of the pieces HF produces."""
    back = {c: b for b, c in byte_to_unicode().items()}
    return [bytes(back[ch] for ch in t) for t in hf.encode(text).tokens]


@pytest.fixture(scope="module", params=["gpt2", "gpt4", r"\p{L}+| ?\p{N}"])
def exported(request, tmp_path_factory):
    tok = BPETokenizer(pattern=request.param).train(CORPUS, 420)
    path = save_hf_tokenizer_json(tok, tmp_path_factory.mktemp("hf") / "tokenizer.json")
    return tok, tokenizers.Tokenizer.from_file(str(path)), path


def test_export_encodes_identically(exported):
    tok, hf, _ = exported
    assert hf.get_vocab_size() == tok.vocab_size
    for text in SAMPLES:
        ids = tok.encode(text, allowed_special="all")
        assert hf.encode(text).ids == ids, text
        assert hf.decode(ids) == tok.decode(ids)


@settings(max_examples=examples(100), deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
def test_export_identical_on_random_text(exported, text):
    tok, hf, _ = exported
    assert hf.encode(text).ids == tok.encode(text, allowed_special="all")


def test_export_then_import_gives_back_the_same_tokenizer(exported):
    tok, _, path = exported
    again = import_hf(path)
    assert again.merges == tok.merges and again.pattern == tok.pattern
    assert again.hf_id_map == list(range(tok.vocab_size))


def _hf_trained(special_tokens=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(CORPUS, trainer)
    return hf


def test_import_hf_trained_file_splits_the_same(tmp_path):
    hf = _hf_trained()
    hf.save(str(tmp_path / "hf.json"))
    tok = import_hf(tmp_path / "hf.json")
    assert tok.pattern == "gpt2" and tok.vocab_size == 260 + hf.get_vocab_size() - 256
    for text in SAMPLES:
        ids = tok.encode(text)
        assert [tok.token_bytes[i] for i in ids] == hf_pieces(hf, text)
        assert [tok.hf_id_map[i] for i in ids] == hf.encode(text).ids
        assert tok.decode(ids) == text


def test_load_tokenizer_imports_hf_files(tmp_path):
    from tinylm.tokenizers import load_tokenizer

    hf = _hf_trained()
    hf.save(str(tmp_path / "hf.json"))
    tok = load_tokenizer(tmp_path / "hf.json")
    assert isinstance(tok, BPETokenizer)
    assert [tok.token_bytes[i] for i in tok.encode(SAMPLES[0])] == hf_pieces(hf, SAMPLES[0])


def test_import_warns_about_extra_added_tokens(tmp_path):
    _hf_trained(["<|endoftext|>"]).save(str(tmp_path / "hf.json"))
    with pytest.warns(UserWarning, match="endoftext"):
        import_hf(tmp_path / "hf.json")


def test_import_repeats_merges_for_duplicate_spellings(tmp_path):
    """HF merges (a, bc) and (ab, c) both build "abc" (one HF id); a later ("abc", "d") must
    apply whichever way "abc" was built."""
    from tokenizers import Tokenizer

    chars = byte_to_unicode()
    vocab = {c: i for i, c in enumerate(chars.values())}
    merges = [("b", "c"), ("a", "bc"), ("x", "a"), ("a", "b"), ("ab", "c"), ("abc", "d")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(m) for m in merges],
        },
    }
    path = tmp_path / "dup.json"
    path.write_text(json.dumps(data))
    hf = Tokenizer.from_file(str(path))
    tok = import_hf(path)
    assert len(tok.merges) == len(merges) + 1  # ("abc", "d") twice, once per spelling of "abc"
    for text in ("abcd", "xabcd", "abcabcd xabcd", "xbcd"):
        assert [tok.token_bytes[i] for i in tok.encode(text)] == hf_pieces(hf, text)


def test_bad_files(tmp_path):
    with pytest.raises(TinyLMError, match="does not exist"):
        import_hf(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("not json")
    with pytest.raises(TinyLMError, match="not a Hugging Face tokenizer.json"):
        import_hf(tmp_path / "x.json")
    from tokenizers import Tokenizer, models, pre_tokenizers

    wl = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wl.save(str(tmp_path / "wl.json"))
    with pytest.raises(TinyLMError, match="only BPE"):
        import_hf(tmp_path / "wl.json")
    ws = Tokenizer(models.BPE())
    ws.pre_tokenizer = pre_tokenizers.Whitespace()
    ws.save(str(tmp_path / "ws.json"))
    with pytest.raises(TinyLMError, match="Whitespace"):
        import_hf(tmp_path / "ws.json")
    pf = Tokenizer(models.BPE())
    pf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    pf.save(str(tmp_path / "pf.json"))
    with pytest.raises(TinyLMError, match="add_prefix_space"):
        import_hf(tmp_path / "pf.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TinyLMError, match="only BPE tokenizers"):
            save_hf_tokenizer_json(object(), tmp_path / "o.json")
