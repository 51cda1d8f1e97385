"""llama2.c .bin reader checked against transformers' LlamaForCausalLM written in llama2.c format."""

import json
import struct

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tinylm.cli import main  # noqa: E402
from tinylm.errors import TinyLMError  # noqa: E402
from tinylm.evaluation.perplexity import evaluate_texts  # noqa: E402
from tinylm.generation import GenerationConfig, generate_many  # noqa: E402
from tinylm.interop import load_any_checkpoint  # noqa: E402
from tinylm.interop.llama2c import load_llama2c, save_llama2c  # noqa: E402
from tinylm.tokenizers.llama2c import Llama2cTokenizer  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # imports transformers and its model code: ~5 s before the first test
    pytest.mark.usefixtures("one_thread"),
]  # see conftest.one_thread

transformers.logging.set_verbosity_error()


def hf_llama(vocab=300, tie=False, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def write_llama2c(hf, path):
    """The legacy llama2.c export, written here from HF's weights (HF rotates half-split pairs;
    llama2.c interleaved pairs, so q/k rows are un-permuted per head)."""
    c = hf.config
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    head = c.hidden_size // c.num_attention_heads

    def unpermute(w, heads):
        return w.reshape(heads, 2, head // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    L = c.num_hidden_layers
    layer = lambda name: [sd[f"model.layers.{i}.{name}"] for i in range(L)]  # noqa: E731
    tensors = [
        sd["model.embed_tokens.weight"],
        *layer("input_layernorm.weight"),
        *[unpermute(w, c.num_attention_heads) for w in layer("self_attn.q_proj.weight")],
        *[unpermute(w, c.num_key_value_heads) for w in layer("self_attn.k_proj.weight")],
        *layer("self_attn.v_proj.weight"),
        *layer("self_attn.o_proj.weight"),
        *layer("post_attention_layernorm.weight"),
        *layer("mlp.gate_proj.weight"),
        *layer("mlp.down_proj.weight"),
        *layer("mlp.up_proj.weight"),
        sd["model.norm.weight"],
        torch.zeros(c.max_position_embeddings, head // 2),
        torch.zeros(c.max_position_embeddings, head // 2),
    ]
    if not c.tie_word_embeddings:
        tensors.append(sd["lm_head.weight"])
    vocab = c.vocab_size if c.tie_word_embeddings else -c.vocab_size
    with open(path, "wb") as fh:
        fh.write(
            struct.pack(
                "<7i",
                c.hidden_size,
                c.intermediate_size,
                L,
                c.num_attention_heads,
                c.num_key_value_heads,
                vocab,
                c.max_position_embeddings,
            )
        )
        for t in tensors:
            fh.write(t.numpy().astype("<f4").tobytes())
    return path


def toy_tokenizer(vocab=300) -> Llama2cTokenizer:
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    words = [b" ", b" t", b"he", b" the", b" a", b"in", b" in", b"an", b" and", b"ll", b" h", b" hi", b"on", b"ce"]
    pieces += words + [f"#{i}".encode() for i in range(vocab - len(pieces) - len(words))]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    return Llama2cTokenizer(pieces, scores)


@pytest.mark.parametrize("tie", [False, True])
def test_reader_logits_equal_transformers_llama(tmp_path, tie):
    hf = hf_llama(tie=tie)
    model = load_llama2c(write_llama2c(hf, tmp_path / "m.bin"))
    cfg = model.config
    assert (cfg.n_kv_heads, cfg.tie_weights, cfg.norm, cfg.ffn, cfg.positions, cfg.bias) == (
        2,
        tie,
        "rmsnorm",
        "swiglu",
        "rope",
        False,
    )
    x = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        assert torch.allclose(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)
    # greedy decoding with the cache is identical to transformers' generate
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([[1, 50, 60, 70]]),
            attention_mask=torch.ones(1, 4, dtype=torch.long),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    ours = generate_many(model, [[1, 50, 60, 70]], GenerationConfig(max_new_tokens=40, temperature=0))[0].tokens
    assert ours == out[0, 4:].tolist()


def test_writer_round_trip_and_bad_files(tmp_path):
    model = load_llama2c(write_llama2c(hf_llama(tie=False), tmp_path / "a.bin"))
    save_llama2c(model, tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes()[:28] == (tmp_path / "b.bin").read_bytes()[:28]
    again = load_llama2c(tmp_path / "b.bin")
    for (k, v), (_, w) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(v, w), k
    (tmp_path / "bad.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:-4])
    with pytest.raises(TinyLMError, match="llama2.c"):
        load_llama2c(tmp_path / "bad.bin")
    with pytest.raises(TinyLMError, match="--tokenizer"):
        load_any_checkpoint(tmp_path / "a.bin")


def test_cli_generate_llama2c_prints_decoded_prompt_and_greedy_continuation(tmp_path, capsys):
    hf = hf_llama(tie=True, seed=3)
    write_llama2c(hf, tmp_path / "m.bin")
    tok = toy_tokenizer()
    tok.save(tmp_path / "tok.bin")
    model, tokenizer, _ = load_any_checkpoint(tmp_path / "m.bin", tmp_path / "tok.bin")
    assert tokenizer.bos_id == 1 and tokenizer.stop_ids == (1, 2)
    prompt = "hi the cat"
    ids = [1] + tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=[1, 2],
            pad_token_id=0,
        )
    new = out[0, len(ids) :].tolist()
    new = new[: min([new.index(s) for s in (1, 2) if s in new], default=len(new))]
    code = main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "m.bin"),
            "--tokenizer",
            str(tmp_path / "tok.bin"),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            "20",
            "--json",
        ]
    )
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert row["token_ids"] == new and row["text"] == tokenizer.decode(ids + new)
    assert row["text"].startswith(prompt)
    # streaming prints the same text
    main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "m.bin"),
            "--tokenizer",
            str(tmp_path / "tok.bin"),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            "20",
            "--stream",
        ]
    )
    assert capsys.readouterr().out.strip("\n") == row["text"].strip("\n")


def test_evaluation_adapter_scores_from_bos(tmp_path):
    hf = hf_llama(tie=True, seed=4)
    write_llama2c(hf, tmp_path / "m.bin")
    toy_tokenizer().save(tmp_path / "tok.bin")
    model, tokenizer, _ = load_any_checkpoint(tmp_path / "m.bin", tmp_path / "tok.bin")
    texts = ["hi the cat and the hat", "in the end"]
    m = evaluate_texts(model, tokenizer, texts)
    nll = 0.0
    for t in texts:
        ids = torch.tensor([[1] + tokenizer.encode(t)])
        with torch.no_grad():
            logits = hf(ids).logits[0, :-1]
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    assert m["tokens"] == sum(len(tokenizer.encode(t)) for t in texts)
    assert m["nll"] == pytest.approx(nll, rel=1e-5)
    assert m["bpb"] == pytest.approx(nll / (np.log(2) * sum(len(t.encode()) for t in texts)), rel=1e-5)
