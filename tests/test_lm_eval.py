"""EleutherAI's lm-evaluation-harness, its stock `local-completions` model, against `tinylm serve`:
the three kinds of request it makes (loglikelihood, loglikelihood_rolling, generate_until) on the
small local tasks of tests/lm_eval_tasks, each compared with tinylm's own numbers for the same
model and text.

Where the two protocols meet: the harness counts tokens with the tokenizer `tinylm export-tokenizer
--hf` wrote (the same ids as tinylm's), scores a document as rolling windows that start with the
tokenizer's bos token (<sos>, from which `tinylm evaluate` scores every document too), and a choice
as log p(" " + choice | context) with no start token before the context. Every document here fits
one window (the harness's max_length is the model's context + 1), so the harness and `tinylm
evaluate` score the same tokens with the same model: they agree to float32 rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_stories, tiny_run_config
from serving_util import live_server

from tinylm.cli import main
from tinylm.config import GenerationConfig
from tinylm.data.corpora import load_text_file
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.generation.generate import generate_many
from tinylm.models.checkpoint import load_checkpoint
from tinylm.pipeline import run_pipeline

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "lm_eval_tasks"
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lm_eval.py"
CONTEXT = 64
# float32 log probabilities summed over a few hundred tokens, in windows batched differently by the
# server and by `tinylm evaluate`: a relative 1e-5 is a hundred times the rounding seen (6e-8)
BPB_RTOL = 1e-5
LOGPROB_ATOL = 1e-4  # one choice or document: tens of tokens, each within ~1e-6 nats


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A BPE GPT of context 64 trained for 300 steps on the test stories (about 15 s), with its
    tokenizer written as Hugging Face files."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lm_eval")
    data = root / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories(200)), encoding="utf-8")
    cfg = tiny_run_config(root / "tinyrun", data, max_steps=300, eval_interval=300, eval_batches=1)
    cfg.model.context_length = CONTEXT
    cfg.sample.max_new_tokens = 4
    run_pipeline(cfg, cfg.out_dir)
    assert main(["export-tokenizer", "--checkpoint", cfg.out_dir, "--out", str(root / "hf-tokenizer"), "--hf"]) == 0
    yield Path(cfg.out_dir), root / "hf-tokenizer"
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def harness(trained, tmp_path_factory):
    """lm_eval's command line (with the benchmark's timing of its requests) on the three local tasks
    against `tinylm serve`: (results, samples by task, the requests timed)."""
    run, tokenizer = trained
    out = tmp_path_factory.mktemp("lm_eval_out")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    with live_server("--checkpoint", str(run / "checkpoints" / "best"), "--threads", "1") as url:
        args = (
            f"model=tinyrun,base_url={url}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface,"
            f"max_length={CONTEXT + 1}"
        )
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                load_bench().TIMED_HARNESS,
                str(out / "requests.json"),
                "--model",
                "local-completions",
                "--model_args",
                args,
                "--tasks",
                "tinylm_cloze,tinylm_rolling,tinylm_continue",
                "--include_path",
                ".",
                "--batch_size",
                "8",
                "--output_path",
                str(out),
                "--log_samples",
            ],
            cwd=TASKS,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    folder = out / "tinyrun"
    results = json.loads(next(folder.glob("results_*.json")).read_text())["results"]
    samples = {
        task: [json.loads(line) for line in next(folder.glob(f"samples_{task}_*.jsonl")).open()]
        for task in ("tinylm_cloze", "tinylm_rolling", "tinylm_continue")
    }
    return results, samples, json.loads((out / "requests.json").read_text())


@pytest.fixture(scope="module")
def model(trained):
    model, tokenizer, _ = load_checkpoint(trained[0] / "checkpoints" / "best")
    return model.eval(), tokenizer


def docs_of(task: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{task}.jsonl").open(encoding="utf-8")]


def load_bench():
    """benchmarks/bench_lm_eval.py, whose continuation_logprob is tinylm's scoring of a choice."""
    spec = importlib.util.spec_from_file_location("bench_lm_eval", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rolling_bits_per_byte_is_tinylm_evaluate(harness, model):
    results, samples, _ = harness
    texts = load_text_file(TASKS / "tinylm_rolling.jsonl")  # `tinylm evaluate --data` reads the same file
    assert [s["doc"]["text"] for s in samples["tinylm_rolling"]] == texts
    assert all(len(model[1].encode(t)) < CONTEXT for t in texts)  # one window each
    ours = evaluate_texts(*model, texts)
    theirs = results["tinylm_rolling"]["bits_per_byte,none"]
    assert theirs == pytest.approx(ours["bpb"], rel=BPB_RTOL)
    assert ours["bpb"] < 4.0  # trained: well below the 8 bits of a byte-uniform guess
    for sample, text in zip(samples["tinylm_rolling"], texts):  # and document by document
        assert float(sample["resps"][0][0]) == pytest.approx(-evaluate_texts(*model, [text])["nll"], abs=LOGPROB_ATOL)


def test_multiple_choice_accuracy_is_tinylm_scoring(harness, model):
    results, samples, _ = harness
    bench = load_bench()
    docs = docs_of("tinylm_cloze")
    for doc, sample in zip(docs, samples["tinylm_cloze"]):  # choice by choice
        ours = [bench.continuation_logprob(*model, doc["context"], " " + c) for c in doc["choices"]]
        assert [float(r[0][0]) for r in sample["resps"]] == pytest.approx(ours, abs=LOGPROB_ATOL)
    ours = bench.tinylm_accuracy(*model, docs)
    assert results["tinylm_cloze"]["acc,none"] == pytest.approx(ours["acc"])
    assert results["tinylm_cloze"]["acc_norm,none"] == pytest.approx(ours["acc_norm"])


def test_the_benchmark_times_every_scored_sequence(harness):
    """bench_lm_eval's requests/s counts each cloze choice and each rolling window once."""
    _, samples, requesting = harness
    windows = len(docs_of("tinylm_rolling"))  # each document fits one window
    choices = sum(len(d["choices"]) for d in docs_of("tinylm_cloze"))
    assert len(samples["tinylm_cloze"]) == len(docs_of("tinylm_cloze"))
    assert requesting["requests"] == choices + windows and requesting["seconds"] > 0


def test_the_story_cloze_builder(tmp_path):
    stories = make_stories(12, seed=3)
    rows = load_bench().write_tasks(stories, tmp_path, seed=0)
    assert len(rows) == 12 and {r["label"] for r in rows} <= {0, 1, 2, 3}
    for story, row in zip(stories, rows):
        right = row["choices"][row["label"]]
        assert right == "Story number " + story.rsplit("Story number ", 1)[1] and story.startswith(row["context"])
        assert len(set(row["choices"])) == 4
    assert load_text_file(tmp_path / "tasks" / "stories_bpb.jsonl") == stories
    yaml = (tmp_path / "tasks" / "story_cloze.yaml").read_text()
    assert f'test: "{tmp_path / "tasks" / "story_cloze.jsonl"}"' in yaml  # an absolute path: runs from anywhere


def test_generate_until_is_tinylm_greedy_decoding(harness, model):
    _, samples, _ = harness
    net, tokenizer = model
    cfg = GenerationConfig(max_new_tokens=16, temperature=0, stop_strings=(".",), stop_ids=tokenizer.stop_ids)
    for doc, sample in zip(docs_of("tinylm_continue"), samples["tinylm_continue"]):
        ids = tokenizer.encode(doc["context"])  # the harness sends the context's ids, no start token
        tokens = generate_many(net, [ids], cfg, tokenizer.decode)[0].tokens
        text = tokenizer.decode_continuation(ids, tokens)
        expected = text[: text.index(".")] if "." in text else text  # the server's text ends before the stop
        assert sample["resps"][0][0] == expected
        assert expected.strip()
