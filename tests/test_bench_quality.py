"""benchmarks/bench_quality.py --quick on files the test writes: a random-weight llama2.c model and
tokenizer.bin (as the model and as a stand-in stories260K reference), a TinyStories-format file."""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch

from tinylm.config import ModelConfig
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.interop import load_any_checkpoint
from tinylm.interop.llama2c import save_llama2c
from tinylm.models.gpt import GPT

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quality.py"
STORIES = [
    "Once upon a time there was a cat. The cat liked milk.",
    "Tom had a red ball.\nHe played with it every day, all day long, in the park by the big tree.",
    'The sun was shining and the birds sang. "Hello!" said Lily.',
]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_quality", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_tokenizer_bin(path: Path) -> Path:
    """llama2.c layout: specials, 256 byte fallbacks, then a few scored pieces."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    pieces += [b" ", b"e", b"a", b"t", b" t", b"he", b" the", b"o", b"n", b" a"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    blob = [struct.pack("<i", max(len(p) for p in pieces))]
    blob += [struct.pack("<fi", s, len(p)) + p for p, s in zip(pieces, scores)]
    path.write_bytes(b"".join(blob))
    return path


def write_model_bin(path: Path, vocab: int, seed: int, context: int = 16) -> Path:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab,
        context_length=context,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=24,
        positions="rope",
        norm="rmsnorm",
        ffn="swiglu",
        bias=False,
        tie_weights=True,
    )
    return save_llama2c(GPT(cfg), path)


@pytest.fixture
def files(tmp_path):
    tok = write_tokenizer_bin(tmp_path / "tok.bin")
    vocab = 269
    anchors = tmp_path / "anchors"
    anchors.mkdir()
    write_model_bin(anchors / "stories260K.bin", vocab, seed=1)
    write_tokenizer_bin(anchors / "tok512.bin")
    model = write_model_bin(tmp_path / "model.bin", vocab, seed=2)
    data = tmp_path / "stories.txt"
    data.write_text("\n<|endoftext|>\n".join(STORIES) + "\n", encoding="utf-8")
    return {"tok": tok, "anchors": anchors, "model": model, "data": data, "tmp": tmp_path}


def test_quick_table_and_json_match_the_evaluator(files, capsys):
    bench = load_bench()
    out_json = files["tmp"] / "rows.json"
    rc = bench.main(
        [
            f"{files['model']}::{files['tok']}",
            "--data",
            str(files["data"]),
            "--anchors",
            str(files["anchors"]),
            "--quick",
            "--threads",
            "1",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert [r["model"] for r in rows] == ["stories260K (llama2.c)", "model.bin"]
    for r in rows:
        assert set(bench.COLUMNS) <= set(r)
        assert r["train_minutes"] is None and r["stories"] == len(STORIES)
    # the same numbers as the evaluator's own adapter, computed here directly
    model, tok, _ = load_any_checkpoint(files["model"], files["tok"])
    direct = evaluate_texts(model, tok, STORIES)
    assert rows[1]["bpb"] == pytest.approx(direct["bpb"], rel=1e-6)
    assert rows[1]["token_ppl"] == pytest.approx(direct["token_ppl"], rel=1e-6)
    assert rows[1]["params"] == model.num_parameters()
    # random weights over 269 pieces: about log2(269) bits per token, several bits per byte
    assert 2.0 < rows[1]["bpb"] < 12.0
    assert rows[1]["bpb_vs_stories260K"] == pytest.approx(rows[1]["bpb"] / rows[0]["bpb"])
    out = capsys.readouterr().out
    assert "bpb/260K" in out and "model.bin" in out and "1.000" in out  # the reference's own ratio


def test_sliding_window_scores_every_token(files):
    """Stories longer than the 16-token context are scored with windows: every byte counts once."""
    bench = load_bench()
    row = bench.evaluate_model("m", str(files["model"]), str(files["tok"]), STORIES, batch_size=2)
    _, tok, _ = load_any_checkpoint(files["model"], files["tok"])
    assert max(len(tok.encode(s)) for s in STORIES) > 16
    assert row["tokens"] == sum(len(tok.encode(s)) for s in STORIES)  # BOS is context, never a target
    assert row["bytes"] == sum(len(s.encode("utf-8")) for s in STORIES)


def test_absent_reference_is_said(files, capsys):
    bench = load_bench()
    rc = bench.main(
        [
            f"{files['model']}::{files['tok']}",
            "--data",
            str(files["data"]),
            "--anchors",
            str(files["tmp"] / "nowhere"),
            "--quick",
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "reference ABSENT" in out


def test_bad_inputs_are_one_line_errors(files, capsys):
    bench = load_bench()
    assert bench.main(["--data", str(files["tmp"] / "missing.txt"), "--anchors", str(files["anchors"])]) == 2
    assert "does not exist" in capsys.readouterr().err
    rc = bench.main([str(files["model"]), "--data", str(files["data"]), "--anchors", str(files["anchors"]), "--quick"])
    assert rc == 2
    assert "--tokenizer" in capsys.readouterr().err  # a llama2.c .bin without its tokenizer


def test_train_minutes_from_metrics_csv(tmp_path):
    bench = load_bench()
    ckpt = tmp_path / "run" / "checkpoints" / "last"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "metrics.csv").write_text(
        "step,tokens,lr,train_loss,val_loss,val_ppl,tokens_per_s,elapsed_s\n"
        "10,1,0,1,,,1,60.0\n20,2,0,1,,,1,120.0\n30,3,0,1,,,1,180.0\n"
    )
    assert bench.train_minutes(ckpt, {"meta": {"step": 20}}) == pytest.approx(2.0)
    assert bench.train_minutes(ckpt, {"meta": {}}) == pytest.approx(3.0)
    assert bench.train_minutes(tmp_path, {"meta": {}}) is None


def test_cli_evaluate_llama2c_bin_with_tokenizer(files, capsys):
    """`tinylm evaluate --checkpoint model.bin --tokenizer tok.bin --json`: the benchmark's protocol."""
    from tinylm.cli import main

    assert (
        main(
            [
                "evaluate",
                "--checkpoint",
                str(files["model"]),
                "--tokenizer",
                str(files["tok"]),
                "--data",
                str(files["data"]),
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = load_bench().evaluate_model("m", str(files["model"]), str(files["tok"]), STORIES, batch_size=32)
    assert got["bpb"] == pytest.approx(row["bpb"], rel=1e-6)
    assert got["bytes"] == sum(len(s.encode("utf-8")) for s in STORIES)
    assert main(["evaluate", "--checkpoint", str(files["model"]), "--data", str(files["data"])]) == 2
    assert "--tokenizer" in capsys.readouterr().err


# the recipes shrunk to seconds of training; compiling (tens of seconds) would outlast the budgets
SHRINK = [
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_layers=1",
    "model.d_ff=64",
    "model.context_length=32",
    "tokenizer.vocab_size=300",
    "train.eval_interval=5",
    "train.eval_batches=1",
    "train.threads=1",
    "train.warmup_steps=2",
    "sample.max_new_tokens=2",
    "train.compile=false",
]


def recipe_args(files, tmp_path, shrink: list[str]) -> tuple[Path, list[str]]:
    """A training file of 80 stories, and the arguments every --recipe run here shares."""
    from conftest import make_stories

    train = tmp_path / "train.txt"
    train.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories(80)), encoding="utf-8")
    return train, [
        "--train",
        str(train),
        "--data",
        str(files["data"]),
        "--anchors",
        str(files["anchors"]),
        "--runs",
        str(tmp_path / "runs"),
        "--threads",
        "1",
        *[a for kv in shrink for a in ("--set", kv)],
    ]


@pytest.mark.slow
def test_recipes_are_trained_for_the_same_minutes_and_scored(files, tmp_path, capsys):
    """--recipe v1 --recipe current: both presets trained in this run (shrunk by --set), then scored."""
    bench = load_bench()
    train, args = recipe_args(files, tmp_path, [*SHRINK, "train.batch_size=4"])
    out_json = tmp_path / "rows.json"
    rc = bench.main(["--recipe", "v1", "--recipe", "current", "--minutes", "0.04", "--json", str(out_json), *args])
    assert rc == 0
    rows = json.loads(out_json.read_text())
    names = [r["model"] for r in rows]
    assert names[0] == "stories260K (llama2.c)" and names[1].startswith("v1/checkpoints/")
    assert names[2].startswith("current/checkpoints/")
    for r in rows[1:]:
        assert 0 < r["train_minutes"] <= 0.04 * 1.5 + 0.05  # the same short budget for both (plus the last step)
        assert r["bytes"] == sum(len(s.encode("utf-8")) for s in STORIES)
    assert bench.main(["--recipe", "v1", "--minutes", "0", "--train", str(train), "--data", str(files["data"])]) == 2
    assert "--minutes" in capsys.readouterr().err


def test_token_budget_overrides_replace_the_wall_clock():
    bench = load_bench()
    assert bench.budget_overrides(10.0, None) == ["train.max_minutes=10.0", "train.max_tokens=null"]
    assert bench.budget_overrides(10.0, 4096) == [
        "train.max_tokens=4096",
        "train.max_minutes=null",
        "train.epochs=null",
        "train.schedule_clock=steps",
    ]


@pytest.mark.slow
def test_recipes_trained_for_equal_tokens_see_the_same_tokens(files, tmp_path, capsys):
    """--tokens: v1 and r2 (different batch sizes) both stop after the budget's steps, whatever their speed."""
    bench = load_bench()
    train, args = recipe_args(files, tmp_path, SHRINK)
    rc = bench.main(["--recipe", "v1", "--recipe", "r2", "--tokens", "3000", *args])
    assert rc == 0
    for name, rows_per_step in (("v1", 32), ("r2", 16)):  # the presets' batch sizes; 32 tokens a row
        steps = -(-3000 // (rows_per_step * 32))
        with open(tmp_path / "runs" / name / "metrics.csv", newline="") as f:
            last = [r for r in csv.DictReader(f) if r["step"].isdigit()][-1]
        assert (int(last["step"]), int(last["tokens"])) == (steps, steps * rows_per_step * 32)
    assert bench.main(["--recipe", "v1", "--tokens", "0", "--train", str(train), "--data", str(files["data"])]) == 2
    assert "--tokens" in capsys.readouterr().err
