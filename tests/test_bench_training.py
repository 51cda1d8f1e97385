"""The training benchmark runs (--quick, one round, a subset of rows) and writes its JSON table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_training_quick_writes_the_table(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "benchmarks/bench_training.py"), "--quick", "--rounds", "1", "--corpus",
           "shakespeare", "--rows", "hf_gpt2,plain,accum_2,checkpointing", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["hf_gpt2", "plain", "accum_2", "checkpointing"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["peak_activation_bytes"] > 0
        assert 0 < r["final_loss"] < 10
    # same weights, same micro-batches: checkpointing changes memory, not the result
    assert rows["checkpointing"]["final_loss"] == pytest.approx(rows["plain"]["final_loss"], abs=1e-3)
    assert rows["checkpointing"]["peak_activation_bytes"] < 0.4 * rows["plain"]["peak_activation_bytes"]
    assert rows["accum_2"]["optimizer_steps"] * 2 == rows["plain"]["optimizer_steps"]
    assert "tokens_per_s_vs_hf_gpt2" in rows["plain"] and "Shakespeare" in proc.stdout
