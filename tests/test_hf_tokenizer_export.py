"""tinylm tokenizers as Hugging Face tokenizer directories: `AutoTokenizer.from_pretrained` loads what
`save_hf_tokenizer` (and `tinylm export-tokenizer --hf`, `tinylm export-hf`) write and gives the
same ids on any text; what HF cannot represent exactly is refused, saying why."""

from __future__ import annotations

import json

import pytest
from conftest import examples, make_stories
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.char import CharTokenizer
from tinylm.tokenizers.hf_interop import save_hf_tokenizer
from tinylm.tokenizers.llama2c import Llama2cTokenizer
from tinylm.tokenizers.word import WordTokenizer
from tinylm.tokenizers.word_bpe import WordBPETokenizer

pytestmark = pytest.mark.slow  # transformers takes seconds to import

CORPUS = make_stories(120, seed=7) + ["naïve café, 日本語のテキスト, emoji \U0001f600 1234567 it's"]
SAMPLES = CORPUS[:20] + [
    "",
    " ",
    "a<eos>b <pad>x <sos><unk>",
    "héllo 日本 ☃ \U0001f600 ǅ",
    "  \n\n  x\t\ty\r\n",
    "it's 12345 don't",
    "zzqqj ÆØÅ ﬁ",
    "<0x41> <s>",
]
KINDS = {
    "bpe-gpt2": lambda: BPETokenizer().train(CORPUS, 420),
    "bpe-gpt4": lambda: BPETokenizer(pattern="gpt4").train(CORPUS, 420),
    "bpe-custom": lambda: BPETokenizer(pattern=r"\p{L}+| ?\p{N}").train(CORPUS, 400),
    "char": lambda: CharTokenizer().train(CORPUS, 300),
}


@pytest.fixture(scope="module", params=list(KINDS))
def exported(request, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = KINDS[request.param]()
    out = tmp_path_factory.mktemp("hf-tok")
    save_hf_tokenizer(tok, out, model_max_length=128)
    return tok, AutoTokenizer.from_pretrained(out), out


def test_autotokenizer_gives_the_same_ids(exported):
    tok, hf, _ = exported
    assert len(hf) == tok.vocab_size
    for text in SAMPLES:
        ids = tok.encode(text)  # special strings in text are text, in both
        assert hf(text, add_special_tokens=False).input_ids == ids, text
        assert hf(text).input_ids == ids  # nothing added around the text, as with GPT-2's tokenizer
        assert hf.decode(ids) == tok.decode(ids)


@settings(max_examples=examples(100), deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
def test_autotokenizer_same_ids_on_random_text(exported, text):
    tok, hf, _ = exported
    assert hf(text, add_special_tokens=False).input_ids == tok.encode(text)


def test_special_tokens_have_their_roles(exported):
    tok, hf, out = exported
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id) == (2, 3, 1, 0)
    assert (tok.bos_id, tok.stop_ids[0], tok.unk_id, tok.pad_id) == (2, 3, 1, 0)
    assert hf.model_max_length == 128
    assert hf.decode([2, *tok.encode("a cat"), 3], skip_special_tokens=True) == "a cat"
    assert json.loads((out / "special_tokens_map.json").read_text())["bos_token"] == "<sos>"


def test_the_raw_tokenizer_json_recognises_special_strings(exported):
    """`tokenizers` alone (without tokenizer_config.json) splits special strings out, as tinylm's BPE
    does with allowed_special="all"."""
    from tokenizers import Tokenizer

    tok, _, out = exported
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "a<eos>b <sos>"
    if isinstance(tok, BPETokenizer):
        assert raw.encode(text).ids == tok.encode(text, allowed_special="all")
    else:
        assert raw.encode(text).ids == tok.encode("a") + [3] + tok.encode("b ") + [2]


def test_what_hf_cannot_represent_is_refused(tmp_path):
    word = WordTokenizer(oov="bpe").train(CORPUS, 200, oov_merges=50)  # plain word tokenizers export
    word_bpe = WordBPETokenizer().train(CORPUS, merges=50)
    llama = Llama2cTokenizer(
        [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)] + [b" ", b"a"], [0.0] * 261
    )
    for tok, reason in (
        (word, r"oov=bpe \(pieces for unknown words\) has no Hugging Face equivalent"),
        (word_bpe, "normalises the text"),
        (llama, "no exact Hugging Face equivalent"),
    ):
        with pytest.raises(TinyLMError, match=f"the {tok.type_name} tokenizer cannot be exported.*{reason}"):
            save_hf_tokenizer(tok, tmp_path / tok.type_name)
        assert not (tmp_path / tok.type_name / "tokenizer.json").exists()


def test_export_commands_write_what_autotokenizer_loads(tmp_path, capsys):
    import torch
    from transformers import AutoTokenizer

    from tinylm.config import ModelConfig
    from tinylm.models.checkpoint import save_checkpoint
    from tinylm.models.gpt import GPT

    tok = BPETokenizer().train(CORPUS, 300)
    torch.manual_seed(0)
    # QK-norm and ReLU²: no Hugging Face model class, but its tokenizer exports all the same
    model = GPT(
        ModelConfig(
            vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=4, qk_norm=True, ffn="relu2"
        )
    )
    save_checkpoint(tmp_path / "run" / "checkpoints" / "best", model, tok)
    ckpt = str(tmp_path / "run" / "checkpoints" / "best")
    assert main(["export-hf", "--checkpoint", ckpt, "--out", str(tmp_path / "hf")]) == 2
    assert main(["export-tokenizer", "--checkpoint", ckpt, "--out", str(tmp_path / "tok"), "--hf"]) == 0
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf(SAMPLES[0]).input_ids == tok.encode(SAMPLES[0]) and hf.model_max_length == 32
    assert main(["export-tokenizer", "--checkpoint", ckpt, "--out", str(tmp_path / "own")]) == 0
    from tinylm.tokenizers.io import load_tokenizer

    assert load_tokenizer(tmp_path / "own" / "tokenizer.json").merges == tok.merges

    plain = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=4))
    save_checkpoint(tmp_path / "plain", plain, tok)
    assert main(["export-hf", "--checkpoint", str(tmp_path / "plain"), "--out", str(tmp_path / "hf2")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(tmp_path / "hf2")(SAMPLES[1]).input_ids == tok.encode(SAMPLES[1])
    # a Hugging Face directory without tinylm's file: its own tokenizer is written as it is
    (tmp_path / "hf2" / "tinylm_tokenizer.json").unlink()
    hf_dir = str(tmp_path / "hf2")
    assert main(["export-tokenizer", "--checkpoint", hf_dir, "--out", str(tmp_path / "tok2"), "--hf"]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "tok2")(SAMPLES[2]).input_ids == tok.encode(SAMPLES[2])
    assert main(["export-tokenizer", "--checkpoint", hf_dir, "--out", str(tmp_path / "tok3")]) == 2
    assert "use --hf" in capsys.readouterr().err
