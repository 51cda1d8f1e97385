"""Property-based fuzzing of every input tinylm reads (hypothesis, derandomized).

The rule under test: bad input (config values, data files, tokenizer files, config files, every
file of a checkpoint, generation knobs) ends in exit code 0 or one `tinylm CMD: error: ...` line
with exit code 2, never an exception out of ``tinylm.cli.main``; and a failed run loses nothing
already saved. Minimal examples of every crash the fuzzing found are kept as explicit tests at
the end of the file.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import struct
import types
import typing
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import yaml
from conftest import examples, make_stories, slow_except, tiny_run_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tinylm.cli import main
from tinylm.config import (
    DataConfig,
    EmbeddingsConfig,
    ModelConfig,
    RunConfig,
    SampleConfig,
    TokenizerConfig,
    TrainConfig,
    build_config,
)
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import metrics
from tinylm.models.checkpoint import load_checkpoint
from tinylm.pipeline import run_pipeline

SECTIONS = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
    "embeddings": EmbeddingsConfig,
}
FIELDS = [(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
CKPT_FILES = ("model.safetensors", "checkpoint.json", "tokenizer.json", "config.yaml")
RESUME_FILES = CKPT_FILES + ("training_state.json", "optimizer.safetensors", "rng.safetensors")

# TINYLM_FUZZ_SCALE=10 runs ten times the examples (a deeper search; the default keeps the file fast)
SCALE = int(os.environ.get("TINYLM_FUZZ_SCALE", "1"))
FUZZ = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
}


# ----------------------------------------------------------------------------- one tiny run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A resumable run of a char-level GPT with 8k parameters (2 steps, ~2 s), one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fuzz")
    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories(20)), encoding="utf-8")
    cfg = tiny_run_config(root / "run", data, max_steps=2, eval_interval=2, eval_batches=1)
    cfg.tokenizer.type, cfg.tokenizer.vocab_size = "char", 0
    cfg.model = ModelConfig(context_length=16, d_model=16, n_layers=1, n_heads=2)
    cfg.sample.prompts, cfg.sample.max_new_tokens = ["Once"], 4
    run_pipeline(cfg, cfg.out_dir)
    yield root / "run", data
    torch.set_num_threads(threads)


def call(capsys, *argv) -> tuple[int, str, str]:
    """``main`` in-process: exit code 0 or 2, never a traceback, and exit 2 is one error line."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert code in (0, 2), (argv, code, err[-2000:])
    if code == 2:
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1, err[-2000:]
    return code, out, err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------- payloads
def _npz() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.arange(4))
    return buf.getvalue()


