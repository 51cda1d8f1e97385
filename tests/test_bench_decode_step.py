"""The decoding-step benchmark runs (--quick, on a small checkpoint the test writes) and its rows add up."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving_util import make_run

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # compiles the step for two batch sizes (~15 s on 2 cores)
def test_bench_decode_step_quick_writes_consistent_rows(tmp_path):
    run = make_run(tmp_path, context_length=64)
    out = tmp_path / "step.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/bench_decode_step.py"),
        "--quick",
        "--checkpoint",
        str(run),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["slots"]) for r in rows] == [(1, 64), (16, 64)]
    for r in rows:
        assert min(r["eager_us"], r["compiled_us"], r["products_us"], r["attention_us"]) > 0
        assert r["compiled_vs_eager"] == pytest.approx(r["eager_us"] / r["compiled_us"], rel=1e-2)
        floor = r["products_us"] + r["attention_us"]
        assert r["bound"] == pytest.approx(r["eager_us"] / floor, rel=1e-2)
        assert r["floor_share"] == pytest.approx(floor / r["eager_us"], rel=1e-2)
    # 16 rows multiply at least about as long as one: at --quick's sizes the two are within timing
    # noise of each other (a fresh-clone CI measured 74.7 against 76.6 us), so no strict order
    assert rows[1]["products_us"] > 0.5 * rows[0]["products_us"]
    assert "| batch | slots | eager us |" in proc.stdout


def test_missing_checkpoint_is_named(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_decode_step.py"), "--checkpoint", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "no checkpoint at" in proc.stderr and "nope" in proc.stderr
