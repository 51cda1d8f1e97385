"""lm-evaluation-harness against `tinylm serve`: a story-cloze task and bits per byte of stories.

    python benchmarks/bench_lm_eval.py --checkpoint CKPT [--data valid.txt] [--max-docs N] [--work DIR]
                                       [--threads T] [--num-concurrent 8] [--engine thread] [--json PATH]

Builds two local lm-eval tasks from a TinyStories-format file (or .jsonl) in ``--work`` (a
temporary directory, removed afterwards, unless given; the stories are written nowhere else):

- ``story_cloze`` (multiple choice): each story of at least three sentences; the context is the
  story up to its last sentence, the choices are that sentence and the last sentences of three
  other stories (drawn with ``--seed``), in a random order. Reported: ``acc`` (the choice of the
  highest log probability) and ``acc_norm`` (per character, which does not favour short endings).
- ``stories_bpb`` (rolling log-likelihood): the stories as documents; bits per byte.

Then runs, printing each command: ``tinylm export-tokenizer --hf`` (the tokenizer the harness
counts tokens with), ``tinylm serve``, the harness's stock ``local-completions`` model
(``lm_eval``, with ``max_length`` = the model's context + 1 so that a request fills the context),
``tinylm evaluate --json`` on the same stories, and tinylm's own scoring of the cloze choices
(``continuation_logprob``: the same token ids as the harness, the model called directly). The
table: accuracies both ways, bits per byte both ways, wall times, the CPU, and the harness's
requests/s: the sequences it scored (cloze choices and rolling windows) over the time spent in its
requesting function (``TIMED_HARNESS``), which leaves out its start-up and its writing of results.

Where the two bits per byte differ: the harness scores a story longer than its window as
disjoint windows (the first tokens of a later window see little context), `tinylm evaluate` with
overlapping strided windows (every token sees at least half a context); a story that fits one
window gets the same number from both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_serve import free_port  # noqa: E402

from tinylm.data.corpora import load_text_file  # noqa: E402
from tinylm.interop.loading import load_any_checkpoint  # noqa: E402

SENTENCE_END = re.compile(r'(?<=[.!?])\s+|(?<=[.!?]["\'])\s+')
CHOICES = 4
CLOZE_YAML = """task: story_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""
BPB_YAML = """task: stories_bpb
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity
  - metric: word_perplexity
"""


# ------------------------------------------------------------------------------------ the tasks
def cloze_rows(stories: list[str], seed: int) -> list[dict]:
    """One multiple-choice row per story of at least three sentences (see the module notes)."""
    split = []
    for story in stories:
        parts = SENTENCE_END.split(story.strip())
        if len(parts) >= 3:
            ending = parts[-1]
            split.append((story.strip()[: len(story.strip()) - len(ending)].rstrip(), ending))
    rng = random.Random(seed)
    rows = []
    for i, (context, ending) in enumerate(split):
        others = rng.sample([k for k in range(len(split)) if k != i and split[k][1] != ending], CHOICES - 1)
        label = rng.randrange(CHOICES)
        choices = [split[k][1] for k in others]
        choices.insert(label, ending)
        rows.append({"context": context, "choices": choices, "label": label})
    return rows


def write_tasks(stories: list[str], work: Path, seed: int) -> list[dict]:
    """story_cloze and stories_bpb (YAML + JSONL) in ``work/tasks``; returns the cloze rows."""
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    rows = cloze_rows(stories, seed)
    for name, items, yaml in (
        ("story_cloze", rows, CLOZE_YAML),
        ("stories_bpb", [{"text": s} for s in stories], BPB_YAML),
    ):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items), encoding="utf-8")
        (tasks / f"{name}.yaml").write_text(yaml.format(data=json.dumps(str(data))), encoding="utf-8")
    return rows


# --------------------------------------------------------------------------- tinylm's own scoring
@torch.no_grad()
def continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) as a causal language model scores a choice, and as the
    harness asks for it: the ids of context + continuation (no start token), the continuation's
    ids those after the context's, the last ``context_length`` ids kept."""
    context_ids = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    kept = whole[-model.config.context_length :]
    first = len(context_ids) - (len(whole) - len(kept))  # the continuation's first position in kept
    logp = torch.log_softmax(model(torch.tensor([kept]))[0][0].float(), dim=-1)
    return sum(float(logp[t - 1, kept[t]]) for t in range(max(first, 1), len(kept)))