def _safetensors(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


CRAFTED = {
    "empty": b"",
    "utf8": "Once upon a tíme ✓ 🐈\n".encode(),
    "truncated_json": b'{"format": "tinylm-tokenizer", "version": 1, "ty',
    "json_list": b"[1, 2, 3]",
    "json_string": b'"text"',
    "json_null": b"null",
    "json_number": b"42",
    "json_dict": b'{"a": {"b": []}}',
    "json_deep": b"[" * 3000,
    "npz": _npz(),
    "zip_header": b"PK\x03\x04" + bytes(26),
    "safetensors_garbage": _safetensors(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"zz"),
    "safetensors_huge_header": struct.pack("<Q", 2**62) + b"{}",
    "safetensors_bad_json": _safetensors(b"{nope}"),
    "safetensors_other": st_save({"x": torch.zeros(2)}),
    "nul": b"\x00" * 64,
    "bom": b"\xef\xbb\xbf{}",
    "latin1": "café".encode("latin-1"),
    "yaml_list": b"- a\n- b\n",
    "yaml_bad": b"model: {d_model: [}\n",
    "yaml_tag": b"!!python/object/apply:os.system ['true']\n",
    "yaml_section_scalar": b"model: 3\n",
    "yaml_nan": b"train:\n  lr: .nan\n",
    "toml": b"[model]\nd_model = 'x'\n",
    "llama2c_tokenizer": struct.pack("<i", 4) + b"".join(struct.pack("<fi", 0.0, 1) + bytes([c]) for c in b"abc"),
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)

payloads = st.one_of(
    st.sampled_from(sorted(CRAFTED.values())),
    st.binary(max_size=300),
    st.text(max_size=120).map(str.encode),
    json_values.map(lambda v: json.dumps(v).encode()),
)


@st.composite
def mutated_tree(draw, tree):
    """``tree`` (parsed JSON/YAML) with one node replaced by a random value, or one key dropped."""
    if isinstance(tree, (dict, list)) and tree and draw(st.integers(0, 3)):
        keys = list(tree) if isinstance(tree, dict) else list(range(len(tree)))
        key = draw(st.sampled_from(keys))
        out = dict(tree) if isinstance(tree, dict) else list(tree)
        if isinstance(tree, dict) and draw(st.integers(0, 5)) == 0:
            del out[key]
        else:
            out[key] = draw(mutated_tree(tree[key]))
        return out
    return draw(json_values | st.sampled_from([-1, 0, 2**63, 10**30, "", "nan", [], {}]))


def mutated_bytes(original: bytes):
    """Truncated, or one byte changed."""
    return st.one_of(
        st.integers(0, max(0, len(original) - 1)).map(lambda n: original[:n]),
        st.tuples(st.integers(0, max(0, len(original) - 1)), st.integers(0, 255)).map(
            lambda t: original[: t[0]] + bytes([t[1]]) + original[t[0] + 1 :]
        ),
    )


@st.composite
def mutated_tensors(draw, original: bytes):
    """A valid safetensors file whose tensors do not fit: dropped, reshaped, retyped, non-finite, extra."""
    tensors = dict(st_load(original))
    key = draw(st.sampled_from(sorted(tensors)))
    how = draw(st.sampled_from(["drop", "reshape", "int", "half", "nan", "inf", "extra", "scalar"]))
    t = tensors[key]
    if how == "drop":
        del tensors[key]
    elif how == "reshape":
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
        tensors[key] = torch.zeros(shape, dtype=t.dtype)
    elif how == "int":
        tensors[key] = t.to(torch.int64)
    elif how == "half":
        tensors[key] = t.to(torch.float16)
    elif how in ("nan", "inf") and t.is_floating_point():
        tensors[key] = torch.full_like(t, math.nan if how == "nan" else math.inf)
    elif how == "extra":
        tensors["zz.extra"] = torch.ones(3)
    elif how == "scalar":
        tensors[key] = torch.tensor(7, dtype=t.dtype)
    return st_save(tensors)


def file_payloads(original: bytes, name: str):
    """Random/crafted bytes, or the real file ``original`` slightly damaged."""
    options = [payloads, mutated_bytes(original)]
    if name.endswith(".json"):
        options.append(mutated_tree(json.loads(original)).map(lambda v: json.dumps(v).encode()))
    if name.endswith(".yaml"):
        options.append(mutated_tree(yaml.safe_load(original)).map(lambda v: yaml.safe_dump(v).encode()))
    if name.endswith(".safetensors"):
        options.append(mutated_tensors(original))
    return st.one_of(options + options[2:])  # the damaged real file half of the time


# ------------------------------------------------------------------- a. config overrides
NASTY_VALUES = [
    "",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e309",
    "-1e309",
    "none",
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1.5",
    "1_000",
    str(2**64),
    str(-(2**200)),
    "1e-320",
    "[]",
    "[1, 2]",
    '["a", "b"]',
    '[["a"]]',
    "{}",
    '{"a": 1}',
    "[" * 5000,
    "x=y",
    " ",
    "\x00",
    "🐈",
    "0x10",
    "1e3",
    "-0.0",
]

override_values = st.one_of(
    st.sampled_from(NASTY_VALUES),
    st.text(max_size=20),
    st.integers().map(str),
    st.floats().map(repr),
    st.lists(st.integers() | st.text(max_size=5) | st.floats(), max_size=4).map(json.dumps),
)


def _build_and_resolve(section: str, name: str, value: str) -> None:
    try:
        cfg = build_config(None, [f"{section}.{name}={value}"])
    except TinyLMError:
        return
    try:
        dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or 50).resolved()
    except TinyLMError:
        pass


