"""Int8 weights: the round trip within half a step per row, int8 layers and models close to
float32, the decoding step on the same integers as the model's forward, greedy tokens mostly the
float model's, and the compiled int8 step equal to the eager one token for token."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from test_decode import saved_model  # noqa: F401  (a fixture: a small saved char model)

from tinylm.cli import main
from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.generation import GenerationConfig, generate_many
from tinylm.generation.core import prefill
from tinylm.generation.decode import decode_step
from tinylm.models.gpt import GPT
from tinylm.models.quantize import (
    Int8Linear,
    dequantize_rows,
    int8_kernel_of,
    is_quantized,
    quantize_gpt,
    quantize_rows,
)
from tinylm.serving.app import create_app
from tinylm.serving.completions import Limits
from tinylm.serving.models import load_models

pytestmark = pytest.mark.usefixtures("one_thread")
KERNELS = ["rowwise", "dequantize"]


def tiny(**arch):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=61, context_length=64, d_model=32, n_layers=2, n_heads=4, **arch)).eval()


def trained_tiny(**arch) -> GPT:
    """A tiny model trained to continue a fixed sequence: confident logits, so greedy tokens mean something."""
    model = tiny(**arch).train()
    g = torch.Generator().manual_seed(1)
    pattern = torch.randint(0, 61, (40,), generator=g)
    seq = pattern.repeat(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(120):
        start = int(torch.randint(0, 40, (1,), generator=g))
        x = torch.stack([seq[start + i : start + i + 48] for i in range(4)])
        y = torch.stack([seq[start + i + 1 : start + i + 49] for i in range(4)])
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_round_trip_error_is_at_most_half_a_step_per_row():
    torch.manual_seed(0)
    w = torch.randn(50, 70) * torch.logspace(-3, 1, 50)[:, None]  # rows of very different ranges
    w[7] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (50,)
    assert int(q.abs().max()) == 127  # every row uses its full range
    err = (dequantize_rows(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())
    assert bool((dequantize_rows(q, scale)[7] == 0).all())
    # relative to each row's largest weight the error is at most 1/254
    assert float((err.amax(1) / w.abs().amax(1).clamp(min=1e-30)).max()) <= 1 / 254 + 1e-6


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_is_close_to_the_float_product_of_its_weights(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = Int8Linear(linear, kernel)
    x = torch.randn(3, 5, 64)
    exact = F.linear(x, layer.weight, layer.bias)  # the int8 weights, multiplied in float
    y = layer(x)
    assert y.shape == (3, 5, 48)
    # weight-only is exact to rounding; W8A8 adds the activations' 8-bit rounding
    tol = {"dequantize": 1e-5, "rowwise": 0.02}[kernel]
    assert float((y - exact).abs().max() / exact.abs().max()) < tol
    assert float((layer.weight - linear.weight.detach()).abs().max()) <= float(layer.scale.max()) / 2 + 1e-7


def test_quantize_gpt_converts_every_linear_and_refuses_non_float32():
    model = quantize_gpt(tiny())
    assert is_quantized(model) and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert int8_kernel_of(model) == "rowwise"
    assert model.tok_emb.weight.dtype == torch.float32  # the embedding table stays float
    with pytest.raises(TinyLMError, match="float32"):
        quantize_gpt(tiny().to(torch.bfloat16))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "arch", [dict(), dict(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False, n_kv_heads=2, tie_weights=False)]
)
def test_int8_logits_are_close_to_float32(kernel, arch):
    model = trained_tiny(**arch)
    int8 = quantize_gpt(copy.deepcopy(model), kernel)
    x = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref, got = model(x)[0], int8(x)[0]
    spread = float(ref.std())
    assert float((got - ref).abs().mean()) < 0.02 * spread  # measured 0.003-0.011
    assert float((got - ref).abs().max()) < 0.2 * spread  # measured 0.02-0.13
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95


@pytest.mark.parametrize("kernel", KERNELS)
def test_decoding_step_uses_the_same_integers_as_the_forward(kernel):
    model = quantize_gpt(trained_tiny(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False), kernel)
    seq = [3, 9, 27, 4, 8]
    with torch.inference_mode():
        cache, last, _ = prefill(model, [seq], 20)
        model.prepare_for_decoding()
        assert model.blocks[0].ffn.down.kernel == kernel
        step = decode_step(model, cache, torch.tensor([11]))[0]
        full = model(torch.tensor([seq + [11]]))[0][0, -1]
    # the same integers and, row by row, the same activation scales: equal up to float rounding
    tol = 2e-4
    assert float((step - full).abs().max()) < tol


def test_greedy_tokens_mostly_equal_float32():
    model = trained_tiny()
    int8 = quantize_gpt(copy.deepcopy(model))
    prompts = [[5, 17, 33], [40, 2], [9]]
    cfg = GenerationConfig(max_new_tokens=40, temperature=0)
    ref = [r.tokens for r in generate_many(model, prompts, cfg)]
    got = [r.tokens for r in generate_many(int8, prompts, cfg)]
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(len(r) for r in ref)
    assert same >= 0.9


@pytest.mark.slow
def test_compiled_int8_step_equals_the_eager_one_token_for_token():
    int8 = quantize_gpt(trained_tiny())
    prompts = [[5, 17, 33], [40, 2]]
    eager = generate_many(int8, prompts, GenerationConfig(max_new_tokens=30, temperature=0))
    compiled = generate_many(int8, prompts, GenerationConfig(max_new_tokens=30, temperature=0, compile=True))
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]


def test_cli_generate_and_serve_load_int8_weights(saved_model, capsys):  # noqa: F811 (the fixture)
    code = main(
        [
            "generate",
            "--checkpoint",
            str(saved_model),
            "--prompt",
            "Once upon",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--json",
            "--dtype",
            "int8",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out.splitlines()[0])
    assert result["tokens"] == 12 and result["text"].startswith("Once upon")
    models = load_models([str(saved_model)], [], max_batch=4, dtype="int8")
    try:
        served = models["model"]
        assert is_quantized(served.model)
        card = served.card()
        assert card["dtype"] == "int8" and card["parameters"] == GPT(served.model.config).num_parameters()
        with TestClient(create_app(models, Limits(max_tokens=64, max_choices=4, max_body_bytes=20_000))) as client:
            for extra in ({}, {"beam_width": 3}):
                r = client.post(
                    "/v1/completions",
                    json={"model": "model", "prompt": "Once upon", "max_tokens": 12, "temperature": 0, **extra},
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"]
    finally:
        models["model"].scheduler.close()
