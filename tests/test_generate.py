"""The generate loop: original API, batches equal single runs, streaming, and the CLI."""

import json
import time

import pytest
import torch
from conftest import slow_except

from tinylm.cli import main
from tinylm.config import ModelConfig
from tinylm.generation import GenerationConfig, TextStream, TokenStream, generate, generate_many
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.tokenizers import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread

TEXT = "the cat sat on the mat. a dog ran far away! é ü"


def tiny_model(vocab=40, positions="learned", ctx=64):
    torch.manual_seed(0)
    return GPT(
        ModelConfig(vocab_size=vocab, context_length=ctx, d_model=32, n_layers=2, n_heads=4, positions=positions)
    ).eval()


def test_original_positional_api_still_works():
    model = tiny_model()
    out = generate(model, [2, 5, 6], 10, 0.8, 5, 0.9, None, True, 0)
    assert len(out) == 10 and all(0 <= t < 40 for t in out)
    assert generate(model, torch.tensor([2, 5, 6]), 10, temperature=0) == generate(model, [2, 5, 6], 10, temperature=0)
    assert generate(model, [2, 5], 0, temperature=0) == []
    assert model.training is False
    model.train()
    generate(model, [2, 5], 3)
    assert model.training is True  # mode restored


@pytest.mark.parametrize("positions", slow_except("rope", ["learned", "sinusoidal", "rope"]))
def test_batch_rows_equal_generating_each_alone(positions):
    model = tiny_model(positions=positions)
    prompts = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 3], [2, 20, 21, 22]]
    stop = generate(model, prompts[1], 30, temperature=0)[6]  # ends row 1 early, others keep going
    cfg = GenerationConfig(max_new_tokens=30, temperature=0, stop_ids=(stop,))
    batched = generate_many(model, prompts, cfg)
    for p, r in zip(prompts, batched):
        alone = generate_many(model, [p], cfg)[0]
        assert r.tokens == alone.tokens and r.finish_reason == alone.finish_reason
    assert batched[1].finish_reason == "stop_token"


def test_sampling_with_per_row_seeds_reproduces_single_prompt_runs():
    model = tiny_model(positions="rope")
    prompts = [[2, 5, 6, 7, 8], [2, 3], [2, 20, 21]]
    cfg = GenerationConfig(max_new_tokens=25, temperature=0.9, top_p=0.9, seed=11, seed_per_row=True)
    batched = generate_many(model, prompts, cfg)
    for i, p in enumerate(prompts):
        alone = generate_many(model, [p], GenerationConfig(**{**cfg.__dict__, "seed": 11 + i}))[0]
        assert batched[i].tokens == alone.tokens


def test_token_stream_yields_each_step_and_stops_rows():
    model = tiny_model()
    stream = TokenStream(model, [[2, 3, 4], [2, 9]], GenerationConfig(max_new_tokens=6, temperature=0))
    steps = list(stream)
    assert len(steps) == 6
    assert [s[0] for s in steps] == stream.results[0].tokens


def test_text_stream_pieces_join_to_the_final_text():
    tok = CharTokenizer().train([TEXT])
    model = tiny_model(vocab=tok.vocab_size)
    cfg = GenerationConfig(max_new_tokens=40, temperature=1.0, seed=3)
    stream = TextStream(model, tok.decode, [2, *tok.encode("the ")], cfg)
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == tok.decode(stream.result.tokens)
    with pytest.raises(ValueError, match="beam"):
        TextStream(model, tok.decode, [2, 5], GenerationConfig(beam_width=2))


@pytest.fixture
def checkpoint(tmp_path):
    tok = CharTokenizer().train([TEXT])
    model = tiny_model(vocab=tok.vocab_size)
    return save_checkpoint(tmp_path / "ckpt", model, tok), model, tok


