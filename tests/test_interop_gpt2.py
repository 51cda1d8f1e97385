"""HF GPT-2 -> tinylm: same logits, same greedy and beam outputs as HF generate(); exports load back."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM  # noqa: E402

from tinylm.config import ModelConfig  # noqa: E402
from tinylm.errors import TinyLMError  # noqa: E402
from tinylm.generation import GenerationConfig, generate_many  # noqa: E402
from tinylm.interop import export_hf, load_any_checkpoint  # noqa: E402
from tinylm.interop.gpt2 import from_hf_gpt2  # noqa: E402
from tinylm.interop.llama import from_hf_llama  # noqa: E402
from tinylm.models.gpt import GPT  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # imports transformers and its model code: ~5 s before the first test
    pytest.mark.usefixtures("one_thread"),
]  # see conftest.one_thread

transformers.logging.set_verbosity_error()
V = 50


def hf_gpt2(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, **kw)
    return GPT2LMHeadModel(cfg).eval()


def hf_new_tokens(out, prompt_len, eos):
    ids = out[prompt_len:].tolist()
    return ids[: ids.index(eos)] if eos in ids else ids


def test_logits_equal_hf():
    hf = hf_gpt2()
    model = from_hf_gpt2(hf)
    x = torch.randint(0, V, (3, 40))
    with torch.no_grad():
        assert torch.allclose(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)
        model.train()  # the training path (no fused matmuls) agrees too
        assert torch.allclose(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_and_beam5_identical_to_hf_generate(seed):
    hf = hf_gpt2(seed)
    model = from_hf_gpt2(hf)
    eos = 11  # a common token for these random weights, so hypotheses really end
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    x, mask = torch.tensor(prompts), torch.ones(2, 4, dtype=torch.long)
    for beams in (1, 5):
        with torch.no_grad():
            out = hf.generate(
                x,
                attention_mask=mask,
                max_new_tokens=20,
                num_beams=beams,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        ours = generate_many(
            model, prompts, GenerationConfig(max_new_tokens=20, temperature=0, beam_width=beams, stop_ids=(eos,))
        )
        assert [r.tokens for r in ours] == [hf_new_tokens(o, 4, eos) for o in out]


def test_left_padded_batch_and_sampling_match_hf():
    hf = hf_gpt2(2)
    model = from_hf_gpt2(hf)
    prompts = [[5, 6, 7, 8, 9, 10], [9, 10], [1, 2, 3, 4]]
    ids, mask = torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 6 - len(p) :], mask[i, 6 - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=20, num_beams=3, do_sample=False, eos_token_id=49, pad_token_id=0
        )
    ours = generate_many(
        model, prompts, GenerationConfig(max_new_tokens=20, temperature=0, beam_width=3, stop_ids=(49,))
    )
    assert [r.tokens for r in ours] == [hf_new_tokens(o, 6, 49) for o in out]
    # top-k sampling with the same seed draws the same tokens (same probabilities, same RNG stream)
    torch.manual_seed(123)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([[5, 6, 7, 8]] * 2),
            attention_mask=torch.ones(2, 4, dtype=torch.long),
            max_new_tokens=30,
            do_sample=True,
            top_k=10,
            temperature=0.8,
            pad_token_id=0,
        )
    ours = generate_many(
        model, [[5, 6, 7, 8]] * 2, GenerationConfig(max_new_tokens=30, temperature=0.8, top_k=10, seed=123)
    )
    assert [r.tokens for r in ours] == [o[4:].tolist() for o in out]


def test_export_gpt2_shape_loads_in_transformers_with_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=V, context_length=32, d_model=32, n_layers=2, n_heads=4, tie_weights=False)
    ).eval()
    export_hf(model, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert torch.allclose(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_export_llama_shape_loads_in_transformers_with_identical_logits(tmp_path, tie):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V,
        context_length=32,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        positions="rope",
        norm="rmsnorm",
        ffn="swiglu",
        bias=False,
        tie_weights=tie,
        d_ff=48,
    )
    model = GPT(cfg).eval()
    export_hf(model, tmp_path / "hf")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert torch.allclose(model(x)[0], hf(x).logits, atol=1e-5, rtol=0)
    back = from_hf_llama(hf)
    with torch.no_grad():
        assert torch.allclose(back(x)[0], hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [dict(), dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False)])
def test_export_refuses_value_embeddings_by_name(tmp_path, shape):
    model = GPT(
        ModelConfig(
            vocab_size=V, context_length=32, d_model=32, n_layers=2, n_heads=4, value_embeddings="alternate", **shape
        )
    )
    with pytest.raises(
        TinyLMError,
        match=r"^this model cannot be written as a Hugging Face (GPT-2|Llama) model: "
        r"model\.value_embeddings=alternate \(no other format has value embeddings\)$",
    ):
        export_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


LLAMA = dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False)


@pytest.mark.parametrize(
    "shape, option, named",
    [
        (dict(), dict(qk_norm=True), r"GPT-2 model: model\.qk_norm=true \(normalised queries and keys\)"),
        (LLAMA, dict(qk_norm=True), r"Qwen3 model: model\.qk_norm=true without model\.qk_norm_weight \(.*\)"),
        (dict(), dict(logit_softcap=15.0), r"GPT-2 model: model\.logit_softcap=15\.0"),
        (LLAMA, dict(logit_softcap=15.0), r"Llama model: model\.logit_softcap=15\.0"),
    ],
)
def test_export_refuses_options_the_hf_configs_cannot_hold(tmp_path, shape, option, named):
    """No Hugging Face config has a logit soft-cap, GPT-2's no QK-norm, and Qwen3's QK-norm (the
    Llama shape's) only with the model's one epsilon, which tinylm's gainless QK-norm at
    norm_eps 1e-5 is not: writing the file anyway would give a different model, so the export
    refuses and names the option."""
    model = GPT(ModelConfig(vocab_size=V, context_length=32, d_model=32, n_layers=2, n_heads=4, **shape, **option))
    with pytest.raises(TinyLMError, match=r"^this model cannot be written as a Hugging Face " + named + "$"):
        export_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_hf_directory_as_checkpoint(tmp_path):
    from tinylm.tokenizers import CharTokenizer

    tok = CharTokenizer().train(["abcdefgh ijk"])
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=4)).eval()
    export_hf(model, tmp_path / "hf", tokenizer=tok)
    loaded, tokenizer, source = load_any_checkpoint(tmp_path / "hf")
    assert source["format"] == "hf" and tokenizer.bos_id == 2 and tokenizer.encode("abc") == tok.encode("abc")
    x = torch.tensor([[2, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(x)[0], model(x)[0], atol=1e-6)
    with pytest.raises(TinyLMError, match="neither"):
        export_hf(GPT(ModelConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1, norm="rmsnorm")), tmp_path / "x")


def test_cli_export_hf_from_tinylm_and_llama2c_checkpoints(tmp_path, capsys):
    from tinylm.cli import main
    from tinylm.interop.llama2c import save_llama2c
    from tinylm.models.checkpoint import save_checkpoint
    from tinylm.tokenizers import CharTokenizer

    tok = CharTokenizer().train(["abcdefgh ijk"])
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=4)).eval()
    save_checkpoint(tmp_path / "ckpt", model, tok)
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert "GPT-2" in capsys.readouterr().out
    x = torch.tensor([[2, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(GPT2LMHeadModel.from_pretrained(tmp_path / "hf")(x).logits, model(x)[0], atol=1e-5)
    llama = GPT(
        ModelConfig(
            vocab_size=300,
            context_length=32,
            d_model=32,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            positions="rope",
            norm="rmsnorm",
            ffn="swiglu",
            bias=False,
        )
    ).eval()
    save_llama2c(llama, tmp_path / "m.bin")
    assert main(["export-hf", "--checkpoint", str(tmp_path / "m.bin"), "--out", str(tmp_path / "hf2")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
