"""The serving benchmark runs (--quick, on a small checkpoint the test writes) and writes its table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving_util import make_run

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # starts a server on each engine, runs two load levels on each and a malformed burst (~30 s)
def test_bench_serve_quick_writes_the_table(tmp_path):
    run = make_run(tmp_path, context_length=64)
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/bench_serve.py"),
        "--quick",
        "--checkpoint",
        str(run),
        "--clients",
        "1,4",
        "--engines",
        "process,thread",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    # exit code 1 is a missed speed target, which a small random model on a busy machine may miss
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["engine"], r["clients"]) for r in rows] == [("process", 1), ("process", 4), ("thread", 1), ("thread", 4)]
    for r in rows:
        assert {"clients", "requests", "errors", "ttft_p50_ms", "ttft_p95_ms", "tokens_per_s"} <= set(r)
        assert r["requests"] == 2 * r["clients"] and r["errors"] == 0, r
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"] and r["tokens_per_s"] > 0
        assert r["runs"] == [r["tokens_per_s"]]  # one round: the median is the run
    assert rows[1]["vs_1_client"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], abs=0.01)
    assert rows[1]["vs_thread"] == pytest.approx(rows[1]["tokens_per_s"] / rows[3]["tokens_per_s"], abs=0.01)
    assert rows[3]["vs_thread"] is None
    burst = report["burst"]
    assert burst["requests"] == 100 and burst["unexpected"] == 0, burst["examples"]
    assert burst["healthy_after"] and burst["completion_after"]
    assert report["targets"]["no errors"]["ok"] and report["targets"]["healthy after the malformed burst"]["ok"]
    assert "| mode | engine | clients | runs | requests | errors |" in proc.stdout
