"""The asking-ahead benchmark runs (--quick, a model of the demo's shape when there is no
checkpoint) and its rows add up."""

import shutil

import pytest
from test_bench_cpu_attention import quick_rows


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_bench_attention_asks_quick_writes_consistent_rows(tmp_path):
    for r in quick_rows("bench_attention_asks.py", tmp_path):
        for name in ("step", "attention"):
            assert min(r[f"{name}_asking_us"], r[f"{name}_not_asking_us"]) > 0
            assert r[f"{name}_speedup"] == pytest.approx(r[f"{name}_not_asking_us"] / r[f"{name}_asking_us"], rel=1e-2)
