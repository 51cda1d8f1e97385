"""The command line end to end: every bad input is one line on stderr and exit code 2."""

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_stories, tiny_run_config

from tinylm.cli import COMMANDS, build_parser, main, options_from
from tinylm.config import GENERATION_SURFACES, GenerationConfig, build_config
from tinylm.models.checkpoint import load_checkpoint, save_checkpoint
from tinylm.pipeline import run_pipeline
from tinylm.serving.completions import generation_config
from tinylm.serving.schemas import CompletionRequest
from tinylm.training.metrics import EVAL_SAMPLES, read_eval_samples

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories()), encoding="utf-8")
    cfg = tiny_run_config(root / "run", data)
    summary = run_pipeline(cfg, cfg.out_dir)
    return root / "run", data, summary


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_pipeline_writes_every_artifact(trained_run):
    run, _, summary = trained_run
    for name in (
        "config.yaml",
        "tokenizer.json",
        "metrics.csv",
        "eval.json",
        "samples.txt",
        "report.md",
        "checkpoints/best/model.safetensors",
        "checkpoints/best/config.yaml",
        "checkpoints/last/checkpoint.json",
    ):
        assert (run / name).is_file(), name
    ev = json.loads((run / "eval.json").read_text())
    valid = ev["eval"]["valid"]  # bpb and perplexity are the same summed NLL; a byte-level token spans >= 1 byte
    assert valid["bpb"] == pytest.approx(valid["nll"] / (math.log(2) * valid["bytes"]), rel=1e-9)
    assert valid["token_ppl"] == pytest.approx(math.exp(valid["nll"] / valid["tokens"]), rel=1e-9)
    assert 0 < valid["tokens"] <= valid["bytes"]
    report = (run / "report.md").read_text()
    assert f"{ev['eval']['valid']['bpb']:.4f}" in report  # the report reads the numbers from disk
    # the sample prompts continued at each evaluation (steps 5 and 10), by the model of that step
    at_eval = read_eval_samples(run / EVAL_SAMPLES)
    assert [(r["step"], len(r["samples"])) for r in at_eval] == [(5, 1), (10, 1)]
    assert at_eval[0]["samples"][0]["prompt"] == "ROMEO:" and at_eval[0]["samples"][0]["new_tokens"] > 0


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_checkpoint_save_load_identical_logits(trained_run, tmp_path):
    run, _, _ = trained_run
    model, tok, meta = load_checkpoint(run)
    x = torch.randint(0, tok.vocab_size, (2, 16))
    before = model(x)[0]
    save_checkpoint(tmp_path / "copy", model, tok, info={"step": meta["step"]})
    again, tok2, _ = load_checkpoint(tmp_path / "copy")
    assert torch.equal(again(x)[0], before)
    assert tok2.encode("Once upon a time") == tok.encode("Once upon a time")


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_evaluate_json_keys(trained_run, capsys):
    run, data, _ = trained_run
    code, out, _ = run_cli(capsys, "evaluate", "--checkpoint", run, "--data", data, "--json")
    assert code == 0
    m = json.loads(out)
    assert set(m) == {"token_ppl", "bpb", "word_ppl", "tokens", "bytes", "words"}
    assert m["bytes"] == sum(len(s.encode()) for s in make_stories())


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_generate_prints_text(trained_run, capsys):
    run, _, _ = trained_run
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--checkpoint",
        run,
        "--prompt",
        "Once upon",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
        "--json",
    )
    assert code == 0
    obj = json.loads(out.splitlines()[0])
    assert obj["text"].startswith("Once upon") and obj["tokens"] <= 5


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_long_prompt_is_cropped_with_a_warning(trained_run):
    from tinylm.generation.generate import generate

    model, _, _ = load_checkpoint(trained_run[0])
    with pytest.warns(UserWarning, match="longer than the context"):
        out = generate(model, list(range(4, 4 + 40)), 3, temperature=0)
    assert len(out) <= 3