def test_cli_json_greedy_matches_library(checkpoint, capsys):
    path, model, tok = checkpoint
    t0 = time.perf_counter()
    code = main(
        [
            "generate",
            "--checkpoint",
            str(path),
            "--prompt",
            "the",
            "--prompt",
            "a dog",
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            "--json",
            "--batch-size",
            "2",
        ]
    )
    wall = time.perf_counter() - t0
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in rows] == ["the", "a dog"]
    # sampled, batched and one by one: the same text (prompt i is seeded seed + i either way)
    outs = []
    for batch in ("1", "2"):
        main(
            [
                "generate",
                "--checkpoint",
                str(path),
                "--prompt",
                "the",
                "--prompt",
                "a dog",
                "--temperature",
                "1.0",
                "--max-new-tokens",
                "12",
                "--json",
                "--batch-size",
                batch,
                "--seed",
                "4",
            ]
        )
        outs.append([json.loads(line)["text"] for line in capsys.readouterr().out.strip().splitlines()])
    assert outs[0] == outs[1]
    for r in rows:
        expected = generate(model, [2, *tok.encode(r["prompt"])], 12, temperature=0, eos_id=3)
        assert r["token_ids"] == expected and r["tokens"] == len(expected)
        assert r["text"] == r["prompt"] + tok.decode(expected)
    # one batch of two prompts: one rate, its new tokens over a time inside the command's own wall time
    assert rows[0]["tokens_per_s"] == rows[1]["tokens_per_s"] >= (rows[0]["tokens"] + rows[1]["tokens"]) / wall - 0.05


def test_cli_beam_stream_and_errors(checkpoint, capsys, tmp_path):
    path, model, tok = checkpoint
    prompts = tmp_path / "p.txt"
    prompts.write_text("the\n\na dog\n")
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(path),
                "--prompts-file",
                str(prompts),
                "--beam-width",
                "3",
                "--num-return-sequences",
                "2",
                "--max-new-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(rows) == 4 and rows[0]["prompt"] == rows[1]["prompt"] == "the"
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(path),
                "--prompt",
                "the",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--stream",
            ]
        )
        == 0
    )
    streamed = capsys.readouterr().out.strip("\n")
    assert streamed == "the" + tok.decode(generate(model, [2, *tok.encode("the")], 8, temperature=0, eos_id=3))
    assert main(["generate", "--checkpoint", str(path), "--prompt", "the", "--top-p", "1.5"]) == 2
    assert "--top-p must be in (0, 1] (got 1.5)" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(path), "--prompt", "x", "--beam-width", "999"]) == 2
    assert "beam_width" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2


@pytest.mark.slow
def test_benchmark_quick_runs_and_matches_reference(tmp_path):
    """The benchmark's --quick mode: every tinylm row reproduces HF's tokens; JSON has the issue's fields."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("transformers")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    t0 = time.perf_counter()
    assert bench.main(["--quick", "--skip-llama2c", "--json", str(out)]) == 0
    wall = time.perf_counter() - t0
    rows = json.loads(out.read_text())
    gen = [r for r in rows if r["table"] == "generate"]
    assert {(r["mode"], r["system"]) for r in gen} == {
        (m, s) for m in bench.MODES for s in ("tinylm", "hf_transformers")
    }
    for r in gen:
        assert {"system", "mode", "batch", "new_tokens", "tokens_per_s", "same_tokens_as_reference"} <= set(r)
        # every row makes batch x new_tokens tokens; its median run took less than the whole benchmark
        assert r["tokens_per_s"] >= r["batch"] * r["new_tokens"] / wall
        if r["system"] == "tinylm":
            assert r["same_tokens_as_reference"] is True
    kv = [r for r in rows if r["table"] == "kv_cache_speedup"]
    assert [r["total_length"] for r in kv] == [64, 128]
    for r in kv:
        assert r["speedup"] == pytest.approx(r["cache_tokens_per_s"] / r["nocache_tokens_per_s"], rel=0.01)
        assert min(r["cache_tokens_per_s"], r["nocache_tokens_per_s"]) >= r["new_tokens"] / wall
    int8 = [r for r in rows if r["table"] == "int8_speed"]
    assert {(r["weights"], r["batch"]) for r in int8} == {(w, b) for w in ("int8", "int8_weight_only") for b in (1, 4)}
    for r in int8:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["float32_tokens_per_s"], rel=0.02)
    assert not [r for r in rows if r["table"] == "int8_bpb"]  # --skip-llama2c and no checkpoint: nothing scored


def test_a_fully_banned_vocabulary_is_a_clear_error_not_a_crash():
    model = GPT(ModelConfig(vocab_size=8, context_length=16, d_model=16, n_layers=1, n_heads=2))
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="no token is allowed at step"):
            generate(model, [4], 20, temperature=temperature, no_repeat_ngram_size=1)
