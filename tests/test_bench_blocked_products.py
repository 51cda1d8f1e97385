"""The blocked products benchmark runs (--quick, a model of the demo's shape when there is no
checkpoint) and its rows add up."""

import pytest
import torch
from test_bench_cpu_attention import quick_rows


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with oneDNN")
def test_bench_blocked_products_quick_writes_consistent_rows(tmp_path):
    for r in quick_rows("bench_blocked_products.py", tmp_path):
        for way in ("warm", "cold"):
            assert min(r[f"{way}_blocked_us"], r[f"{way}_mkl_us"]) > 0
            assert r[f"{way}_speedup"] == pytest.approx(r[f"{way}_mkl_us"] / r[f"{way}_blocked_us"], rel=1e-2)