def tinylm_accuracy(model, tokenizer, rows: list[dict]) -> dict:
    hits, hits_norm = 0, 0
    for row in rows:
        scores = [continuation_logprob(model, tokenizer, row["context"], " " + c) for c in row["choices"]]
        per_char = [s / len(c) for s, c in zip(scores, row["choices"])]  # the harness divides by the choice's length
        hits += scores.index(max(scores)) == row["label"]
        hits_norm += per_char.index(max(per_char)) == row["label"]
    return {"acc": hits / len(rows), "acc_norm": hits_norm / len(rows)}


# ------------------------------------------------------------------------------------- commands
def shown(cmd: list[str]) -> str:
    words = ["tinylm" if w == "tinylm.cli" else w for w in cmd]
    if words[1:3] == ["-c", TIMED_HARNESS]:  # shown as the command it times
        words = ["lm_eval"] + words[4:]
    if words[:2] == [sys.executable, "-m"]:
        words = words[2:]
    return shlex.join(words)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", shown(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {done.stderr[-3000:]}")
    return done


def serve(checkpoint: str, threads: int, port: int, engine: str = "process") -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "tinylm.cli",
        "serve",
        "--checkpoint",
        checkpoint,
        "--threads",
        str(threads),
        "--port",
        str(port),
        "--max-choices",
        "16",
    ] + (["--engine", engine] if engine != "process" else [])
    print("$", shown(cmd), "&", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tinylm serve exited with {proc.returncode}")
        try:
            models = httpx.get(url + "/v1/models", timeout=1).json()["data"]
            return proc, models[0]["id"]
        except (httpx.HTTPError, KeyError, ValueError):
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("tinylm serve did not answer in 120 s")


# The harness's CLI with its request phase timed: every scored sequence (a cloze choice, a window of
# a rolling document) goes through ``TemplateAPI._loglikelihood_tokens``, which sends the HTTP
# requests and parses their answers; the time inside it is the harness's requesting time, without
# its start-up (imports, building the tasks, tokenising) or its writing of results.
TIMED_HARNESS = """
import json, sys, time
from lm_eval.__main__ import cli_evaluate
from lm_eval.models.api_models import TemplateAPI

stats = {"requests": 0, "seconds": 0.0}
scored = TemplateAPI._loglikelihood_tokens

def timed(self, requests, **kwargs):
    t0 = time.perf_counter()
    try:
        return scored(self, requests, **kwargs)
    finally:
        stats["seconds"] += time.perf_counter() - t0
        stats["requests"] += len(requests)

TemplateAPI._loglikelihood_tokens = timed
out = sys.argv.pop(1)
try:
    cli_evaluate()
finally:
    open(out, "w").write(json.dumps(stats))
"""


def harness(
    work: Path, name: str, port: int, tokenizer_dir: Path, max_length: int, batch: int, concurrent: int = 1
) -> tuple[dict, float, dict]:
    args = (
        f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={tokenizer_dir},"
        f"tokenizer_backend=huggingface,max_length={max_length},num_concurrent={concurrent}"
    )
    timing = work / "requests.json"
    cmd = [
        sys.executable,
        "-c",
        TIMED_HARNESS,
        str(timing),
        "--model",
        "local-completions",
        "--model_args",
        args,
        "--tasks",
        "story_cloze,stories_bpb",
        "--include_path",
        str(work / "tasks"),
        "--batch_size",
        str(batch),
        "--output_path",
        str(work / "lm_eval"),
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(work / "datasets-cache"),
    }
    t0 = time.perf_counter()
    run(cmd, env=env)
    seconds = time.perf_counter() - t0
    results = json.loads(next((work / "lm_eval").rglob("results_*.json")).read_text())["results"]
    return results, seconds, json.loads(timing.read_text())


# ----------------------------------------------------------------------------------------- main
def measure(args, work: Path) -> dict:
    stories = [s for s in load_text_file(args.data) if s.strip()][: args.max_docs]
    rows = write_tasks(stories, work, args.seed)
    print(f"{len(stories)} stories, {len(rows)} cloze questions in {work / 'tasks'}", flush=True)
    model, tokenizer, _ = load_any_checkpoint(args.checkpoint)
    tok_dir = work / "hf-tokenizer"
    run(
        [
            sys.executable,
            "-m",
            "tinylm.cli",
            "export-tokenizer",
            "--checkpoint",
            args.checkpoint,
            "--out",
            str(tok_dir),
            "--hf",
        ],
        cwd=REPO,
    )
    port = free_port()
    proc, name = serve(args.checkpoint, args.threads, port, args.engine)
    try:
        results, harness_s, requesting = harness(
            work, name, port, tok_dir, model.config.context_length + 1, args.batch_size, args.num_concurrent
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    t0 = time.perf_counter()
    evaluated = json.loads(
        run(
            [
                sys.executable,
                "-m",
                "tinylm.cli",
                "evaluate",
                "--checkpoint",
                args.checkpoint,
                "--data",
                str(work / "tasks" / "stories_bpb.jsonl"),
                "--json",
            ],
            cwd=REPO,
        ).stdout
    )
    evaluate_s = time.perf_counter() - t0
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ours = tinylm_accuracy(model.eval(), tokenizer, rows)
    import cpuinfo

    return {
        "checkpoint": args.checkpoint,
        "model": name,
        "stories": len(stories),
        "questions": len(rows),
        "harness": {
            "acc": results["story_cloze"]["acc,none"],
            "acc_norm": results["story_cloze"]["acc_norm,none"],
            "bpb": results["stories_bpb"]["bits_per_byte,none"],
            "seconds": round(harness_s, 1),
            "requests": requesting["requests"],
            "requesting_seconds": round(requesting["seconds"], 2),
            "requests_per_s": round(requesting["requests"] / requesting["seconds"], 1),
        },
        "tinylm": {
            **ours,
            "bpb": evaluated["bpb"],
            "evaluate_seconds": round(evaluate_s, 1),
            "scoring_seconds": round(time.perf_counter() - t0, 1),
        },
        "cpu": cpuinfo.get_cpu_info().get("brand_raw"),
        "threads": args.threads,
        "engine": args.engine,
        "num_concurrent": args.num_concurrent,
    }


def table(r: dict) -> str:
    h, t = r["harness"], r["tinylm"]
    gap = (h["bpb"] - t["bpb"]) / t["bpb"] * 100
    return "\n".join(
        [
            f"{r['model']}: {r['questions']} story-cloze questions, {r['stories']} stories; {r['cpu']}, "
            f"{r['threads']} torch thread(s)",
            "| | lm-evaluation-harness (local-completions) | tinylm |",
            "|---|---|---|",
            f"| story cloze acc | {h['acc']:.4f} | {t['acc']:.4f} |",
            f"| story cloze acc_norm | {h['acc_norm']:.4f} | {t['acc_norm']:.4f} |",
            f"| bits per byte | {h['bpb']:.4f} | {t['bpb']:.4f} (`tinylm evaluate`; harness {gap:+.2f}%) |",
            f"| wall time | {h['seconds']:.0f} s (both tasks) | {t['evaluate_seconds']:.0f} s evaluate, "
            f"{t['scoring_seconds']:.0f} s cloze |",
            f"| requests | {h['requests']} scored sequences in {h['requesting_seconds']:.2f} s: "
            f"{h['requests_per_s']:.1f} requests/s | |",
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="any checkpoint tinylm serve takes")
    p.add_argument(
        "--data",
        default=str(REPO.parent / "shared" / "data" / "tinystories" / "valid.txt"),
        help="TinyStories-format text or .jsonl (default: ../shared/data/tinystories/valid.txt)",
    )
    p.add_argument("--max-docs", type=int, default=None, help="the first N stories only")
    p.add_argument("--seed", type=int, default=0, help="draws the wrong endings and their order")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server and of tinylm's scoring")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per request from the harness")
    p.add_argument("--num-concurrent", type=int, default=1, help="the harness's requests in flight at once")
    p.add_argument("--engine", default="process", choices=("process", "thread"), help="tinylm serve --engine")
    p.add_argument("--work", default=None, help="keep the tasks, tokenizer and harness output here")
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tinylm-lm-eval-"))
    try:
        r = measure(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(table(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
