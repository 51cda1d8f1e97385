"""`tinylm check --class`, `--init` and `tinylm evaluate --adapter`: a class's adapters in one table,
the kit for students, and a student's whole model scored on tinylm's protocol.

The class is tests/fixtures_check/class/: each student's adapter.py runs the shared answer
(tests/fixtures_check/student_adapter.py, torch primitives, copied beside it) and overrides a few definitions: one
is right everywhere, the others hold usual mistakes, a part that hangs, one that raises and one
that allocates without bound.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import make_stories

from tinylm.cli import main
from tinylm.config import ModelConfig
from tinylm.courses import adapter_template, reference_adapter, sandbox
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.tokenizers.bpe import BPETokenizer

FIXTURES = Path(__file__).parent / "fixtures_check"


def test_init_writes_the_template_and_a_readme_and_never_overwrites(tmp_path, capsys):
    kit = tmp_path / "kit"
    assert main(["check", "--init", str(kit)]) == 0
    assert (kit / "adapter.py").read_text() == Path(adapter_template.__file__).read_text()
    readme = (kit / "README.md").read_text()
    assert "tinylm check adapter.py" in readme and "tinylm evaluate --adapter adapter.py" in readme
    capsys.readouterr()
    assert main(["check", "--init", str(kit)]) == 2
    assert "already exist" in capsys.readouterr().err


def test_check_takes_one_of_an_adapter_a_class_or_init(tmp_path, capsys):
    assert main(["check"]) == 2
    assert "give one of ADAPTER, --class DIR or --init DIR" in capsys.readouterr().err
    assert main(["check", "--class", str(tmp_path), "--init", str(tmp_path)]) == 2
    assert main(["check", "--class", str(tmp_path)]) == 2
    assert "no student in" in capsys.readouterr().err


def class_copy(tmp_path: Path, fixture: str = "class") -> Path:
    """A fixture class where its report may be written, the shared answer copied into each
    student's folder (the sandbox shows a student its own folder only)."""
    shutil.copytree(FIXTURES / fixture, tmp_path / fixture)
    for folder in (tmp_path / fixture).iterdir():
        shutil.copy(FIXTURES / "student_adapter.py", folder / "student_adapter.py")
    return tmp_path / fixture


PARTS = [
    "embedding",
    "scaled_dot_product_attention",
    "cross_entropy",
    "gradient_accumulation",
    "gradient_checkpointing",
    "kv_cache",
    "top_k_filter",
    "beam_search",
    "bpe_train",
    "ngram_kneser_ney",
]
EXPECTED = {  # student -> part -> (status, mistake); every other cell is ok
    "bob": {  # one mistake in attention: the parts built on it differ because of it (one red cell)
        "scaled_dot_product_attention": ("differs", "no_scale"),
        "gradient_checkpointing": ("differs", "no_scale"),  # its blocks hold the same attention
        "kv_cache": ("differs", None),  # ... and so does its cached step, where no mistake is named
        "gradient_accumulation": ("differs", "not_divided_by_k"),
        "ngram_kneser_ney": ("differs", "no_discount"),
        "beam_search": ("not implemented", None),
    },
    "carol": {"top_k_filter": ("timed out", None), "kv_cache": ("differs", "position_off_by_one")},
    "dave": {"cross_entropy": ("error", None), "bpe_train": ("differs", "ties_greatest_bytes")},
    "erin": {"embedding": ("error", None), "gradient_checkpointing": ("differs", "not_checkpointed")},
}


