"""The side-by-side benchmark of `tinylm serve` and llama.cpp's server runs (--quick) on a small
Qwen3-shaped run the test trains; with llama.cpp's server where $TINYLM_LLAMA_SERVER names one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from export_util import train_llama_run

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a tiny training, an export and one or two servers (~40 s)
def test_bench_serve_llamacpp_quick_writes_its_table(tmp_path):
    run = train_llama_run(tmp_path, steps=20, qk_norm=True, qk_norm_weight=True)
    out = tmp_path / "side.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_serve_llamacpp.py"), "--quick", "--checkpoint", str(run)]
    server = os.environ.get("TINYLM_LLAMA_SERVER")
    cmd += ["--llama-server", server] if server else []
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["system"] for r in rows} == {"tinylm"} | ({"llama.cpp"} if server else set())
    assert [r["clients"] for r in rows if r["system"] == "tinylm"] == [1, 4]
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 for r in rows)
    if server:
        assert all("vs_llama_cpp" in r for r in rows if r["system"] == "tinylm")
    else:
        assert "llama.cpp's rows are not measured" in proc.stdout
