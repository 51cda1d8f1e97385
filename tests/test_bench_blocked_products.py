"""The blocked products benchmark runs (--quick, a model of the demo's shape when there is no
checkpoint) and its rows add up."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN")
def test_bench_blocked_products_quick_writes_consistent_rows(tmp_path):
    out = tmp_path / "blocked.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/bench_blocked_products.py"),
        "--quick",
        "--checkpoint",
        str(tmp_path / "none"),
    ]
    proc = subprocess.run(cmd + ["--filled", "40", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "random weights, the demo's shape" in proc.stdout and "| batch | filled slots |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["filled"]) for r in rows] == [(1, 40), (16, 40)]
    for r in rows:
        for way in ("warm", "cold"):
            assert min(r[f"{way}_blocked_us"], r[f"{way}_mkl_us"]) > 0
            assert r[f"{way}_speedup"] == pytest.approx(r[f"{way}_mkl_us"] / r[f"{way}_blocked_us"], rel=1e-2)
    bad = subprocess.run(cmd + ["--filled", "500"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--filled 500" in bad.stderr
