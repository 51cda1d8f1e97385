"""export-gguf: every tensor and metadata key read back with the `gguf` package's reader, f16 and Q8_0
within their rounding, refusals by name; and llama.cpp itself (llama-cpp-python) decoding the
same greedy tokens as `tinylm generate`."""

import json

import gguf
import numpy as np
import pytest
import torch
from conftest import make_stories
from export_util import (
    PROMPTS,
    llama_cpp_greedy,
    llama_cpp_model,
    llama_gpt,
    read_gguf,
    separate_matrices,
    train_llama_run,
)

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.generation import GenerationConfig, generate_many
from tinylm.interop import load_any_checkpoint
from tinylm.interop.gguf_export import export_gguf
from tinylm.interop.llama2c_export import bpe_to_llama2c
from tinylm.models.checkpoint import load_checkpoint, save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.tokenizers import CharTokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.hf_interop import byte_to_unicode
from tinylm.tokenizers.io import load_tokenizer
from tinylm.tokenizers.llama2c import Llama2cTokenizer

LAYER = {
    "attn_norm": "norm1",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.out_proj",
    "ffn_norm": "norm2",
    "ffn_gate": "ffn.gate",
    "ffn_up": "ffn.up",
    "ffn_down": "ffn.down",
}


def tinylm_weights(model: GPT) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's tensor names, mapped here by hand."""
    sd = separate_matrices(model)
    out = {"token_embd.weight": sd["tok_emb.weight"], "output_norm.weight": sd["norm_f.weight"]}
    if not model.config.tie_weights:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(model.config.n_layers):
        out.update({f"blk.{i}.{theirs}.weight": sd[f"blocks.{i}.{ours}.weight"] for theirs, ours in LAYER.items()})
    return out


