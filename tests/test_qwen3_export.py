"""Qwen3-shaped tinylm models (Llama's layers plus QK-norm with learned gains) travel to Hugging Face
(`Qwen3ForCausalLM`, loaded by the Auto classes without remote code) and to llama.cpp (GGUF, its
`qwen3` graph): the same logits, the same greedy tokens, the tokenizers' ids (a byte-level BPE and
the TinyStories assignment's word-level one with its `<unk>` and specials), and what no format
holds refused by name."""

import json

import numpy as np
import pytest
import torch
from conftest import make_stories
from export_util import PROMPTS, llama_cpp_greedy, llama_cpp_model, llama_gpt, read_gguf, train_llama_run

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.generation import GenerationConfig, generate_many
from tinylm.interop import export_hf, load_hf_dir
from tinylm.interop.gguf_export import export_gguf
from tinylm.interop.llama import meta_to_hf_rows
from tinylm.models.checkpoint import load_checkpoint, save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.hf_interop import save_hf_tokenizer
from tinylm.tokenizers.word import WordTokenizer

CORPUS = make_stories(120, seed=7)
# the assignment's word-level vocabulary (presets/tinystories-assignment.yaml: lowercased), smaller
TOKENIZERS = {
    "bpe": lambda: BPETokenizer().train(CORPUS, 320),
    "word": lambda: WordTokenizer(lowercase=True).train(CORPUS, 150),
}
# an unknown word ("zorblax"), contractions, punctuation, special tokens' names as text, accents
# (composed and decomposed), digits and an underscore
SENTENCES = [
    "Once upon a time there was a little cat.",
    "The zorblax didn't see Lily's dog!",
    'Tom said, "Hello (friend)"; ok? <unk> <sos>x',
    "Café cafe\u0301 naïve 42 snake_case",
]


def qwen3_gpt(vocab: int, tie=False, n_kv_heads=2, seed=0, **overrides) -> GPT:
    overrides = {"n_kv_heads": n_kv_heads, "qk_norm": True, "qk_norm_weight": True, **overrides}
    model = llama_gpt(vocab, tie, seed, **overrides)
    with torch.no_grad():  # gains away from their initial ones: a gain in the wrong order shows
        for block in model.blocks if model.config.qk_norm_weight else []:
            block.attn.q_norm.normal_(1.0, 0.3)
            block.attn.k_norm.normal_(1.0, 0.3)
    return model


def half_split(gain: torch.Tensor) -> np.ndarray:
    """A QK-norm gain in the half-split rotary layout (one head's rows, as Hugging Face orders them)."""
    return meta_to_hf_rows(gain.detach()[:, None], 1)[:, 0].numpy()


