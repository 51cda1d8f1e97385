"""The static-shape decoding step: equal to the model's uncached forward, its decoding layout kept
until a weight changes, and the compiled step equal to the eager one token for token."""

import json

import pytest
import torch
from conftest import make_stories

from tinylm.cli import main
from tinylm.config import ModelConfig
from tinylm.generation import GenerationConfig, generate_many
from tinylm.generation.core import cache_slots, prefill
from tinylm.generation.decode import decode_step
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT, step_prompts
from tinylm.tokenizers.char import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = {
    "gpt2": dict(),
    "sinusoidal_relu": dict(positions="sinusoidal", ffn="relu"),
    "llama_gqa": dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_kv_heads=2, tie_weights=False),
    "round2": dict(positions="rope", norm="rmsnorm", ffn="relu2", bias=False, qk_norm=True, logit_softcap=15.0),
    "narrow_embeddings": dict(d_embed=24, tie_weights=False, positions="none"),
    "value_embeddings": dict(positions="rope", n_kv_heads=2, value_embeddings="all"),
}


def tiny(ctx=64, **arch):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=61, context_length=ctx, d_model=32, n_layers=2, n_heads=4, **arch)).eval()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_step_logits_equal_the_full_forward_on_a_left_padded_batch(arch):
    model = tiny(**ARCHS[arch])
    rows = [[2, 7, 11, 5, 9], [3, 4]]
    seqs = [list(r) for r in rows]
    with torch.inference_mode():
        cache, last, positions = prefill(model, rows, 40)
        model.prepare_for_decoding()
        for _ in range(25):
            nxt = last.argmax(-1)
            for s, t in zip(seqs, nxt.tolist()):
                s.append(t)
            last = decode_step(model, cache, nxt, positions)
            positions += 1
            for i, s in enumerate(seqs):  # each row alone, recomputed from scratch
                full = model(torch.tensor([s]))[0][0, -1]
                torch.testing.assert_close(last[i], full, atol=2e-5, rtol=0)
    assert cache.length == 5 + 25


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompts_joining_a_step_get_the_logits_and_cache_of_their_own_prefill(arch, device):
    """Two prompts ride along a step of two decoding rows (``step_prompts``): the rows' logits are
    the plain step's, each prompt's are its forward alone, and its keys and values land
    right-aligned with the step's slot, as a prefill of its own would have put them."""
    model = tiny(**ARCHS[arch]).to(device)
    close = dict(atol=2e-5 if device == "cpu" else 1e-4, rtol=0)
    joining = [[4, 8, 15, 16, 23], [42, 7]]
    with torch.inference_mode():
        cache, last, positions = prefill(model, [[2, 7, 11, 5, 9, 1], [3, 4]], 16)
        model.prepare_for_decoding()
        plain = decode_step(model, cache, last.argmax(-1), positions.clone())
        cache.length -= 1  # the same step again, now with the prompts in rows 2 and 3
        for name in ("k", "v"):
            setattr(cache, name, [torch.cat([t, torch.zeros_like(t)]) for t in getattr(cache, name)])
        first = [cache.length + 1 - len(p) for p in joining]
        first_slot = torch.tensor(first, device=device)[:, None]
        cache.key_mask = torch.cat([cache.key_mask, torch.arange(16, device=device)[None, :] >= first_slot])
        prompts = step_prompts(joining, 2, cache.length, device)
        both = decode_step(model, cache, last.argmax(-1), positions.clone(), prompts=prompts)
        assert both.shape == (4, 61) and cache.length == 7
        torch.testing.assert_close(both[:2], plain, **close)
        for j, ids in enumerate(joining):
            own, own_last, _ = prefill(model, [ids], len(ids))
            torch.testing.assert_close(both[2 + j], own_last[0], **close)
            for layer in range(len(cache.k)):
                torch.testing.assert_close(cache.k[layer][2 + j, :, first[j] : 7], own.k[layer][0], **close)
                torch.testing.assert_close(cache.v[layer][2 + j, :, first[j] : 7], own.v[layer][0], **close)
    with pytest.raises(ValueError, match="does not fit before cache slot 3"):
        step_prompts([[1] * 5], 0, 3, "cpu")


def test_step_matches_the_forward_in_float64():
    model = tiny(**ARCHS["llama_gqa"]).double()
    with torch.inference_mode():
        cache, last, _ = prefill(model, [[2, 7, 11]], 8)
        step = decode_step(model, cache, torch.tensor([5]))
        full = model(torch.tensor([[2, 7, 11, 5]]))[0][0, -1]
    assert step.dtype == torch.float64
    torch.testing.assert_close(step[0], full, atol=1e-12, rtol=0)


def test_the_decoding_layout_is_renewed_when_a_weight_changes():
    model = tiny()
    model.prepare_for_decoding()
    up = model.blocks[0].ffn.up
    first = up.decode_layout[0]
    model.prepare_for_decoding()
    assert up.decode_layout[0] is first  # unchanged weights: the layout is kept
    with torch.no_grad():
        up.weight.add_(0.5)  # an optimizer step changes weights in place
    model.prepare_for_decoding()
    assert up.decode_layout[0] is not first
    assert torch.equal(up.decode_layout[0], up.weight.t())
    second = up.decode_layout[0]
    model.load_state_dict(tiny().state_dict())
    model.prepare_for_decoding()
    assert up.decode_layout[0] is not second


