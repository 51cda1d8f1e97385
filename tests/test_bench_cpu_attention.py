"""The C attention benchmark runs (--quick, a model of the demo's shape when there is no checkpoint)
and its rows add up."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def quick_rows(script: str, tmp_path: Path) -> list[dict]:
    """Run a step benchmark of this kind (``bench_cpu_attention.step_arguments``) with --quick on a
    model of the demo's shape, check what it prints and that a bad --filled is refused; its rows."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--checkpoint", str(tmp_path / "none")]
    proc = subprocess.run(cmd + ["--filled", "40", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "random weights, the demo's shape" in proc.stdout and "| batch | filled slots |" in proc.stdout
    bad = subprocess.run(cmd + ["--filled", "500"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--filled 500" in bad.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["filled"]) for r in rows] == [(1, 40), (16, 40)]
    return rows


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_bench_cpu_attention_quick_writes_consistent_rows(tmp_path):
    for r in quick_rows("bench_cpu_attention.py", tmp_path):
        assert min(r["step_loops_us"], r["step_products_us"], r["attention_loops_us"], r["attention_products_us"]) > 0
        assert r["step_speedup"] == pytest.approx(r["step_products_us"] / r["step_loops_us"], rel=1e-2)
        assert r["attention_speedup"] == pytest.approx(r["attention_products_us"] / r["attention_loops_us"], rel=1e-2)