# ------------------------------------------------------------------------------------- GGUF files
def test_gguf_file_is_llama_cpp_qwen3_with_half_split_queries_and_keys(tmp_path):
    """llama.cpp's qwen3 graph rotates half-split pairs (NEOX rope): q and k rows and the QK-norm
    gains are written in that order, unlike its llama graph's."""
    model, bpe = qwen3_gpt(330), TOKENIZERS["bpe"]()
    fields, tensors = read_gguf(export_gguf(model, tmp_path / "m.gguf", bpe, "f32"))
    assert fields["general.architecture"] == "qwen3"
    assert (fields["qwen3.attention.head_count"], fields["qwen3.attention.head_count_kv"]) == (4, 2)
    assert (fields["qwen3.attention.key_length"], fields["qwen3.rope.dimension_count"]) == (8, 8)
    assert fields["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    attn = model.blocks[1].attn
    q, k, _ = attn.qkv.weight.detach().split([32, 16, 16])
    expected = {
        "blk.1.attn_q.weight": meta_to_hf_rows(q, 4).numpy(),
        "blk.1.attn_k.weight": meta_to_hf_rows(k, 2).numpy(),
        "blk.1.attn_q_norm.weight": half_split(attn.q_norm),
        "blk.1.attn_k_norm.weight": half_split(attn.k_norm),
    }
    for name, w in expected.items():
        assert np.array_equal(np.asarray(tensors[name].data).reshape(w.shape), w), name
    assert not np.array_equal(expected["blk.1.attn_q_norm.weight"], attn.q_norm.detach().numpy())
    assert len(tensors) == 2 + 1 + 2 * 11  # embeddings, final norm, untied output; 11 tensors a layer
    # a QK-norm without gain at Qwen3's epsilon: gains of ones
    _, plain = read_gguf(export_gguf(qwen3_gpt(330, qk_norm_weight=False, norm_eps=1e-6), tmp_path / "p.gguf", bpe))
    assert np.array_equal(plain["blk.0.attn_k_norm.weight"].data, np.ones(8, np.float32))


def test_word_tokenizer_becomes_a_gguf_wordpiece_vocabulary_at_tinylm_ids(tmp_path):
    """Each word a whole WordPiece token "▁word" (llama.cpp looks words up with that phantom space),
    the specials by name at their ids wherever the tokenizer puts them, <unk> the unknown token."""
    tok = WordTokenizer(special_tokens=["<sos>", "<eos>", "<pad>", "<unk>"], specials_at="end").train(CORPUS, 100)
    fields, _ = read_gguf(export_gguf(qwen3_gpt(tok.vocab_size + 2), tmp_path / "w.gguf", tok))
    words = [f"\u2581{w}" for w in tok.words]
    assert fields["tokenizer.ggml.model"] == "bert"
    assert fields["tokenizer.ggml.tokens"] == words + ["<sos>", "<eos>", "<pad>", "<unk>", "[PAD100]", "[PAD101]"]
    assert fields["tokenizer.ggml.token_type"] == [1] * 96 + [3, 3, 3, 2, 5, 5]
    ids = ("bos", "eos", "padding", "unknown", "seperator")
    assert [fields[f"tokenizer.ggml.{role}_token_id"] for role in ids] == [96, 97, 98, 99, 97]
    assert (fields["tokenizer.ggml.normalizer.lowercase"], fields["tokenizer.ggml.normalizer.strip_accents"]) == (
        False,
        False,
    )
    assert fields["tokenizer.ggml.add_sep_token"] is False and fields["tokenizer.ggml.add_bos_token"] is True


# --------------------------------------------------------------------------------------- refusals
def test_what_no_format_holds_is_refused_by_name(tmp_path):
    bpe = TOKENIZERS["bpe"]()
    cases = {
        r"model\.value_embeddings=alternate \(no other format has value embeddings\)": dict(
            value_embeddings="alternate"
        ),
        r"model\.logit_softcap=30\.0": dict(logit_softcap=30.0),
        # tinylm's gainless QK-norm has epsilon 1e-6, Qwen3 one epsilon for every norm: measured
        # 1.0e-4 and 1.1e-4 of logits on such random models at norm_eps 1e-5, so it is refused
        r"model\.qk_norm=true without model\.qk_norm_weight \(tinylm's gainless QK-norm uses epsilon 1e-06, "
        r"Qwen3 model\.norm_eps=1e-05 for every norm; train with model\.qk_norm_weight=true, or "
        r"model\.norm_eps=1e-6\)": dict(qk_norm_weight=False),
    }
    for named, overrides in cases.items():
        model = qwen3_gpt(330, **overrides)
        with pytest.raises(TinyLMError, match=f"^this model cannot be written as a Hugging Face Qwen3 model: {named}$"):
            export_hf(model, tmp_path / "hf")
        with pytest.raises(TinyLMError, match=f"^llama.cpp's qwen3 architecture has no equivalent of {named};"):
            export_gguf(model, tmp_path / "m.gguf", bpe)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.gguf").exists()
    word = WordTokenizer(oov="bpe").train(CORPUS[:10], 60, oov_merges=20)
    with pytest.raises(TinyLMError, match="the word tokenizer cannot be exported to Hugging Face: oov=bpe"):
        save_hf_tokenizer(word, tmp_path / "tok")
    assert not (tmp_path / "tok").exists()


# --------------------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.slow  # transformers takes seconds to import
@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("tie, n_kv_heads", [(False, 2), (True, 2), (False, 4), (True, 1)])
def test_export_hf_writes_qwen3_that_transformers_loads_with_the_same_logits(
    transformers, tmp_path, capsys, kind, tie, n_kv_heads
):
    tok = TOKENIZERS[kind]()
    model = qwen3_gpt(tok.vocab_size, tie=tie, n_kv_heads=n_kv_heads)
    save_checkpoint(tmp_path / "ckpt", model, tok)
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "wrote a Hugging Face Qwen3 model" in out and "AutoTokenizer loads it" in out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["tie_word_embeddings"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        tie,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.num_key_value_heads == n_kv_heads
    rows = [[tok.bos_id] + tok.encode(s) for s in SENTENCES]
    assert [[hf_tok.bos_token_id] + hf_tok(s).input_ids for s in SENTENCES] == rows
    width = min(map(len, rows))
    x = torch.cat([torch.tensor([r[:width] for r in rows]), torch.randint(0, tok.vocab_size, (2, width))])
    back = load_hf_dir(tmp_path / "hf")  # and into tinylm again: the same weights, gains included
    assert back.config.qk_norm_weight and all(
        torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items()
    )
    with torch.no_grad():
        assert (hf(x).logits - model(x)[0]).abs().max() < 1e-4  # measured: 0.9e-7 to 1.8e-7


@pytest.mark.slow  # transformers takes seconds to import
def test_gainless_qk_norm_at_qwen3_epsilon_travels_as_gains_of_ones(transformers, tmp_path):
    model = qwen3_gpt(300, qk_norm_weight=False, norm_eps=1e-6)
    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(hf.model.layers[0].self_attn.q_norm.weight, torch.ones(8))
    x = torch.randint(0, 300, (3, 20))
    with torch.no_grad():
        assert (hf(x).logits - model(x)[0]).abs().max() < 1e-4  # measured: 1.2e-7


@pytest.mark.slow  # transformers takes seconds to import
@pytest.mark.parametrize(
    "options",
    [
        dict(lowercase=True),  # the assignment's
        dict(special_tokens=["<sos>", "<eos>", "<pad>", "<unk>"], specials_at="end"),
        dict(lowercase=True, keep_punctuation=False),
    ],
)
def test_autotokenizer_gives_the_word_tokenizers_ids(transformers, tmp_path, options):
    """Unknown words become <unk>, contractions stay whole, punctuation and the specials' names in
    text are split as tinylm splits them; decoding re-joins words as tinylm does."""
    tok = WordTokenizer(**options).train(CORPUS, 60)
    save_hf_tokenizer(tok, tmp_path, model_max_length=64)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(hf) == tok.vocab_size
    roles = (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id)
    assert roles == (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id)
    for text in SENTENCES + CORPUS[:5] + ["", "ÆØÅ İstanbul ǅ ½ x\x1cy"]:
        ids = tok.encode(text)
        assert hf(text).input_ids == ids, text
        assert hf.decode(ids) == tok.decode(ids), text
    assert tok.unk_id in tok.encode(SENTENCES[1]) and len(tok.encode("didn't")) == 1
    from tokenizers import Tokenizer  # the bare tokenizer.json recognises the specials' names

    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert raw.encode("a cat<eos>").ids == tok.encode("a cat") + [tok.eos_id]
    spacy = WordTokenizer(splitter="spacy").train(CORPUS[:10], 60)
    with pytest.raises(TinyLMError, match="the word tokenizer cannot be exported to Hugging Face: splitter=spacy"):
        save_hf_tokenizer(spacy, tmp_path / "spacy")


# -------------------------------------------------------------------------------------- llama.cpp
@pytest.fixture(scope="module", params=list(TOKENIZERS))
def qwen3_run(request, tmp_path_factory):
    """A Qwen3-shaped run trained briefly with each tokenizer (the word one capped at 100 ids, so
    the stories hold unknown words)."""
    word = {"type": "word", "lowercase": True, "vocab_size": 100}
    return train_llama_run(
        tmp_path_factory.mktemp(request.param),
        tokenizer=word if request.param == "word" else None,
        qk_norm=True,
        qk_norm_weight=True,
        context_length=128,
    )


@pytest.mark.slow  # trains a tiny model (~10 s) per tokenizer
def test_llama_cpp_gives_tinylms_logits_and_greedy_tokens(qwen3_run, tmp_path):
    model, tok, _ = load_checkpoint(qwen3_run)
    ids = [tok.bos_id] + tok.encode(make_stories(1)[0])[:60]
    # the Llama export test's tolerances; measured (BPE, word): 1.2e-6, 9.5e-7; 1.4e-3, 1.8e-3; 0.027, 0.050
    for dtype, tolerance in (("f32", 1e-4), ("f16", 1e-2), ("q8_0", 0.1)):
        path = tmp_path / f"model-{dtype}.gguf"
        assert main(["export-gguf", "--checkpoint", str(qwen3_run), "--out", str(path), "--dtype", dtype]) == 0
        llm = llama_cpp_model(path, n_ctx=128, logits_all=True)
        llm.eval(ids)
        with torch.no_grad():
            expected = model(torch.tensor([ids]))[0][0].numpy()
        assert np.abs(np.array(llm.scores[: len(ids)]) - expected).max() < tolerance, dtype
        llm.close()
    llm = llama_cpp_model(tmp_path / "model-f32.gguf", n_ctx=128)
    for prompt in PROMPTS:  # 64 tokens, through <eos> and past it
        ids = [tok.bos_id] + tok.encode(prompt)
        ours = generate_many(model, [ids], GenerationConfig(max_new_tokens=64, temperature=0))[0].tokens
        assert llama_cpp_greedy(llm, ids, 64, ()) == ours and len(ours) == 64
    llm.close()


@pytest.mark.slow  # shares the trained models above
def test_llama_cpp_tokenizes_as_tinylm_except_contractions_of_words(qwen3_run, tmp_path):
    """The BPE's ids exactly; the word vocabulary's (llama.cpp's WordPiece) on words, punctuation and
    unknown words, but it splits a contraction at its apostrophe where tinylm keeps it whole."""
    model, tok, _ = load_checkpoint(qwen3_run)
    llm = llama_cpp_model(export_gguf(model, tmp_path / "m.gguf", tok), vocab_only=True)
    assert (llm.token_bos(), llm.token_eos(), llm.n_vocab()) == (tok.bos_id, tok.eos_id, tok.vocab_size)
    for text in PROMPTS + ["Lily saw a zorblax, and the dog ran fast!", "Story number 59."]:
        if isinstance(tok, BPETokenizer):
            assert llm.tokenize(text.encode(), add_bos=True) == [tok.bos_id] + tok.encode(text)
            continue
        ours = tok.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False) == ours, text
        assert llm.tokenize(text.encode(), add_bos=True) == [tok.bos_id, *ours, tok.eos_id]  # WordPiece's ends
    if isinstance(tok, WordTokenizer):
        assert tok.unk_id in tok.encode("Lily saw a zorblax") and len(tok.encode("didn't")) == 1
        assert llm.tokenize(b"didn't", add_bos=False) == tok.encode("didn ' t")
    llm.close()