@settings(max_examples=examples(300 * SCALE), **FUZZ)
@given(field=st.sampled_from(FIELDS), value=override_values)
def test_fuzz_config_overrides(field, value):
    _build_and_resolve(*field, value)


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, object, dataclasses.Field]]:
    """(dotted key, type, field) of every option of a config dataclass, from its schema."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", hints[f.name], f))
    return out


LEAVES = _leaves(RunConfig)


def _base(kind):
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1 else kind


def invalid_values(leaf) -> st.SearchStrategy:
    """Values the schema itself says are wrong for this option: outside its Literal, outside its
    range, or not of its type."""
    _, kind, f = leaf
    kind = _base(kind)
    if typing.get_origin(kind) is Literal:
        choices = {str(c) for c in typing.get_args(kind)}
        return st.text(min_size=1, max_size=12).filter(lambda t: t not in choices and t.lower() not in ("none", "null"))
    ge, gt, le, lt = f.metadata.get("range", (None,) * 4)
    item = typing.get_args(kind)[0] if typing.get_origin(kind) in (list, tuple) else kind
    numbers = []
    if item is int:
        numbers += [st.integers(max_value=math.ceil(b) - 1) for b in (ge,) if b is not None]
        numbers += [st.integers(max_value=math.floor(b)) for b in (gt,) if b is not None]
        numbers += [st.integers(min_value=math.floor(b) + 1) for b in (le,) if b is not None]
        numbers += [st.integers(min_value=math.ceil(b)) for b in (lt,) if b is not None]
        numbers.append(st.sampled_from(["1.5", "ten", "true"]))
    elif item is float:
        finite = {"allow_nan": False, "allow_infinity": False}
        numbers += [st.floats(max_value=b, exclude_max=True, **finite) for b in (ge,) if b is not None]
        numbers += [st.floats(max_value=b, **finite) for b in (gt,) if b is not None]
        numbers += [st.floats(min_value=b, exclude_min=True, **finite) for b in (le,) if b is not None]
        numbers += [st.floats(min_value=b, **finite) for b in (lt,) if b is not None]
        numbers.append(st.sampled_from(["nan", "inf", "fast", "true"]))
    elif item is bool:
        numbers.append(st.sampled_from(["maybe", "2", "yes please"]))
    if not numbers:
        return st.nothing()
    return st.one_of(numbers).map(lambda v: json.dumps([v]) if item is not kind else str(v))


INVALID = [leaf for leaf in LEAVES if not invalid_values(leaf).is_empty]


def test_the_schema_declares_the_closed_choices_and_ranges():
    """The options the schema can refuse include the two the issue found unchecked (a cosin typo
    trained as cosine) and every closed choice."""
    keys = {key for key, _, _ in INVALID}
    assert {
        "train.schedule",
        "train.schedule_clock",
        "train.precision",
        "train.optimizer",
        "data.source",
        "data.batching",
        "model.ffn",
        "tokenizer.type",
        "embeddings.kind",
        "train.lr",
        "model.dropout",
        "sample.top_p",
    } <= keys
    assert len(INVALID) >= 80, len(INVALID)


@settings(max_examples=examples(400 * SCALE), **FUZZ)
@given(data=st.data())
def test_fuzz_every_invalid_value_from_the_schema_is_refused(data):
    """Each value drawn outside an option's declared choices, range or type is refused at load,
    with one message naming the key."""
    key, kind, f = data.draw(st.sampled_from(INVALID))
    value = data.draw(invalid_values((key, kind, f)))
    with pytest.raises(TinyLMError) as refused:
        build_config(None, [f"{key}={value}"])
    assert key in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("field", slow_except(FIELDS[0], FIELDS), ids=[f"{s}.{n}" for s, n in FIELDS])
def test_every_field_takes_every_nasty_value(field):
    for value in NASTY_VALUES:
        _build_and_resolve(*field, value)


# ------------------------------------------------------------------------ b. input files
@settings(max_examples=50 * SCALE, **FUZZ)
@given(
    payload=payloads,
    suffix=st.sampled_from([".txt", ".jsonl", ".json", ""]),
    source=st.sampled_from(["text", "tinystories"]),
)
@pytest.mark.slow
def test_fuzz_data_file(tiny_run, tmp_path_factory, capsys, payload, suffix, source):
    run, _ = tiny_run
    path = tmp_path_factory.getbasetemp() / f"fuzz-data{suffix}"
    path.write_bytes(payload)
    code, out, _ = call(capsys, "evaluate", "--checkpoint", run, "--data", path, "--json")
    if code == 0:
        json.loads(out)  # JSON output stays JSON (no NaN/Infinity literals)
    call(capsys, "tokenizer-stats", "--tokenizer", run / "tokenizer.json", "--data", path)
    call(
        capsys,
        "prepare",
        "--out",
        path.with_name("fuzz-prepare"),
        f"data.source={source}",
        f"data.train={path}",
        "tokenizer.type=char",
    )


@pytest.fixture(scope="module")
def tokenizer_files(tiny_run):
    """The run's char tokenizer file and a BPE and a word-level one trained on the same stories."""
    from tinylm.tokenizers.io import new_tokenizer

    run = tiny_run[0]
    texts = make_stories(20)
    files = {"char": (run / "tokenizer.json").read_bytes()}
    for kind, vocab in (("bpe", 290), ("word", 40)):
        path = run.parent / f"{kind}.json"
        new_tokenizer(kind).train(texts, vocab).save(path)
        files[kind] = path.read_bytes()
    return files


