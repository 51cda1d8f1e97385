"""`tinylm serve` beside llama.cpp's own server, on the same model and the same machine.

The model is a tinylm checkpoint of Llama or Qwen3 shape (``--checkpoint``); it is written with
`tinylm export-gguf` (f32) for llama.cpp unless ``--gguf`` gives the file. ``--llama-server`` is
llama.cpp's ``llama-server`` binary (built from the llama.cpp that llama-cpp-python vendors:
docs/serving.md says how); without one only tinylm's rows are measured, and the output says so.

Both servers get the same streaming clients as ``bench_serve.py`` (its client, its prompts): for
1, 4, 16 and 32 concurrent clients (``--clients``) each client sends ``--requests`` completions one
after another, every one ``--max-tokens`` tokens long (tinylm: ``min_tokens``; llama.cpp:
``ignore_eos``, so neither ends early), greedy unless ``--temperature``. llama-server runs with
continuous batching and ``--parallel`` slots (16), each slot the model's context. The servers
alternate, ``--rounds`` times (A B A B ...); the table gives each one's median over the rounds
beside every round's value, and the ratio tinylm / llama.cpp of tokens/s.

    python benchmarks/bench_serve_llamacpp.py --checkpoint RUN/checkpoints/ema \\
        --llama-server PATH/llama-server [--rounds 3] [--clients 1,4,16,32] [--tinylm-threads 1] \\
        [--llama-threads 2] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, level, start_server, stop_server, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def export_gguf(checkpoint: str, out: Path) -> Path:
    cmd = [sys.executable, "-m", "tinylm.cli", "export-gguf", "--checkpoint", checkpoint, "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return out


def start_llama_server(binary: str, gguf: Path, port: int, threads: int, parallel: int, context: int):
    """llama-server with ``parallel`` slots of ``context`` tokens each (continuous batching is its default)."""
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    cmd += ["-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * context), "-ngl", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return wait_healthy(proc, f"http://127.0.0.1:{port}", 120, "llama-server")


def model_context(checkpoint: str) -> tuple[str, int]:
    """(the served model's name, its context length), from tinylm's own loader."""
    from tinylm.interop.loading import load_any_checkpoint
    from tinylm.serving.models import model_name

    model, _, _ = load_any_checkpoint(checkpoint)
    return model_name(checkpoint, set()), model.config.context_length


def run_server(system: str, a, gguf: Path, name: str, context: int) -> list[dict]:
    port = free_port()
    if system == "tinylm":
        proc = start_server(a.checkpoint, a.tinylm_threads, port, 1_000_000)
        extra = {"min_tokens": a.max_tokens}
    else:
        proc = start_llama_server(a.llama_server, gguf, port, a.llama_threads, a.parallel, context)
        extra = {"ignore_eos": True}
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(level(url, name, 2, 1, 4, 30, a.temperature, extra))  # warm-up
        rows = []
        for clients in [int(c) for c in a.clients.split(",")]:
            r = asyncio.run(level(url, name, clients, a.requests, a.max_tokens, a.seconds, a.temperature, extra))
            rows.append({"system": system, **r})
            print(
                f"  {system:8s} {clients:3d} clients: {r['tokens_per_s']:8.1f} tok/s, TTFT p50 "
                f"{r['ttft_p50_ms']} ms p95 {r['ttft_p95_ms']} ms, errors {r['errors']}",
                flush=True,
            )
        return rows
    finally:
        stop_server(proc)


def table(runs: list[dict]) -> list[dict]:
    """Per (system, clients): medians over the rounds, each round's tokens/s, and tinylm / llama.cpp."""
    out = []
    for system in dict.fromkeys(r["system"] for r in runs):
        for clients in dict.fromkeys(r["clients"] for r in runs):
            mine = [r for r in runs if r["system"] == system and r["clients"] == clients]
            row = {"system": system, "clients": clients, "rounds": len(mine)}
            row["errors"] = sum(r["errors"] for r in mine)
            for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms"):
                row[key] = round(statistics.median(r[key] for r in mine), 1)
            row["tokens_per_s_each"] = [r["tokens_per_s"] for r in mine]
            out.append(row)
    for row in out:
        other = [r for r in out if r["system"] == "llama.cpp" and r["clients"] == row["clients"]]
        if row["system"] == "tinylm" and other:
            row["vs_llama_cpp"] = round(row["tokens_per_s"] / other[0]["tokens_per_s"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(REPO / "runs" / "demo"), help="a Llama- or Qwen3-shaped tinylm model")
    p.add_argument("--gguf", help="the model as GGUF (default: written by tinylm export-gguf)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (none: tinylm alone)")
    p.add_argument("--clients", default="1,4,16,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=6, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=90, help="time bound of each level")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--tinylm-threads", type=int, default=1, help="tinylm serve --threads")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument("--parallel", type=int, default=16, help="llama-server --parallel (slots)")
    p.add_argument("--quick", action="store_true", help="one round, 1 and 4 clients, 2 requests of 16 tokens")
    p.add_argument("--json", help="write the table and every run here")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.clients, a.requests, a.max_tokens, a.seconds = 1, "1,4", 2, 16, 30
    name, context = model_context(a.checkpoint)
    systems = ["tinylm"] + (["llama.cpp"] if a.llama_server else [])
    if not a.llama_server:
        print("no --llama-server given: llama.cpp's rows are not measured")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(a.gguf) if a.gguf else export_gguf(a.checkpoint, Path(tmp) / "model.gguf")
        runs = []
        for k in range(a.rounds):
            for system in systems if k % 2 == 0 else systems[::-1]:
                print(f"round {k + 1}: {system}", flush=True)
                runs += [{**r, "round": k + 1} for r in run_server(system, a, gguf, name, context)]
    rows = table(runs)
    print(
        "\n| system | clients | rounds | errors | tokens/s (median) | each round | TTFT p50 ms | TTFT p95 ms "
        "| tinylm / llama.cpp |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        each = ", ".join(f"{x:.0f}" for x in r["tokens_per_s_each"])
        print(
            f"| {r['system']} | {r['clients']} | {r['rounds']} | {r['errors']} | {r['tokens_per_s']:.0f} | {each} "
            f"| {r['ttft_p50_ms']} | {r['ttft_p95_ms']} | {r.get('vs_llama_cpp', '')} |"
        )
    if a.json:
        setup = {k: v for k, v in vars(a).items() if k != "json"}
        setup["llama_server"] = a.llama_server and Path(a.llama_server).name  # no machine path in a result
        setup["cpu"] = platform.processor() or platform.machine()
        Path(a.json).write_text(json.dumps({"rows": rows, "runs": runs, "setup": setup}, indent=1) + "\n")
    if any(r["errors"] for r in rows):
        raise SystemExit("some requests failed")


if __name__ == "__main__":
    main()
