"""export-llama2c: the version-0/1 checkpoint layouts, a tinylm BPE as a llama2.c tokenizer.bin, and
llama2.c's own run.c (tests/vendor/llama2c, compiled here) printing what `tinylm generate` prints."""

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import make_stories
from export_util import PROMPTS, separate_matrices, train_llama_run
from export_util import llama_gpt as small_llama_gpt

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.interop import load_any_checkpoint
from tinylm.interop.llama2c import load_llama2c, read_header, save_llama2c
from tinylm.interop.llama2c_export import bpe_to_llama2c, export_llama2c, reorder_vocabulary
from tinylm.models.gpt import GPT
from tinylm.tokenizers import CharTokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.llama2c import Llama2cTokenizer

RUN_C = Path(__file__).parent / "vendor" / "llama2c" / "run.c"


def llama_gpt(tie=False, seed=0, **overrides) -> GPT:
    model = small_llama_gpt(330, tie, seed, **overrides)
    with torch.no_grad():  # norm gains away from 1, so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def version1_bytes(model: GPT) -> bytes:
    """llama2.c export.py's version1_export layout, written out independently of tinylm's writer."""
    cfg, sd = model.config, separate_matrices(model)
    layers = lambda name: [sd[f"blocks.{i}.{name}"] for i in range(cfg.n_layers)]  # noqa: E731
    head = struct.pack(
        "<Ii7i",
        0x616B3432,
        1,
        cfg.d_model,
        cfg.d_ff,
        cfg.n_layers,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.vocab_size,
        cfg.context_length,
    ) + struct.pack("B", int(cfg.tie_weights))
    weights = [
        *layers("norm1.weight"),
        *layers("norm2.weight"),
        sd["norm_f.weight"],
        sd["tok_emb.weight"],
        *layers("attn.q_proj.weight"),
        *layers("attn.k_proj.weight"),
        *layers("attn.v_proj.weight"),
        *layers("attn.out_proj.weight"),
        *layers("ffn.gate.weight"),
        *layers("ffn.down.weight"),
        *layers("ffn.up.weight"),
    ] + ([] if cfg.tie_weights else [sd["lm_head.weight"]])
    return head.ljust(256, b"\0") + b"".join(w.astype("<f4").tobytes() for w in weights)


@pytest.mark.parametrize("tie", [False, True])
def test_version1_is_export_py_layout_and_both_versions_read_back(tmp_path, tie):
    model = llama_gpt(tie=tie)
    v1 = save_llama2c(model, tmp_path / "v1.bin", version=1)
    assert v1.read_bytes() == version1_bytes(model)
    v0 = save_llama2c(model, tmp_path / "v0.bin", version=0)
    x = torch.randint(0, 330, (2, 40))
    with torch.no_grad():
        expected = model(x)[0]
        for path, version in ((v0, 0), (v1, 1)):
            assert read_header(path)["version"] == version
            assert torch.equal(load_llama2c(path)(x)[0], expected)
    # version 1 has no freq_cis tables: 64 positions x 8 floats fewer
    assert v0.stat().st_size - 28 - (v1.stat().st_size - 256) == 4 * 64 * 8


def test_bpe_becomes_llama2c_layout_with_the_same_ids_and_function(tmp_path):
    bpe = BPETokenizer().train(make_stories(), 320)
    model = llama_gpt()
    tok, order = bpe_to_llama2c(bpe, model.config.vocab_size)
    assert order[:4] == [1, 2, 3, 4] and order[-1] == 0 and len(order) == 330
    assert tok.pieces[1:3] == [b"<sos>", b"<eos>"] and tok.pieces[3 + ord("a")] == b"a" and tok.pieces[3] == b"<0x00>"
    assert tok.pieces[259] == bpe.token_bytes[260] and tok.scores[259:262] == [0.0, -1.0, -2.0]
    assert tok.pieces[320] == b"<unused321>" and tok.pieces[-1] == b"<pad>"
    # run.c's encoding (reproduced by Llama2cTokenizer): BOS, then the text with its dummy-prefix space
    for prompt in PROMPTS:
        assert tok.encode(prompt, bos=True) == [1] + [i - 1 for i in bpe.encode(" " + prompt)]
        assert tok.decode(tok.encode(prompt, bos=True)) == prompt
    moved = reorder_vocabulary(model, order)
    ids = torch.tensor([bpe.encode(" " + PROMPTS[0])])
    with torch.no_grad():
        assert torch.equal(moved(ids - 1)[0], model(ids)[0][..., order])
    # the files read back through tinylm's llama2.c import: same logits, same tokenizer
    model_path, tok_path = export_llama2c(model, bpe, tmp_path / "m.bin", tmp_path / "tok.bin")
    back, back_tok, _ = load_any_checkpoint(model_path, tok_path)
    assert back_tok.pieces == tok.pieces and back_tok.scores == pytest.approx(tok.scores)
    with torch.no_grad():
        assert torch.equal(back(ids - 1)[0], model(ids)[0][..., order])