@settings(max_examples=60 * SCALE, **FUZZ)
@given(
    data=st.data(),
    name=st.sampled_from(["tokenizer.json", "tokenizer.bin", "tok"]),
    kind=st.sampled_from(["char", "bpe", "word"]),
)
@pytest.mark.slow
def test_fuzz_tokenizer_file(tiny_run, tokenizer_files, tmp_path_factory, capsys, data, name, kind):
    run, stories = tiny_run
    path = tmp_path_factory.getbasetemp() / "fuzz-tok" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data.draw(file_payloads(tokenizer_files[kind], ".json")))
    call(capsys, "tokenizer-stats", "--tokenizer", path, "--data", stories)
    call(capsys, "generate", "--checkpoint", run, "--tokenizer", path, "--prompt", "Once", "--max-new-tokens", "3")


@pytest.mark.slow
@settings(max_examples=40 * SCALE, **FUZZ)
@given(data=st.data(), suffix=st.sampled_from([".yaml", ".toml"]))
def test_fuzz_config_file(tiny_run, tmp_path_factory, capsys, data, suffix):
    """A config file read by train/prepare; the data file is missing, so whatever the file says,
    the run stops right after the config is read (tiny real runs are in the slow test below)."""
    run, _ = tiny_run
    base = tmp_path_factory.getbasetemp() / "fuzz-config"
    base.mkdir(exist_ok=True)
    path = base / f"config{suffix}"
    path.write_bytes(data.draw(file_payloads((run / "config.yaml").read_bytes(), ".yaml")))
    fast_fail = ["--out", base / "out", "data.source=text", f"data.train={base / 'missing.txt'}", "train.max_steps=1"]
    call(capsys, "train", "--config", path, *fast_fail)
    call(capsys, "prepare", "--config", path, *fast_fail)


@pytest.fixture(scope="module")
def ckpt_copy(tiny_run, tmp_path_factory):
    """A fresh copy of the tiny run's best checkpoint, with one file replaced."""
    best = tiny_run[0] / "checkpoints" / "best"
    target = tmp_path_factory.mktemp("fuzz-ckpt") / "ckpt"

    def make(name: str, payload: bytes) -> Path:
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(best, target)
        (target / name).write_bytes(payload)
        return target

    return best, make


@pytest.mark.slow
@settings(max_examples=60 * SCALE, **FUZZ)
@given(data=st.data(), name=st.sampled_from(CKPT_FILES))
def test_fuzz_checkpoint_files(tiny_run, ckpt_copy, capsys, data, name):
    best, make = ckpt_copy
    ckpt = make(name, data.draw(file_payloads((best / name).read_bytes(), name)))
    call(capsys, "generate", "--checkpoint", ckpt, "--prompt", "Once", "--max-new-tokens", "3", "--seed", "1")
    call(capsys, "evaluate", "--checkpoint", ckpt, "--data", tiny_run[1], "--max-docs", "1", "--json")


@pytest.mark.slow
@settings(max_examples=20 * SCALE, **FUZZ)
@given(data=st.data(), name=st.sampled_from(CKPT_FILES))
def test_fuzz_checkpoint_files_attention_export_hf(ckpt_copy, tmp_path_factory, capsys, data, name):
    """The same checkpoint loader, through the two commands that write files (PNGs, a HF model)."""
    best, make = ckpt_copy
    ckpt = make(name, data.draw(file_payloads((best / name).read_bytes(), name)))
    out = tmp_path_factory.getbasetemp()
    call(capsys, "attention", "--checkpoint", ckpt, "--text", "Once", "--out", out / "fuzz-attention")
    call(capsys, "export-hf", "--checkpoint", ckpt, "--out", out / "fuzz-hf")