@pytest.mark.slow
def test_class_writes_one_table_with_each_students_mistakes_named(tmp_path, capsys, monkeypatch):
    directory = class_copy(tmp_path)
    monkeypatch.chdir(tmp_path)  # the class given as a relative path, as a teacher types it
    argv = ["check", "--class", "class", "--parts", ",".join(PARTS), "--timeout", "3", "--memory-gb", "0.5"]
    assert main([*argv, "--seed", "0", "--jobs", "2"]) == 1
    data = json.loads((directory / "check.json").read_text())
    assert data["parts"] == PARTS
    students = {s["name"]: s for s in data["students"]}
    assert list(students) == ["alice", "bob", "carol", "dave", "erin"]
    for name, student in students.items():
        got = {p["part"]: (p["status"], p["mistake"]) for p in student["parts"]}
        assert got == {part: EXPECTED.get(name, {}).get(part, ("ok", None)) for part in PARTS}, name
    erin = {p["part"]: p for p in students["erin"]["parts"]}
    assert "allocate" in erin["embedding"]["detail"].lower() or "memory" in erin["embedding"]["detail"].lower()
    dave = {p["part"]: p for p in students["dave"]["parts"]}
    assert dave["cross_entropy"]["detail"].startswith("ValueError: targets and logits disagree (adapter.py line ")
    table = (directory / "check.md").read_text()
    assert (
        "| bob | 4/10 | ok | x no_scale | ok | x not_divided_by_k | -> scaled_dot_product_attention "
        "| -> scaled_dot_product_attention | ok | - | ok | x no_discount |" in table
    )
    assert "| carol | 8/10 |" in table and "timeout" in table
    # per part, the students passing it (alice passes all); per mistake, the students making it
    assert "| students passing | 1/5 pass all | 4/5 | 4/5 | 4/5 | 4/5 | 3/5 | 3/5 | 4/5 | 4/5 | 4/5 | 4/5 |" in table
    assert "| no_scale | scaled_dot_product_attention, gradient_checkpointing | 1 |" in table
    bob = {p["part"]: p for p in students["bob"]["parts"]}
    assert bob["kv_cache"]["because"] == bob["gradient_checkpointing"]["because"] == "scaled_dot_product_attention"
    assert bob["kv_cache"]["detail"].startswith("because `scaled_dot_product_attention` differs: fix that first (")
    assert table in capsys.readouterr().out
    page = (directory / "check.html").read_text()
    assert page.count("<tr>") == 7 and "x not_checkpointed" in page
    rows = (directory / "check.csv").read_text().splitlines()
    assert rows[0] == "student,parts ok," + ",".join(PARTS) and rows[2].startswith("bob,4/10,ok,x no_scale,ok,")
    graded = json.loads((directory / "check-results" / "gradescope" / "bob" / "results.json").read_text())
    assert (graded["score"], graded["max_score"]) == (4.0, 10.0)
    assert [t["score"] for t in graded["tests"]] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert graded["tests"][1]["output"].startswith("scaled_dot_product_attention   differs: yours equals")


def sandbox_litter() -> set[Path]:
    """The sandboxes' folders in the temp folder and their cgroups (empty once their processes end)."""
    parents = [Path(tempfile.gettempdir()), *sandbox.cgroup_parents("pids"), *sandbox.cgroup_parents("memory")]
    return {p for parent in parents for p in parent.glob("tinylm-check-*")}


def run_in_a_process(argv: list[str]) -> subprocess.Popen:
    code = "import sys\nfrom tinylm.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_a_class_run_killed_half_way_keeps_its_verdicts_and_resume_finishes_it(tmp_path):
    """A folder of files this time (DIR/NAME.py): one file per student, the shared answer beside."""
    directory = tmp_path / "files"
    directory.mkdir()
    shared = (FIXTURES / "student_adapter.py").read_text(encoding="utf-8")
    for name in ("ann", "ben", "cat", "dan"):
        (directory / f"{name}.py").write_text(shared, encoding="utf-8")
    argv = ["check", "--class", str(directory), "--parts", "linear,softmax", "--jobs", "1", "--seed", "3"]
    scratch = sandbox_litter()
    first = run_in_a_process(argv)
    done = directory / "check-results"
    deadline = time.monotonic() + 120
    while len(list(done.glob("*.json"))) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()
    first.communicate()
    for path in sandbox_litter() - scratch:  # what a run killed outright cannot remove (its processes died with it)
        shutil.rmtree(path) if path.parent == Path(tempfile.gettempdir()) else sandbox.remove_cgroup(path)
    kept = {p.name: p.stat().st_mtime_ns for p in done.glob("*.json")}
    assert 1 <= len(kept) < 4 and not (directory / "check.md").exists()
    second = run_in_a_process([*argv[:-2], "--resume"])  # the stopped run's seed, from its verdicts
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err.decode()
    assert f"resume: {len(kept)} student(s) already checked, {4 - len(kept)} to go" in err.decode()
    assert "seed 3 (--seed 3 repeats these inputs)" in err.decode()
    assert {p.name: p.stat().st_mtime_ns for p in done.glob("*.json") if p.name in kept} == kept  # not checked again
    assert "| students passing | 4/4 pass all | 4/4 | 4/4 |" in (directory / "check.md").read_text()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random GPT with a BPE tokenizer, saved as tinylm saves a run's checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    stories = make_stories(40)
    tokenizer = BPETokenizer().train(stories, 300)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=300, context_length=32, d_model=32, n_layers=2, n_heads=4))
    save_checkpoint(root / "model", model, tokenizer)
    data = root / "valid.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories[:12]), encoding="utf-8")
    return root / "model", data