def test_f32_file_holds_every_tensor_and_metadata_key(tmp_path):
    bpe = BPETokenizer().train(make_stories(), 320)
    model = llama_gpt()
    fields, tensors = read_gguf(export_gguf(model, tmp_path / "m.gguf", bpe, "f32"))
    weights = tinylm_weights(model)
    assert sorted(tensors) == sorted(weights)
    for name, w in weights.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == list(reversed(w.shape)), name
        assert np.array_equal(np.asarray(t.data).reshape(w.shape), w), name
    visible = byte_to_unicode()
    spelled = ["".join(visible[b] for b in raw) for raw in bpe.token_bytes[4:]]
    expected = {
        "general.architecture": "llama",
        "general.name": "tinylm",
        "general.file_type": 0,
        "general.quantization_version": 2,
        "llama.context_length": 64,
        "llama.embedding_length": 32,
        "llama.block_count": 2,
        "llama.feed_forward_length": 44,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.key_length": 8,
        "llama.attention.value_length": 8,
        "llama.rope.dimension_count": 8,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
        "llama.vocab_size": 330,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["<pad>", "<unk>", "<sos>", "<eos>"]
        + spelled
        + [f"[PAD{i}]" for i in range(320, 330)],
        "tokenizer.ggml.token_type": [3] * 4 + [1] * 316 + [5] * 10,
        "tokenizer.ggml.scores": [0.0] * 330,
        "tokenizer.ggml.merges": [f"{spelled[a - 4]} {spelled[b - 4]}" for a, b in bpe.merges],
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 1,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    assert fields == expected
    assert spelled[ord(" ")] == "\u0120" and len(expected["tokenizer.ggml.merges"]) == 60


def test_f16_and_q8_0_within_their_rounding(tmp_path):
    model = llama_gpt(tie=True)
    weights = tinylm_weights(model)
    _, f16 = read_gguf(export_gguf(model, tmp_path / "h.gguf", BPETokenizer().train(make_stories(), 300), "f16"))
    _, q8 = read_gguf(export_gguf(model, tmp_path / "q.gguf", BPETokenizer().train(make_stories(), 300), "q8_0"))
    Q = gguf.GGMLQuantizationType
    for name, w in weights.items():
        if w.ndim == 1:  # norm gains stay float32 in every file
            assert f16[name].tensor_type == q8[name].tensor_type == Q.F32, name
            continue
        assert f16[name].tensor_type == Q.F16 and np.array_equal(f16[name].data.reshape(w.shape), w.astype(np.float16))
        q = q8[name]
        if w.shape[1] % 32:  # ffn_down's rows are d_ff = 44 long: no whole Q8_0 blocks, written in float16
            assert q.tensor_type == Q.F16 and name.endswith("ffn_down.weight"), name
            continue
        assert q.tensor_type == Q.Q8_0, name
        back = gguf.quants.dequantize(q.data, q.tensor_type).reshape(w.shape)
        blocks, err = w.reshape(-1, 32), np.abs(back - w).reshape(-1, 32)
        scale = np.abs(blocks).max(1, keepdims=True) / 127  # one float16 scale per 32 weights, int8 values
        assert (err <= scale * (0.5 + 127 * 2.0**-11)).all() and err.max() > 0, name
    assert "output.weight" not in q8  # tied: llama.cpp reuses token_embd


def test_llama2c_tokenizer_becomes_gguf_llama_vocabulary(tmp_path):
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    pieces += [b" ", b" t", b"he", b" the", b"in"]
    tok = Llama2cTokenizer(pieces, [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0])
    fields, tensors = read_gguf(export_gguf(llama_gpt(vocab=266, tie=True), tmp_path / "m.gguf", tok, "f32"))
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields["tokenizer.ggml.tokens"][:4] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert fields["tokenizer.ggml.tokens"][259:] == [
        "\u2581",
        "\u2581t",
        "he",
        "\u2581the",
        "in",
        "[PAD264]",
        "[PAD265]",
    ]
    assert fields["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6] and fields["tokenizer.ggml.token_type"][259] == 1
    assert fields["tokenizer.ggml.scores"][259:264] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert "tokenizer.ggml.merges" not in fields and "output.weight" not in tensors
    # a BPE brought to llama2.c's layout spells its bytes as themselves: printable ones stay text
    converted, _ = bpe_to_llama2c(BPETokenizer().train(make_stories(), 300), 300)
    fields, _ = read_gguf(export_gguf(llama_gpt(vocab=300), tmp_path / "c.gguf", converted, "f32"))
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert [tokens[3 + b] for b in b" a\n\xff"] == ["\u2581", "a", "<0x0A>", "<0xFF>"]
    assert [types[3 + b] for b in b" a\n\xff"] == [1, 1, 6, 6] and tokens[1:3] == ["<s>", "</s>"]


def test_options_without_a_gguf_equivalent_are_refused_by_name(tmp_path):
    bpe = BPETokenizer().train(make_stories(), 300)
    cases = {
        "model.ffn=relu2": dict(ffn="relu2", d_ff=64),
        "model.qk_norm=true": dict(qk_norm=True),
        "model.logit_softcap=30.0": dict(logit_softcap=30.0),
        "model.norm=layernorm": dict(norm="layernorm"),
        "model.positions=learned": dict(positions="learned"),
        "model.bias=true": dict(bias=True),
        "model.value_embeddings=alternate": dict(value_embeddings="alternate"),
    }
    for name, overrides in cases.items():
        with pytest.raises(TinyLMError, match=name.replace(".", r"\.")):
            export_gguf(llama_gpt(**overrides), tmp_path / "m.gguf", bpe)
    with pytest.raises(TinyLMError, match="'gpt4'; llama.cpp has a matching pre-tokenizer only for gpt2"):
        export_gguf(llama_gpt(), tmp_path / "m.gguf", BPETokenizer(pattern="gpt4").train(make_stories(), 300))
    with pytest.raises(TinyLMError, match="char tokenizer has no GGUF equivalent"):
        export_gguf(llama_gpt(), tmp_path / "m.gguf", CharTokenizer().train(["abc"]))
    with pytest.raises(TinyLMError, match="q4_0"):
        export_gguf(llama_gpt(), tmp_path / "m.gguf", bpe, "q4_0")


def test_cli_export_gguf(tmp_path, capsys):
    bpe = BPETokenizer().train(make_stories(), 300)
    save_checkpoint(tmp_path / "ckpt", llama_gpt(vocab=300), bpe)
    assert (
        main(
            [
                "export-gguf",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "m.gguf"),
                "--dtype",
                "q8_0",
            ]
        )
        == 0
    )
    assert f"wrote a llama.cpp GGUF model (q8_0, 33,952 parameters) to {tmp_path / 'm.gguf'}" in capsys.readouterr().out
    fields, _ = read_gguf(tmp_path / "m.gguf")
    assert fields["general.file_type"] == 7


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return train_llama_run(tmp_path_factory.mktemp("llama"))


@pytest.mark.slow  # trains a tiny model (~10 s, shared by the next test)
def test_llama_cpp_decodes_the_same_greedy_tokens_as_tinylm(llama_run, tmp_path, capsys):
    bpe = load_tokenizer(llama_run / "tokenizer.json")
    model = load_checkpoint(llama_run)[0]
    for dtype, tolerance in (("f32", 1e-4), ("f16", 1e-2), ("q8_0", 0.1)):  # measured: 1.2e-6, 9e-4, 0.017
        path = tmp_path / f"model-{dtype}.gguf"
        assert main(["export-gguf", "--checkpoint", str(llama_run), "--out", str(path), "--dtype", dtype]) == 0
        llm = llama_cpp_model(path, logits_all=True)
        ids = [2] + bpe.encode(make_stories(1)[0])[:60]
        llm.eval(ids)
        with torch.no_grad():
            expected = model(torch.tensor([ids]))[0][0].numpy()
        assert np.abs(np.array(llm.scores[: len(ids)]) - expected).max() < tolerance, dtype
        llm.close()
    capsys.readouterr()
    llm = llama_cpp_model(tmp_path / "model-f32.gguf")
    for prompt in PROMPTS:
        assert (
            main(
                [
                    "generate",
                    "--checkpoint",
                    str(llama_run),
                    "--prompt",
                    prompt,
                    "--temperature",
                    "0",
                    "--max-new-tokens",
                    "40",
                    "--json",
                ]
            )
            == 0
        )
        ours = json.loads(capsys.readouterr().out)
        ids = llm.tokenize(prompt.encode(), add_bos=True)
        assert ids == [2] + bpe.encode(prompt)  # llama.cpp's gpt-2 pre-tokenizer splits as tinylm's BPE does
        theirs = llama_cpp_greedy(llm, ids, len(ours["token_ids"]), (llm.token_eos(),))
        assert theirs == ours["token_ids"] and len(theirs) > 10
        assert prompt + llm.detokenize(theirs).decode() == ours["text"]
    llm.close()


@pytest.mark.slow
def test_llama_cpp_reads_a_llama2c_vocabulary_as_run_c_encodes(llama_run, tmp_path, capsys):
    """The model in llama2.c's layout (export-llama2c), then as GGUF with its sentencepiece-style
    vocabulary: llama.cpp's tokenizer gives run.c's ids and decodes the same greedy tokens."""
    assert main(["export-llama2c", "--checkpoint", str(llama_run), "--out", str(tmp_path / "model.bin")]) == 0
    model, tok, _ = load_any_checkpoint(tmp_path / "model.bin", tmp_path / "tok320.bin")
    assert (
        main(
            [
                "export-gguf",
                "--checkpoint",
                str(tmp_path / "model.bin"),
                "--tokenizer",
                str(tmp_path / "tok320.bin"),
                "--out",
                str(tmp_path / "model.gguf"),
            ]
        )
        == 0
    )
    llm = llama_cpp_model(tmp_path / "model.gguf")
    for prompt in PROMPTS:
        ids = tok.encode(prompt, bos=True)
        assert llm.tokenize(prompt.encode(), add_bos=True) == ids
        ours = generate_many(model, [ids], GenerationConfig(max_new_tokens=40, temperature=0, stop_ids=(1, 2)))
        assert llama_cpp_greedy(llm, ids, 40, (1, 2)) == ours[0].tokens
    llm.close()