@pytest.fixture(scope="module")
def llama2c_files(tmp_path_factory):
    """A tiny Llama-shaped model as a llama2.c .bin, and a tokenizer.bin of the same vocabulary."""
    from tinylm.interop.llama2c import save_llama2c
    from tinylm.models.gpt import GPT

    root = tmp_path_factory.mktemp("fuzz-llama2c")
    cfg = ModelConfig(
        vocab_size=262,
        context_length=16,
        d_model=16,
        n_layers=1,
        n_heads=2,
        positions="rope",
        norm="rmsnorm",
        ffn="swiglu",
        bias=False,
        d_ff=32,
    )
    model_path = save_llama2c(GPT(cfg), root / "model.bin")
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)] + [b" ", b"a", b" a"]
    tok = root / "tokenizer.bin"
    tok.write_bytes(
        struct.pack("<i", 4) + b"".join(struct.pack("<fi", -float(i), len(p)) + p for i, p in enumerate(pieces))
    )
    return model_path, tok


@pytest.mark.slow
@settings(max_examples=30 * SCALE, **FUZZ)
@given(data=st.data(), which=st.sampled_from(["model", "tokenizer"]))
def test_fuzz_llama2c_files(llama2c_files, tmp_path_factory, capsys, data, which):
    """A llama2.c checkpoint or its tokenizer.bin damaged (truncated, a byte changed, random)."""
    model_path, tok = llama2c_files
    original = (model_path if which == "model" else tok).read_bytes()
    path = tmp_path_factory.getbasetemp() / f"fuzz-llama2c-{which}.bin"
    path.write_bytes(data.draw(st.one_of(payloads, mutated_bytes(original), mutated_bytes(original))))
    model, tokenizer = (path, tok) if which == "model" else (model_path, path)
    call(
        capsys, "generate", "--checkpoint", model, "--tokenizer", tokenizer, "--prompt", "a a", "--max-new-tokens", "3"
    )


@pytest.fixture(scope="module")
def hf_dir(tiny_run, tmp_path_factory):
    """The tiny run exported as a Hugging Face GPT-2 directory (imports transformers: seconds)."""
    from transformers.utils import logging as hf_logging

    out = tmp_path_factory.mktemp("fuzz-hf") / "hf"
    assert main(["export-hf", "--checkpoint", str(tiny_run[0]), "--out", str(out)]) == 0
    # transformers' log handler keeps the stderr of the test that imported it (closed by the next
    # capsys test, then "--- Logging error ---" with a traceback); its load reports are not ours
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield out
    hf_logging.set_verbosity(verbosity)


@pytest.mark.slow
@settings(max_examples=20 * SCALE, **FUZZ)
@given(data=st.data(), name=st.sampled_from(["config.json", "model.safetensors", "tinylm_tokenizer.json"]))
def test_fuzz_hf_dir_files(tiny_run, hf_dir, tmp_path_factory, capsys, data, name):
    copy = tmp_path_factory.getbasetemp() / "fuzz-hf-copy"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(hf_dir, copy)
    (copy / name).write_bytes(data.draw(file_payloads((hf_dir / name).read_bytes(), name)))
    call(capsys, "generate", "--checkpoint", copy, "--prompt", "Once", "--max-new-tokens", "3")
    call(capsys, "evaluate", "--checkpoint", copy, "--data", tiny_run[1], "--max-docs", "1")


@pytest.mark.slow
@settings(max_examples=25 * SCALE, **FUZZ)
@given(data=st.data(), name=st.sampled_from(RESUME_FILES))
def test_fuzz_resume_files(tiny_run, tmp_path_factory, capsys, data, name):
    """`train --resume` with one file of a checkpoint (or of both) damaged: exit 0 or 2; a resume
    refused before training leaves every file as it was, and a failed one loses no checkpoint
    that loaded before."""
    run, _ = tiny_run
    copy = tmp_path_factory.getbasetemp() / "fuzz-resume"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report*"))
    payload = data.draw(file_payloads((run / "checkpoints" / "last" / name).read_bytes(), name))
    for sub in data.draw(st.sampled_from([("last",), ("best", "last")])):
        (copy / "checkpoints" / sub / name).write_bytes(payload)
    before = snapshot(copy / "checkpoints")
    loadable = [sub for sub in ("best", "last") if _loads(copy / "checkpoints" / sub)]
    code, _, err = call(capsys, "train", "--resume", copy)
    if code == 2 and "resuming from" not in err:
        assert snapshot(copy / "checkpoints") == before
    if code == 2:
        assert all(_loads(copy / "checkpoints" / sub) for sub in loadable)


def _loads(ckpt: Path) -> bool:
    try:
        load_checkpoint(ckpt)
        return True
    except TinyLMError:
        return False