@pytest.mark.slow
def test_evaluate_adapter_on_a_wrapped_checkpoint_gives_that_checkpoints_numbers(checkpoint, monkeypatch, capsys):
    model, data = checkpoint
    assert main(["evaluate", "--checkpoint", str(model), "--data", str(data), "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("TINYLM_CHECKPOINT", str(model))  # the reference adapter's whole model
    argv = ["evaluate", "--adapter", reference_adapter.__file__, "--data", str(data), "--json"]
    assert main(argv) == 0
    wrapped = json.loads(capsys.readouterr().out)
    assert wrapped["tokens"] == direct["tokens"] and wrapped["bytes"] == direct["bytes"]
    assert wrapped["words"] == direct["words"]
    for key in ("bpb", "token_ppl", "word_ppl"):
        assert wrapped[key] == pytest.approx(direct[key], rel=1e-6), key
    assert wrapped["kv_speedup"] > 0 and wrapped["same_tokens"] is True
    assert main(["evaluate", "--adapter", reference_adapter.__file__, "--data", str(data)]) == 0
    report = capsys.readouterr().out
    assert "bits per byte    " in report and "how each number is defined:" in report and "kv_speedup:" in report


@pytest.mark.slow
def test_evaluate_adapter_bleu_equals_the_checkpoints(checkpoint, tmp_path, monkeypatch, capsys):
    model, data = checkpoint
    bleu = ["--bleu", "--samples", "4", "--prompt-tokens", "3", "--max-continuation", "12", "--temperature", "0"]
    bleu += ["--temperature", "1.0", "--top-k", "20", "--csv-dir", str(tmp_path), "--json"]
    assert main(["evaluate", "--checkpoint", str(model), "--data", str(data), *bleu]) == 0
    direct = json.loads(capsys.readouterr().out)["bleu"]
    monkeypatch.setenv("TINYLM_CHECKPOINT", str(model))
    assert main(["evaluate", "--adapter", reference_adapter.__file__, "--data", str(data), *bleu]) == 0
    wrapped = json.loads(capsys.readouterr().out)["bleu"]
    assert wrapped["samples"] == direct["samples"] == 4
    assert wrapped["reference_ppl"] == pytest.approx(direct["reference_ppl"], rel=1e-5)
    for ours, theirs in zip(wrapped["settings"], direct["settings"]):  # the same tokens: the same BLEU
        assert ours["name"] == theirs["name"] and ours["new_tokens"] == theirs["new_tokens"]
        for key in ("bleu1", "bleu2", "bleu3", "bleu4"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-12), (ours["name"], key)
    beam = ["evaluate", "--adapter", reference_adapter.__file__, "--data", str(data), "--bleu", "--beam-width", "3"]
    assert main(beam) == 2
    assert "beam search" in capsys.readouterr().err


def test_evaluate_takes_a_checkpoint_or_an_adapter(tmp_path, capsys):
    data = tmp_path / "valid.txt"
    data.write_text("one story\n", encoding="utf-8")
    assert main(["evaluate", "--data", str(data)]) == 2
    assert "give one of --checkpoint or --adapter" in capsys.readouterr().err
    assert main(["evaluate", "--adapter", str(tmp_path / "missing.py"), "--data", str(data)]) == 2
    assert "does not exist" in capsys.readouterr().err


UNIFORM = """
import torch


def model_info():
    return {"context_length": 32, "bos_id": 256}


def model_encode(text):
    return list(text.encode("utf-8"))


def model_logits(tokens):
    return torch.zeros(*tokens.shape, 257)  # every byte and the start id equally likely
"""


@pytest.mark.slow
def test_class_with_data_adds_each_students_protocol_numbers_from_the_sandbox(checkpoint, tmp_path, monkeypatch):
    """A model of uniform logits over 257 ids scores log2(257) bits per byte; alice's model wraps a
    tinylm checkpoint (the reference adapter): it cannot import tinylm in the sandbox, and says so."""
    model, data = checkpoint
    monkeypatch.setenv("TINYLM_CHECKPOINT", str(model))
    directory = class_copy(tmp_path)
    shutil.copy(reference_adapter.__file__, directory / "alice" / "adapter.py")
    for name in ("carol", "dave", "erin"):
        shutil.rmtree(directory / name)
    uniform = (FIXTURES / "student_adapter.py").read_text(encoding="utf-8") + UNIFORM
    (directory / "uniform.py").write_text(uniform, encoding="utf-8")  # a student handed in as one file
    assert main(["check", "--class", str(directory), "--parts", "linear", "--data", str(data), "--seed", "0"]) == 1
    students = {s["name"]: s for s in json.loads((directory / "check.json").read_text())["students"]}
    assert students["uniform"]["protocol"]["bpb"] == pytest.approx(math.log2(257), rel=1e-6)
    assert "No module named 'tinylm'" in students["alice"]["protocol_error"]
    assert "No module named 'tinylm'" in students["alice"]["parts"][0]["detail"]
    assert "model_info not implemented" in students["bob"]["protocol_error"]
    table = (directory / "check.md").read_text()
    assert "| student | parts ok | linear | bits/byte | token ppl | word ppl | KV speed-up |" in table
    assert f"| uniform | 1/1 | ok | {math.log2(257):.4f} |" in table