def _bad(capsys, *argv, match):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    errors = [line for line in err.splitlines() if ": error: " in line]  # progress lines may come before it
    assert len(errors) == 1 and match in errors[0] and "Traceback" not in err, err


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_bad_inputs_are_one_line_errors(trained_run, tmp_path, capsys):
    run, data, _ = trained_run
    out = tmp_path / "out"
    _bad(
        capsys, "train", "--out", out, "data.source=text", f"data.train={tmp_path / 'nope.txt'}", match="does not exist"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _bad(capsys, "train", "--out", out, "data.source=text", f"data.train={empty}", match="is empty")
    small = tmp_path / "small.txt"
    small.write_text("hello world")
    _bad(
        capsys,
        "train",
        "--out",
        out,
        "data.source=text",
        f"data.train={small}",
        f"data.valid={small}",
        "tokenizer.type=char",
        "model.context_length=64",
        match="fewer than one context window",
    )
    _bad(capsys, "train", "--out", out, "model.nope=1", match="unknown config key model.nope")
    # overrides on both sides of an option are all applied (argparse alone rejects the second group)
    _bad(capsys, "train", "data.source=text", "--out", out, "model.nope=1", match="unknown config key model.nope")
    _bad(capsys, "train", "--out", out, "train.max_steps=many", match="expects an integer")
    _bad(
        capsys,
        "train",
        "--out",
        out,
        "data.source=tinystories",
        f"data.train={data}",
        "tokenizer.type=foo",
        match="tokenizer.type='foo' is not one of bpe, char, word, word_bpe",
    )
    _bad(
        capsys,
        "train",
        "--out",
        out,
        "data.source=tinystories",
        f"data.train={data}",
        "tokenizer.vocab_size=300",
        "model.n_heads=5",
        match="does not divide",
    )
    _bad(capsys, "generate", "--checkpoint", run, "--prompt", "", match="encodes to no tokens")
    _bad(capsys, "generate", "--checkpoint", tmp_path / "missing", "--prompt", "a", match="does not exist")


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_broken_checkpoints_are_named(trained_run, tmp_path, capsys):
    import shutil

    run, data, _ = trained_run
    broken = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "best", broken)
    (broken / "model.safetensors").unlink()
    _bad(capsys, "evaluate", "--checkpoint", broken, "--data", data, match="missing model.safetensors")
    shutil.rmtree(broken)
    shutil.copytree(run / "checkpoints" / "best", broken)
    meta = json.loads((broken / "checkpoint.json").read_text())
    meta["version"] = 99
    (broken / "checkpoint.json").write_text(json.dumps(meta))
    _bad(capsys, "evaluate", "--checkpoint", broken, "--data", data, match="format version 99")
    (broken / "checkpoint.json").write_text(json.dumps({**meta, "version": 1}))
    (broken / "model.safetensors").write_bytes(b"garbage")
    _bad(capsys, "evaluate", "--checkpoint", broken, "--data", data, match="corrupt")


@pytest.mark.slow  # trained_run: the whole pipeline, plots and report included (~2 s once)
def test_failed_run_keeps_the_previous_checkpoint(trained_run, capsys):
    run, data, _ = trained_run
    before = (run / "checkpoints/best/model.safetensors").read_bytes()
    _bad(
        capsys,
        "train",
        "--out",
        run,
        "data.source=tinystories",
        f"data.train={data}",
        "tokenizer.vocab_size=300",
        "model.n_heads=5",
        match="does not divide",
    )
    assert (run / "checkpoints/best/model.safetensors").read_bytes() == before
    load_checkpoint(run)


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path):
    exe = Path(sys.executable).with_name("tinylm")
    cmd = [
        str(exe) if exe.exists() else sys.executable,
        *([] if exe.exists() else ["-m", "tinylm.cli"]),
        "demo",
        "--quick",
        "--out",
        str(tmp_path / "demo"),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bits per byte" in proc.stderr and "demo finished" in proc.stdout  # progress on stderr, result on stdout
    for name in ("report.md", "metrics.csv", "samples.txt", "config.yaml", "checkpoints/best/model.safetensors"):
        assert (tmp_path / "demo" / name).is_file()


def test_commands_that_do_not_serve_start_without_the_web_stack():
    """Only `tinylm serve` imports FastAPI, pydantic and uvicorn: `tinylm --version`, `--help` and
    a training run start without them."""
    code = (
        "import sys; from tinylm.cli import main; assert main(['--version']) == 0; "
        "assert main(['train', '--help']) == 0; "
        "print(sorted(m for m in ('fastapi', 'pydantic', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_every_subcommand_has_help_listing_every_option(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for name, fn in COMMANDS.items():
        assert name in top
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: tinylm {name}") and fn.__doc__.split(".")[0].split()[0] in out
        options = typing.get_type_hints(fn)[next(iter(inspect.signature(fn).parameters))]
        for f in dataclasses.fields(options):
            shown = f.name if f.metadata["positional"] else f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            assert shown in out or (f.metadata["metavar"] or "@") in out, (name, f.name)
    assert set(COMMANDS) == {
        "demo",
        "prepare",
        "train",
        "generate",
        "evaluate",
        "export-hf",
        "export-tokenizer",
        "export-gguf",
        "export-llama2c",
        "report",
        "attention",
        "serve",
        "check",
        "experiments",
        "study",
        "tokenizer-stats",
    }


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.schedule=cosin", "train.schedule='cosin' is not one of cosine, linear, constant"),
        ("train.precision=fp8", "train.precision='fp8' is not one of fp32, bf16, fp16"),
        ("model.positions=alibi", "model.positions='alibi' is not one of learned, sinusoidal, rope, none"),
        ("train.device=tpu", "train.device='tpu' is not one of auto, cpu, cuda, cuda:N, mps"),
        ("train.schedule_clock=wall train.max_minutes=null", "train.schedule_clock=wall needs a wall budget"),
        ("model.dropout=1.5", "model.dropout must be in [0, 1) (got 1.5)"),
    ],
)
def test_a_bad_option_is_refused_before_any_data_is_read(tmp_path, capsys, override, message):
    """The data file does not exist: the option's error comes first, and nothing is written."""
    out = tmp_path / "out"
    _bad(
        capsys,
        "train",
        "--config",
        "demo",
        "--out",
        out,
        "data.source=text",
        f"data.train={tmp_path / 'none.txt'}",
        *override.split(),
        match=message,
    )
    assert not out.exists()


