"""Exact resume: a run killed with SIGKILL and resumed logs the same losses, bit for bit, as an
uninterrupted run; resumed configs are checked key by key."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_stories

from tinylm.cli import main
from tinylm.training.resume import find_resume_checkpoint, load_resume_state

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 80
pytestmark = pytest.mark.slow  # every test shares one SIGKILLed-and-resumed pair of 80-step runs


def _config(root: Path) -> Path:
    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories(80)), encoding="utf-8")
    cfg = {
        "data": {"source": "tinystories", "train": str(data), "valid_fraction": 0.2, "test_fraction": 0.1},
        "tokenizer": {"type": "bpe", "vocab_size": 300},
        "model": {"context_length": 32, "d_model": 32, "n_layers": 2, "n_heads": 4, "dropout": 0.1},
        "train": {
            "batch_size": 4,
            "max_steps": MAX_STEPS,
            "warmup_steps": 5,
            "eval_interval": 20,
            "eval_batches": 2,
            "log_interval": 1,
            "save_interval": 5,
            "keep_last": 2,
            "threads": 1,
            "progress": False,
        },
        "sample": {"prompts": ["Once"], "max_new_tokens": 3},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return [sys.executable, "-m", "tinylm.cli", *map(str, args)], env


def _losses(run: Path) -> list[tuple[str, str, str]]:
    rows = (run / "metrics.csv").read_text().strip().splitlines()
    head = rows[0].split(",")
    i, j, k = head.index("step"), head.index("train_loss"), head.index("val_loss")
    return [(r.split(",")[i], r.split(",")[j], r.split(",")[k]) for r in rows[1:]]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    cfg = _config(root)
    cmd, env = _cli("train", "--config", cfg, "--out", root / "full")
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)

    cmd, env = _cli("train", "--config", cfg, "--out", root / "killed")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = root / "killed/checkpoints/step-0000005"
    deadline = time.time() + 240
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_state = sorted(p.name for p in (root / "killed/checkpoints").iterdir())
    killed_rows = len(_losses(root / "killed"))

    cmd, env = _cli("train", "--resume", root / "killed")
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return root, proc.returncode, killed_state, killed_rows, resumed


def test_sigkill_then_resume_reproduces_the_loss_curve_bit_for_bit(killed_and_resumed):
    root, code, killed_state, killed_rows, resumed = killed_and_resumed
    assert code == -signal.SIGKILL
    assert "last" not in killed_state, "the run finished before it was killed; nothing was tested"
    assert killed_rows < MAX_STEPS
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr
    full, again = _losses(root / "full"), _losses(root / "killed")
    assert len(full) == MAX_STEPS
    assert again == full  # the loss strings are repr() of the floats: bit for bit


def test_resumed_run_keeps_last_k_plus_best(killed_and_resumed):
    root = killed_and_resumed[0]
    names = sorted(p.name for p in (root / "killed/checkpoints").iterdir())
    assert names == ["best", "last", "step-0000070", "step-0000075"]


def test_checkpoint_holds_the_whole_training_state_without_pickle(killed_and_resumed):
    root = killed_and_resumed[0]
    ckpt = root / "killed/checkpoints/step-0000075"
    assert sorted(p.suffix for p in ckpt.iterdir()) == [
        ".json",
        ".json",
        ".json",
        ".safetensors",
        ".safetensors",
        ".safetensors",
        ".yaml",
    ]
    state = load_resume_state(ckpt)
    assert state.step == 75 and state.counters["data_position"] == 75
    assert state.counters["tokens_seen"] == 75 * 4 * 32
    assert state.rng_per_rank[0]["torch_cpu"].dtype.itemsize == 1  # uint8 bytes
    assert len(state.optimizer_state["state"]) == len(state.optimizer_state["param_groups"][0]["params"]) + len(
        state.optimizer_state["param_groups"][1]["params"]
    )
    assert find_resume_checkpoint(root / "killed") == root / "killed/checkpoints/last"


def _bad(capsys, *argv, match):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def test_resume_config_checks(killed_and_resumed, capsys):
    run = killed_and_resumed[0] / "killed"
    err = _bad(capsys, "train", "--resume", run, "train.lr=0.5", "model.d_model=64", match="cannot be overridden")
    assert "model.d_model" in err and "train.lr" in err
    _bad(capsys, "train", "--resume", run, "train.max_steps=90", match="train.max_steps; pass --force")
    _bad(capsys, "train", "--resume", run, "train.lr=0.5", "--force", match="train.lr")
    _bad(capsys, "train", "--resume", run / "nope", match="does not exist")
    _bad(capsys, "train", "--force", "train.max_steps=3", match="--force only applies together with --resume")


def test_force_extends_a_finished_run(killed_and_resumed, capsys):
    run = killed_and_resumed[0] / "killed"
    assert main(["train", "--resume", str(run), "--force", "train.max_steps=84", "sample.max_new_tokens=2"]) == 0
    rows = _losses(run)
    assert [int(r[0]) for r in rows][-5:] == [80, 81, 82, 83, 84]
    assert json.loads((run / "checkpoints/last/training_state.json").read_text())["step"] == 84