def test_a_full_cache_is_refused_with_a_clear_error():
    model = tiny()
    with torch.inference_mode():
        cache, _, _ = prefill(model, [[2, 3, 4]], 3)
        with pytest.raises(ValueError, match="KV cache is full"):
            decode_step(model, cache, torch.tensor([5]))


def test_compiled_cache_sizes_come_from_a_few_buckets_within_the_context():
    assert cache_slots(37, 256, bucketed=False) == 37
    assert cache_slots(37, 512, bucketed=True) == 64
    assert cache_slots(272, 512, bucketed=True) == 512
    assert cache_slots(700, 1024, bucketed=True) == 1024
    assert cache_slots(37, 256, bucketed=True) == 64
    assert cache_slots(900, 100, bucketed=False) == 100


def test_bfloat16_model_decodes_with_float32_softmax_and_stays_close():
    model = tiny(**ARCHS["llama_gqa"])
    cfg = GenerationConfig(max_new_tokens=12, temperature=0)
    ref = generate_many(model, [[2, 7, 11]], cfg)[0].tokens
    half = generate_many(tiny(**ARCHS["llama_gqa"]).to(torch.bfloat16), [[2, 7, 11]], cfg)[0].tokens
    assert len(half) == 12
    assert half[:3] == ref[:3]  # an untrained model's logits are close together: only the start must agree


# ---------------------------------------------------------------------------------------- compiled
@pytest.mark.slow  # two compilations (~20 s each on a 2-core CPU)
def test_compiled_decoding_equals_eager_token_for_token():
    model = tiny(ctx=128, **ARCHS["llama_gqa"])
    padded = [[2, 7, 11, 5, 9, 4, 8], [3, 4]]  # left-padded batch: key mask and per-row positions
    runs = {
        "greedy": ([[2, 7, 11, 5, 9, 4, 8], [3, 4]], dict(temperature=0)),
        "seeded_sampling": (padded, dict(temperature=0.9, top_k=20, seed=3)),
        "beam5": ([[2, 7, 11]], dict(temperature=0, beam_width=5, num_return_sequences=5)),
    }
    for name, (prompts, knobs) in runs.items():
        eager = generate_many(model, prompts, GenerationConfig(max_new_tokens=40, **knobs))
        compiled = generate_many(model, prompts, GenerationConfig(max_new_tokens=40, compile=True, **knobs))
        assert [r.tokens for r in compiled] == [r.tokens for r in eager], name
        assert all(len(r.tokens) == 40 for r in eager), name
        if name == "beam5":
            assert [r.score for r in compiled] == pytest.approx([r.score for r in eager], abs=1e-5)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    stories = make_stories(20)
    tok = CharTokenizer().train(stories)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2, n_heads=4))
    path = tmp_path_factory.mktemp("decode") / "model"
    save_checkpoint(path, model, tok)
    return path


def _generate_json(capsys, path, *extra):
    code = main(
        [
            "generate",
            "--checkpoint",
            str(path),
            "--prompt",
            "Once upon",
            "--max-new-tokens",
            "20",
            "--temperature",
            "0",
            "--json",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.splitlines()[0]), err


def test_cli_bfloat16_decoding_runs(saved_model, capsys):
    ref, _ = _generate_json(capsys, saved_model)
    half, _ = _generate_json(capsys, saved_model, "--dtype", "bfloat16")
    assert half["tokens"] == ref["tokens"] == 20
    assert half["text"].startswith("Once upon")


@pytest.mark.slow  # one compilation
def test_cli_compile_prints_its_compile_time_and_the_same_tokens(saved_model, capsys):
    ref, _ = _generate_json(capsys, saved_model)
    compiled, err = _generate_json(capsys, saved_model, "--compile")
    assert compiled["token_ids"] == ref["token_ids"]
    assert "compiled the decoding step for batch 1" in err


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama_gqa", "value_embeddings"])  # value tables: marked static like the weights
def test_cuda_step_matches_the_forward_and_compiled_equals_eager(arch):
    model = tiny(ctx=128, **ARCHS[arch]).cuda()
    prompts = [[2, 7, 11, 5, 9, 4, 8], [3, 4]]
    with torch.inference_mode():
        cache, last, positions = prefill(model, prompts, 16)
        step = decode_step(model, cache, last.argmax(-1), positions)
        for i, p in enumerate(prompts):
            full = model(torch.tensor([p + [int(last[i].argmax())]], device="cuda"))[0][0, -1]
            torch.testing.assert_close(step[i], full, atol=1e-4, rtol=0)
    for knobs in (dict(temperature=0), dict(temperature=0.9, top_k=20, seed=3), dict(temperature=0, beam_width=5)):
        rows = prompts if knobs.get("beam_width", 1) == 1 else prompts[:1]
        eager = generate_many(model, rows, GenerationConfig(max_new_tokens=40, **knobs))
        compiled = generate_many(model, rows, GenerationConfig(max_new_tokens=40, compile=True, **knobs))
        assert [r.tokens for r in compiled] == [r.tokens for r in eager], knobs