# ------------------------------------------------------------------------ c. generation knobs
def _number_text():
    return st.one_of(
        st.sampled_from(
            ["0", "-1", "1e-9", "1e308", "nan", "inf", "-inf", "-0.0", "abc", "", "0.5", "1", "2", "1e400"]
        ),
        st.floats().map(repr),
        st.integers(-(10**20), 10**20).map(str),
    )


def _small_int_text(lo=-3, hi=24):
    return st.one_of(st.integers(lo, hi).map(str), st.sampled_from(["", "x", "1.5", "-0", "1e3"]))


KNOBS = {
    "--temperature": _number_text(),
    "--top-k": st.one_of(_small_int_text(-3, 400), st.just(str(10**30))),
    "--top-p": _number_text(),
    "--min-p": _number_text(),
    "--repetition-penalty": _number_text(),
    "--no-repeat-ngram-size": st.one_of(_small_int_text(-3, 30), st.just(str(10**30))),
    "--max-new-tokens": _small_int_text(),
    "--min-new-tokens": _small_int_text(),
    "--beam-width": _small_int_text(-3, 400),
    "--num-return-sequences": _small_int_text(-3, 8),
    "--batch-size": st.one_of(_small_int_text(-3, 8), st.just(str(10**30))),
    "--length-penalty": _number_text(),
}


@settings(max_examples=60 * SCALE, **FUZZ)
@given(
    knobs=st.fixed_dictionaries({}, optional=KNOBS),
    flags=st.sets(st.sampled_from(["--no-cache", "--stream", "--json"])),
    prompts=st.lists(st.sampled_from(["Once", "The dog", "x" * 40, "🐈"]), min_size=1, max_size=3),
)
@pytest.mark.slow
def test_fuzz_generate_knobs(tiny_run, capsys, knobs, flags, prompts):
    run, _ = tiny_run
    argv = ["generate", "--checkpoint", run, "--seed", "3", *sorted(flags)]
    for p in prompts:
        argv += ["--prompt", p]
    argv += [f"{flag}={value}" for flag, value in knobs.items()]
    call(capsys, *argv)


# ------------------------------------------------------------------ known crashes, kept
def test_metrics_report_an_overflowing_perplexity_as_inf():
    m = metrics(total_nll=50_000.0, n_tokens=10_000, n_bytes=1000, n_words=1)
    assert m["word_ppl"] == math.inf and math.isclose(m["token_ppl"], math.exp(5.0))
    assert metrics(1e6, 1, 1, 1)["token_ppl"] == math.inf
    assert math.isnan(metrics(1.0, 0, 0, 0)["token_ppl"])


@pytest.fixture
def binary_file(tmp_path):
    """Few whitespace-separated words and many tokens: the mean NLL per word overflows exp()."""
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(33, 256)) * 8)
    return path


@pytest.mark.slow
def test_evaluate_binary_file_reports_inf_word_perplexity(tiny_run, binary_file, capsys):
    run, _ = tiny_run
    code, out, err = call(capsys, "evaluate", "--checkpoint", run, "--data", binary_file)
    assert code == 0, err
    assert "word perplexity  inf" in out


