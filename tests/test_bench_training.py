"""The training benchmark runs (--quick, one round, a subset of rows) and writes its JSON table."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_training_quick_writes_the_table(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_training.py"), "--quick", "--rounds", "1", "--corpus",
           "shakespeare", "--rows", "hf_gpt2,plain,accum_2,checkpointing", "--json", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = re.search(r"vocab (\d+); micro-batch (\d+) x (\d+) tokens, (\d+) micro-batches per row", proc.stdout)
    V, B, T, M = map(int, sizes.groups())
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["hf_gpt2", "plain", "accum_2", "checkpointing"]
    for r in rows.values():
        # the rate is the row's M x B x T tokens over its median seconds (rounded to 1 ms, the rate to 0.1)
        assert 5e-4 < r["seconds"] < wall
        assert M * B * T / (r["seconds"] + 5e-4) - 0.05 <= r["tokens_per_s"] <= M * B * T / (r["seconds"] - 5e-4) + 0.05
        assert r["peak_activation_bytes"] >= B * T * V * 4  # cross-entropy alone keeps a float32 log-softmax
        assert 0 < r["final_loss"] < 10
    # same weights, same micro-batches: checkpointing changes memory, not the result
    assert rows["checkpointing"]["final_loss"] == pytest.approx(rows["plain"]["final_loss"], abs=1e-3)
    assert rows["checkpointing"]["peak_activation_bytes"] < 0.4 * rows["plain"]["peak_activation_bytes"]
    assert rows["accum_2"]["optimizer_steps"] * 2 == rows["plain"]["optimizer_steps"]
    assert rows["plain"]["tokens_per_s_vs_hf_gpt2"] == pytest.approx(
        rows["plain"]["tokens_per_s"] / rows["hf_gpt2"]["tokens_per_s"], abs=1e-3)
    assert "Shakespeare" in proc.stdout