def test_refusals_name_what_llama2c_lacks(tmp_path):
    bpe = BPETokenizer().train(make_stories(), 300)
    cases = {
        "qk_norm": dict(qk_norm=True),
        "logit_softcap": dict(logit_softcap=30.0),
        "rope_theta": dict(rope_theta=500000.0),
        "norm_eps": dict(norm_eps=1e-6),
        "d_attn": dict(d_attn=64),
        "model.ffn=relu2": dict(ffn="relu2"),
        "model.value_embeddings=all": dict(value_embeddings="all"),
    }
    for name, overrides in cases.items():
        with pytest.raises(TinyLMError, match=name):
            export_llama2c(llama_gpt(**overrides), bpe, tmp_path / "m.bin", tmp_path / "t.bin")
    with pytest.raises(TinyLMError, match="char tokenizer has no llama2.c equivalent"):
        export_llama2c(llama_gpt(), CharTokenizer().train(["abc"]), tmp_path / "m.bin", tmp_path / "t.bin")
    with pytest.raises(TinyLMError, match="version 2"):
        save_llama2c(llama_gpt(), tmp_path / "m.bin", version=2)
    (tmp_path / "q.bin").write_bytes(struct.pack("<Ii", 0x616B3432, 2) + bytes(300))
    with pytest.raises(TinyLMError, match="version-2 checkpoint"):
        load_llama2c(tmp_path / "q.bin")


@pytest.fixture(scope="module")
def run_c(tmp_path_factory) -> Path:
    """llama2.c's run.c, compiled with the system C compiler (as its Makefile's `make run` does)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc) is needed to build llama2.c's run.c"
    exe = tmp_path_factory.mktemp("llama2c") / "run"
    subprocess.run([cc, "-O3", "-o", str(exe), str(RUN_C), "-lm"], check=True, capture_output=True)
    return exe


def generate_json(capsys, *argv) -> dict:
    assert main(["generate", *map(str, argv), "--temperature", "0", "--max-new-tokens", "40", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # trains a tiny model (~10 s) and compiles run.c (~1 s)
def test_run_c_prints_what_tinylm_generate_prints(tmp_path, run_c, capsys):
    run = train_llama_run(tmp_path)
    out = tmp_path / "export"
    assert main(["export-llama2c", "--checkpoint", str(run), "--out", str(out / "model.bin")]) == 0
    assert "version-0" in capsys.readouterr().out
    model_bin, tok_bin = out / "model.bin", out / "tok320.bin"
    tok = Llama2cTokenizer.from_file(tok_bin)
    for prompt in PROMPTS:
        ours = generate_json(capsys, "--checkpoint", run, "--prompt", " " + prompt)  # run.c adds the space itself
        exported = generate_json(capsys, "--checkpoint", model_bin, "--tokenizer", tok_bin, "--prompt", prompt)
        assert exported["token_ids"] == [i - 1 for i in ours["token_ids"]] and len(ours["token_ids"]) > 10
        assert exported["text"] == ours["text"][1:]
        # run.c prints one token per step, the prompt's (after BOS) included, and stops before a BOS
        steps = len(tok.encode(prompt, bos=True)) - 1 + len(exported["token_ids"])
        result = subprocess.run(
            [str(run_c), str(model_bin), "-z", str(tok_bin), "-t", "0", "-n", str(steps), "-i", prompt],
            capture_output=True,
            check=True,
        )
        assert result.stdout.decode() == exported["text"] + "\n"