@pytest.mark.slow
def test_evaluate_binary_file_json_says_why_not_finite(tiny_run, binary_file, capsys):
    run, _ = tiny_run
    code, out, err = call(capsys, "evaluate", "--checkpoint", run, "--data", binary_file, "--json")
    assert code == 0, err
    m = json.loads(out)
    assert m["word_ppl"] is None and "too large for exp()" in m["not_finite"]["word_ppl"]
    assert m["bpb"] > 0 and m["words"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_train_lr_must_be_finite(tiny_run, tmp_path, capsys, value):
    _, stories = tiny_run
    code, _, err = call(
        capsys,
        "train",
        "--out",
        tmp_path / "out",
        "data.source=tinystories",
        f"data.train={stories}",
        "train.max_steps=1",
        "model.n_layers=1",
        "model.d_model=16",
        "model.n_heads=2",
        f"train.lr={value}",
    )
    assert code == 2
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert "train.lr" in errors[0] and "finite" in errors[0], err
    assert not (tmp_path / "out").exists()  # refused before anything was written


# ------------------------------------------- minimal examples of the crashes the fuzzing found
# Each of these was a Python traceback (the exception is named in the comment); now one line.
DEEP_JSON = b"[" * 3000


def _json_edit(**changes):
    """A function of the original file's bytes: the JSON object with keys replaced (None: dropped)."""

    def edit(original: bytes) -> bytes:
        obj = json.loads(original)
        for key, value in changes.items():
            if value is None:
                obj.pop(key, None)
            else:
                obj[key] = value
        return json.dumps(obj).encode()

    return edit


def _model_config_edit(**changes):
    def edit(original: bytes) -> bytes:
        obj = json.loads(original)
        obj["model_config"].update(changes)
        return json.dumps(obj).encode()

    return edit


def _tensor_edit(how):
    def edit(original: bytes) -> bytes:
        tensors = dict(st_load(original))
        how(tensors)
        return st_save(tensors)

    return edit


def _reshape_embedding(t):
    t["tok_emb.weight"] = torch.zeros(3, 5)


def _nan_norm(t):
    t["norm_f.weight"] = torch.full_like(t["norm_f.weight"], math.nan)


def _drop_embedding(t):
    del t["tok_emb.weight"]


DAMAGED_CHECKPOINT_FILES = [
    # (file, new content or a function of the old, part of the error line)
    ("checkpoint.json", b"[1, 2, 3]", "not an object"),  # AttributeError: 'list' object has no attribute 'get'
    ("checkpoint.json", "café".encode("latin-1"), "is corrupt"),  # UnicodeDecodeError
    ("checkpoint.json", DEEP_JSON, "is corrupt"),  # RecursionError
    ("checkpoint.json", _model_config_edit(d_model="wide"), "model_config.d_model expects an integer"),  # TypeError
    ("checkpoint.json", _model_config_edit(n_layers=10**7), "far larger"),  # minutes building 10M blocks
    ("checkpoint.json", _json_edit(model_config=None), 'no "model_config"'),  # KeyError
    ("model.safetensors", _tensor_edit(_reshape_embedding), "does not match its model config"),  # RuntimeError
    ("model.safetensors", _tensor_edit(_drop_embedding), "does not match its model config"),  # KeyError
    ("model.safetensors", _tensor_edit(_nan_norm), "non-finite"),  # RuntimeError in torch.multinomial
    ("tokenizer.json", DEEP_JSON, "not a tinylm JSON tokenizer"),  # RecursionError
    ("tokenizer.json", _json_edit(type=[]), "unknown tokenizer type"),  # TypeError: unhashable type: 'list'
    ("tokenizer.json", _json_edit(chars=[[], "e"]), "single characters"),  # TypeError
    ("tokenizer.json", _json_edit(chars=None), "single characters"),  # KeyError: 'chars'
    # the prompt's characters get ids past the model's 302: IndexError in the embedding
    ("tokenizer.json", _json_edit(chars=[chr(0x4E00 + i) for i in range(400)] + list("Once")), "pieces but the model"),
]


@pytest.mark.parametrize(
    "name, payload, match",
    DAMAGED_CHECKPOINT_FILES,
    ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(DAMAGED_CHECKPOINT_FILES)],
)
@pytest.mark.slow
def test_damaged_checkpoint_file_is_named(ckpt_copy, capsys, name, payload, match):
    best, make = ckpt_copy
    ckpt = make(name, payload((best / name).read_bytes()) if callable(payload) else payload)
    code, _, err = call(capsys, "generate", "--checkpoint", ckpt, "--prompt", "Once", "--max-new-tokens", "2")
    assert code == 2 and match in err and name in err, err


def _llama2c_tokenizer(pieces: list[bytes]) -> bytes:
    return struct.pack("<i", 16) + b"".join(struct.pack("<fi", 0.0, len(p)) + p for p in pieces)


