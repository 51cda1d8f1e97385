"""The fairness and memory benchmarks of `tinylm serve` run (--quick, on a small checkpoint the test
writes) and write their reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving_util import make_run

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a server, two conditions of 3 s (~20 s)
def test_bench_serve_fair_quick_writes_both_conditions(tmp_path):
    run = make_run(tmp_path, context_length=64)
    out = tmp_path / "fair.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_serve_fair.py"), "--quick", "--checkpoint", str(run)]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    # exit code 1 is a missed fairness target, which a tiny model on a busy machine may miss
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    alone, scoring = report["runs"]["alone"][0], report["runs"]["scoring"][0]
    assert alone["errors"] == scoring["errors"] == 0 and alone["requests"] >= 4 and scoring["requests"] >= 4
    assert scoring["other_requests"] >= 1 and scoring["other_s_p50"] > 0
    assert report["ratios"]["gap_p95_ms"] == pytest.approx(scoring["gap_p95_ms"] / alone["gap_p95_ms"], abs=0.01)
    assert "| scoring |" in proc.stdout and "scoring / alone: TTFT p95" in proc.stdout


@pytest.mark.slow  # a server and 400 mixed requests (~20 s)
def test_bench_serve_memory_quick_draws_the_curve(tmp_path):
    run = make_run(tmp_path, context_length=64)
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_serve_memory.py"), "--quick", "--checkpoint", str(run)]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [q["requests"] for q in report["curve"]] == [0, 100, 200, 300, 400]
    assert all(q["server_mb"] > 50 and q["engine_mb"] > 50 for q in report["curve"])
    assert report["failures"] == 0 and report["healthy"]