def test_serve_port_out_of_range_is_refused(capsys):
    _bad(capsys, "serve", "--checkpoint", "none", "--port", "80000", match="--port must be in [0, 65535] (got 80000)")


# a valid value other than the default for every decoding knob
KNOB_VALUES = {
    "max_new_tokens": 7,
    "min_new_tokens": 2,
    "temperature": 0.5,
    "top_k": 3,
    "top_p": 0.9,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "no_repeat_ngram_size": 2,
    "stop_ids": (5,),
    "stop_strings": ("x",),
    "seed": 9,
    "seed_per_row": True,
    "use_cache": False,
    "beam_width": 3,
    "length_penalty": 0.5,
    "num_return_sequences": 2,
    "early_stopping": True,
    "compile": True,
}


def test_every_decoding_knob_reaches_generation_from_the_cli_the_api_and_the_sample_section():
    """GenerationConfig is the one definition; each surface offers every knob, except those
    GENERATION_SURFACES names with None (and the reason beside them)."""
    assert set(KNOB_VALUES) == {f.name for f in dataclasses.fields(GenerationConfig)}
    parser, served = build_parser(), SimpleNamespace(tokenizer=SimpleNamespace(stop_ids=[3]), vocab_size=50)
    for name, value in KNOB_VALUES.items():
        flag, field = GENERATION_SURFACES.get(name, ("--" + name.replace("_", "-"), name))
        words = [str(v) for v in value] if isinstance(value, tuple) else [] if isinstance(value, bool) else [str(value)]
        if flag is not None:
            argv = ["generate", "--checkpoint", "x"] + [w for word in words for w in (flag, word)] or [flag]
            ns = parser.parse_args(argv if words else argv + [flag])
            assert getattr(options_from(ns, ns._options), name) == value, name
        if field is not None:
            body = {"model": "m", "prompt": "a", field: list(value) if isinstance(value, tuple) else value}
            if name == "num_return_sequences":  # n is the beams returned under beam search, else samples
                body["beam_width"] = 3
            cfg = generation_config(CompletionRequest(**body), served, tuple(body.get("stop", ())), seed=9)
            assert getattr(cfg, name) == (value if name != "stop_ids" else (3, 5)), name
        beam = ["sample.beam_width=3"] if name == "num_return_sequences" else []
        sample = build_config(
            None, [f"sample.{name}={json.dumps(list(value) if isinstance(value, tuple) else value)}", *beam]
        )
        assert getattr(sample.sample.generation(), name) == value, name
    offered_nowhere = [name for name, (flag, field) in GENERATION_SURFACES.items() if flag is None and field is None]
    assert offered_nowhere == ["seed_per_row"]  # always on: prompt (choice) i samples with seed + i


def test_study_trains_gpts_unless_no_gpt(monkeypatch):
    """A --no-... flag of a field whose name does not say 'no' would store False by default: the
    study's GPT stage is on unless --no-gpt is given."""
    seen = []
    monkeypatch.setattr("tinylm.cli.run_study", lambda cfg: seen.append(cfg.gpt.enabled))
    assert main(["study", "shakespeare", "--out", "unused"]) == 0
    assert main(["study", "shakespeare", "--out", "unused", "--no-gpt"]) == 0
    assert seen == [True, False]