@pytest.mark.slow
def test_bad_input_files_are_named(tiny_run, tmp_path, capsys):
    run = tiny_run[0]
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(DEEP_JSON)  # RecursionError in load_text_file
    code, _, err = call(capsys, "evaluate", "--checkpoint", run, "--data", deep)
    assert code == 2 and "nested too deeply" in err
    shard = tmp_path / "shard.json"
    shard.write_text('[{"story": 1}]')  # AttributeError: 'int' object has no attribute 'strip'
    code, _, err = call(capsys, "prepare", "--out", tmp_path / "out", "data.source=tinystories", f"data.train={shard}")
    assert code == 2 and 'no "story" field of text' in err
    small = tmp_path / "small.bin"  # IndexError in Llama2cTokenizer.encode (byte fallback ids 3..258 missing)
    small.write_bytes(_llama2c_tokenizer([b"<unk>", b"<s>", b"</s>", b"a"]))
    code, _, err = call(capsys, "generate", "--checkpoint", run, "--tokenizer", small, "--prompt", "Once")
    assert code == 2 and "at least 259" in err
    big = tmp_path / "big.bin"  # IndexError in the embedding: ids past the model's vocabulary
    big.write_bytes(
        _llama2c_tokenizer(
            [b"<unk>", b"<s>", b"</s>"]
            + [f"<0x{b:02X}>".encode() for b in range(256)]
            + [f"w{i}".encode() for i in range(300)]
        )
    )
    code, _, err = call(capsys, "generate", "--checkpoint", run, "--tokenizer", big, "--prompt", "Once")
    assert code == 2 and "559 pieces but the model's vocabulary has" in err


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.n_kv_heads=0", "model.n_kv_heads must be >= 1 (got 0)"),  # ZeroDivisionError in ModelConfig.resolved
        ("model.d_attn=-8", "model.d_attn must be >= 1 (got -8)"),  # accepted, then a negative-width model
        ("sample.prompts=" + "[" * 3000, "nested too deeply"),  # RecursionError in config._coerce
    ],
)
@pytest.mark.slow
def test_bad_config_values_are_named(tiny_run, tmp_path, capsys, override, match):
    _, stories = tiny_run
    code, _, err = call(
        capsys,
        "train",
        "--out",
        tmp_path / "out",
        "data.source=tinystories",
        f"data.train={stories}",
        "train.max_steps=1",
        "tokenizer.type=char",
        "model.context_length=16",
        "model.d_model=16",
        "model.n_heads=2",
        override,
    )
    assert code == 2 and match in err, err


@pytest.mark.slow
@pytest.mark.parametrize("knob", ["--temperature=6.675088239973553e-299", "--repetition-penalty=1e-300"])
def test_tiny_temperature_or_penalty_is_refused(tiny_run, capsys, knob):
    """logits / 1e-299 overflow to inf, softmax gives nan: RuntimeError in torch.multinomial."""
    code, _, err = call(capsys, "generate", "--checkpoint", tiny_run[0], "--prompt", "Once", knob)
    flag = knob.split("=")[0]
    assert code == 2 and (flag in err or flag[2:].replace("-", "_") in err), err


def _resume_with(run: Path, root: Path, name: str, payload) -> Path:
    copy = root / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report*"))
    for sub in ("best", "last"):
        path = copy / "checkpoints" / sub / name
        path.write_bytes(payload(path.read_bytes()) if callable(payload) else payload)
    return copy


DAMAGED_RESUME_FILES = [
    ("model.safetensors", b"garbage", "is corrupt or unreadable"),  # SafetensorError in the trainer
    ("training_state.json", b"[]", "not an object"),  # AttributeError in find_resume_checkpoint
    ("training_state.json", b"\xff\xfe", "is corrupt"),  # UnicodeDecodeError
    ("training_state.json", DEEP_JSON, "is corrupt"),  # RecursionError
    ("training_state.json", _json_edit(rng=None), "is corrupt (KeyError: 'rng')"),  # KeyError
    ("checkpoint.json", b"", "checkpoint.json is corrupt"),  # trained on, then failed at the end
    ("config.yaml", b"", "is damaged (no data, tokenizer, model, train section)"),  # every key "differed"
]


@pytest.mark.parametrize(
    "name, payload, match", DAMAGED_RESUME_FILES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(DAMAGED_RESUME_FILES)]
)
@pytest.mark.slow
def test_damaged_resume_file_is_named_and_nothing_is_lost(tiny_run, tmp_path, capsys, name, payload, match):
    copy = _resume_with(tiny_run[0], tmp_path, name, payload)
    before = snapshot(copy / "checkpoints")
    code, _, err = call(capsys, "train", "--resume", copy)
    assert code == 2 and match in err, err
    assert "resuming from" not in err and snapshot(copy / "checkpoints") == before


@pytest.mark.slow
def test_damaged_hf_directory_is_named(hf_dir, tmp_path, capsys):
    copy = tmp_path / "hf"
    shutil.copytree(hf_dir, copy)
    (copy / "model.safetensors").write_bytes(b"")  # SafetensorError from transformers' from_pretrained
    code, _, err = call(capsys, "generate", "--checkpoint", copy, "--prompt", "Once")
    assert code == 2 and "not a loadable Hugging Face gpt2 model" in err, err
