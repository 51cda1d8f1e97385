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
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/bench_training.py"),
        "--quick",
        "--rounds",
        "1",
        "--corpus",
        "shakespeare",
        "--rows",
        "hf_gpt2,plain,accum_2,checkpointing",
        "--json",
        str(out),
    ]
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
        rows["plain"]["tokens_per_s"] / rows["hf_gpt2"]["tokens_per_s"], abs=1e-3
    )
    assert "Shakespeare" in proc.stdout


@pytest.mark.slow  # about 35 s: bf16 is emulated on a CPU without bf16 matrix units
def test_bench_training_roofline_quick_writes_peaks_and_rows(tmp_path):
    out = tmp_path / "roof.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/bench_training.py"),
        "--table",
        "roofline",
        "--quick",
        "--rounds",
        "1",
        "--device",
        "cpu",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert list(rows) == [
        "matmul_peak_fp32",
        "matmul_peak_bf16",
        "tinylm_d128_fp32",
        "hf_gpt2_d128_fp32",
        "tinylm_d128_bf16",
        "hf_gpt2_d128_bf16",
    ]  # --quick on CPU: no compiled rows
    peaks = {p: rows[f"matmul_peak_{p}"]["flop_s"] for p in ("fp32", "bf16")}
    assert all(v > 1e8 for v in peaks.values())
    for p in ("fp32", "bf16"):
        assert rows[f"matmul_peak_{p}"]["flop_s"] == max(rows[f"matmul_peak_{p}"]["per_shape"].values())
    L, T, V, d = 6, 256, 2048, 128
    for name, r in list(rows.items())[2:]:
        assert r["flops_per_token"] == 6 * (12 * L * d * d + V * d) + 12 * L * T * d
        tokens = r["steps"] * r["tokens_per_step"]
        assert tokens / (r["seconds"] + 5e-5) - 0.05 <= r["tokens_per_s"] <= tokens / (r["seconds"] - 5e-5) + 0.05
        assert r["model_flop_s"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"], rel=1e-3)
        assert r["mfu_bf16"] == pytest.approx(r["model_flop_s"] / peaks["bf16"], rel=1e-3, abs=1e-4)
        assert r["of_fp32_peak"] == pytest.approx(r["model_flop_s"] / peaks["fp32"], rel=1e-3, abs=1e-4)
        hf = rows[name.replace("tinylm", "hf_gpt2")]
        assert r["vs_hf"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"], abs=2e-3)
        assert 0 < r["final_loss"] < 10
        assert abs(r["loss_vs_fp32"]) < 0.01  # bf16 within 1% of fp32 after the same steps
    # the reference starts from tinylm's weights (to_hf_gpt2) and sees the same batches: the same model
    assert rows["hf_gpt2_d128_fp32"]["final_loss"] == pytest.approx(rows["tinylm_d128_fp32"]["final_loss"], abs=1e-3)
    assert rows["tinylm_d128_fp32"]["speedup_vs_fp32"] == 1.0
    assert "speed-up vs fp32 eager, tinylm d128: bf16" in proc.stdout


@pytest.mark.slow
def test_bench_training_profile_lists_the_top_ops_of_one_step_of_each_system(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/bench_training.py"),
        "--profile",
        "--sizes",
        "128",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--corpus",
        "shakespeare",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["profile_tinylm_d128_fp32", "profile_hf_gpt2_d128_fp32"]
    for name, r in rows.items():
        ops = r["top_ops"]
        assert len(ops) == 10 and r["step_wall_s"] > 0
        times = [op["self_cpu_ms"] for op in ops]
        assert times == sorted(times, reverse=True) and times[0] <= r["self_cpu_ms_total"]
        assert sum(op["self_cpu_share"] for op in ops) <= 1.0 + 1e-3
        for op in ops:
            assert op["self_cpu_share"] == pytest.approx(op["self_cpu_ms"] / r["self_cpu_ms_total"], abs=2e-3)
        # a training step of a transformer: matrix products forward and backward are among the top ops
        assert {"aten::mm", "aten::addmm"} & {op["op"] for op in ops}, name
        assert f"{name.removeprefix('profile_')}: step" in proc.stdout
