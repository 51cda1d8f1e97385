"""`tinylm serve` under load: concurrent streaming clients, then a burst of malformed requests.

Starts the server on 127.0.0.1 (a free port, ``--threads`` torch threads) with the demo model
(``runs/demo``: run ``make demo`` first, or give ``--checkpoint``), once per ``--modes`` entry and
``--engines`` entry: ``eager`` (``tinylm serve``) and ``compiled`` (``tinylm serve --compile``: the
decoding step under torch.compile, every batch bucket compiled before the server answers; the
start-up time is printed), both by default, eager alone with ``--quick``; ``process`` (the model in
its own engine process, what ``tinylm serve`` does) and ``thread`` (``--engine thread``: a decoding
thread in the server process, sharing its GIL), process by default. ``--rounds N`` starts every
server N times in turn (A B A B ...) and reports the median of its runs beside each run.

For each server, for 1, 4 and 16 concurrent clients (``--clients``) it runs bounded load: each
client sends ``--requests`` streaming completions one after another (a fixed count, and at most
``--seconds`` per level), every request ``--max-tokens`` tokens long unless the model ends it (the
demo model, trained on whole plays, practically never ends within 64 tokens; the tokens counted are
the tokens streamed), sampled at ``--temperature`` with top-k 50 (0: greedy). Reported per level:
requests, errors (must be 0), p50/p95 time to first token, p50 time per token after the first,
aggregate tokens/s over the level's wall time, and its ratios: to one client on the same server
(the reference measured in the same run: how much batching the concurrent requests buys), to the
thread engine at the same number of clients, and to the eager server.

Then, on the first server, a burst of malformed and oversized requests (every kind the API
refuses: bad values, unknown model, empty prompt, beam_width above the vocabulary, invalid JSON,
wrong types, unknown fields, bodies over the limit, chat completions), a few hundred in all, 16 in
flight; every one must get its 4xx answer in OpenAI's error shape, after which ``/health`` must
answer and one normal completion must succeed.

Targets on a 2-core CPU: 16 clients >= 5x the tokens/s of 1 client and 32 clients >= 7x (each
server); the process engine >= 1.5x the thread engine's tokens/s at 16 clients; p95 time to first
token at 4 clients <= 250 ms; 0 errors; healthy after the burst.

    python benchmarks/bench_serve.py [--quick] [--modes eager,compiled] [--engines process,thread]
                                     [--rounds 3] [--clients 1,4,16,32] [--temperature 0]
                                     [--threads 1] [--checkpoint runs/demo] [--json out.json]

``--json PATH`` writes {"rows": [{"mode", "engine", "clients", "runs", "requests", "errors",
"ttft_p50_ms", "ttft_p95_ms", "tokens_per_s", "vs_1_client", "vs_thread", "vs_eager", ...}],
"runs": [every run's row], "burst": {...}, "targets": {...}, "setup": {..., "startup_s"}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "ROMEO:",
    "To be, or not to be",
    "KING HENRY.\nOnce more",
    "First Citizen:\nBefore we proceed",
    "O, what a rogue",
    "Now is the winter",
    "HAMLET:\nWhat a piece of work",
    "JULIET:\nO Romeo",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    checkpoint: str,
    threads: int,
    port: int,
    max_body: int,
    compile: bool = False,
    engine: str = "process",
    extra: list[str] | tuple = (),
) -> subprocess.Popen:
    cmd = (
        [
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
            "--max-body-bytes",
            str(max_body),
            "--engine",
            engine,
        ]
        + (["--compile"] if compile else [])
        + list(extra)
    )
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    wait = 900 if compile else 120  # a cold compile of every batch bucket takes minutes on 2 cores
    return wait_healthy(proc, f"http://127.0.0.1:{port}", wait, "tinylm serve")


def wait_healthy(proc: subprocess.Popen, url: str, wait: float, what: str) -> subprocess.Popen:
    """``proc`` once ``url``/health answers 200; exits naming ``what`` if it dies or takes ``wait`` s."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited: {proc.stdout.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{what} did not become healthy in {wait} s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------- load
async def sse_events(host: str, port: int, path: str, body: dict):
    """POST ``body`` and yield (HTTP status, each server-sent ``data:`` payload as it arrives).

    A minimal HTTP/1.1 client on asyncio streams: on a 2-core machine the load generator shares
    the CPU with the server, and httpx's per-chunk overhead (~0.1 ms) would be a visible share of
    the measurement at 16 streams."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in head.lower()
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                buffer += await reader.readexactly(size + 2)
                buffer = buffer[:-2] if buffer.endswith(b"\r\n") else buffer
            else:
                more = await reader.read(65536)
                if not more:
                    break
                buffer += more
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield status, event.decode()
        if buffer.strip():
            yield status, buffer.decode()
    finally:
        writer.close()


async def one_request(
    url: str, model: str, seed: int, max_tokens: int, temperature: float, extra: dict | None = None
) -> dict:
    """One streaming completion (``extra``: fields another server needs, e.g. llama.cpp's ignore_eos)."""
    body = {
        "model": model,
        "prompt": PROMPTS[seed % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
    }
    if temperature > 0:
        body["top_k"] = 50
    body.update(extra or {})
    host, port = url.removeprefix("http://").split(":")
    t0 = time.perf_counter()
    token_times, done = [], False
    async for status, event in sse_events(host, int(port), "/v1/completions", body):
        if status != 200:
            return {"ok": False, "why": f"HTTP {status}: {event[:200]}"}
        if not event.startswith("data: "):
            continue
        if event == "data: [DONE]":
            done = True
            break
        chunk = json.loads(event[6:])
        if "error" in chunk:
            return {"ok": False, "why": chunk["error"]["message"]}
        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
            token_times.append(time.perf_counter())  # one chunk per token
    if not done or not token_times:
        return {"ok": False, "why": f"stream ended early ({len(token_times)} tokens, [DONE] {done})"}
    per_token = (token_times[-1] - token_times[0]) / max(1, len(token_times) - 1)
    return {"ok": True, "ttft": token_times[0] - t0, "per_token": per_token, "tokens": len(token_times)}


async def level(
    url: str,
    model: str,
    clients: int,
    requests: int,
    max_tokens: int,
    seconds: float,
    temperature: float = 0.8,
    extra: dict | None = None,
) -> dict:
    results: list[dict] = []
    t0 = time.perf_counter()

    async def worker(c: int):
        for k in range(requests):
            if time.perf_counter() - t0 > seconds:
                return
            try:
                results.append(
                    await asyncio.wait_for(one_request(url, model, 1000 * c + k, max_tokens, temperature, extra), 120)
                )
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError) as exc:
                results.append({"ok": False, "why": f"{type(exc).__name__}: {exc}"})

    await asyncio.gather(*(worker(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    errors = [r["why"] for r in results if not r["ok"]]
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "ttft_p50_ms": round(1000 * percentile([r["ttft"] for r in ok], 0.5), 1),
        "ttft_p95_ms": round(1000 * percentile([r["ttft"] for r in ok], 0.95), 1),
        "per_token_p50_ms": round(1000 * percentile([r["per_token"] for r in ok], 0.5), 2),
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "seconds": round(wall, 2),
        "error_examples": errors[:3],
    }


# --------------------------------------------------------------------------------------- burst
def malformed_requests(model: str, vocab: int, max_body: int) -> list[tuple[str, dict | None, bytes | None, int]]:
    """(path, JSON body or None, raw bytes or None, expected status) for every kind of bad request."""
    good = {"model": model, "prompt": "ROMEO:", "max_tokens": 4}
    kinds = [
        ({**good, "temperature": -1}, 400),
        ({**good, "top_p": 0}, 400),
        ({**good, "top_p": 1.5}, 400),
        ({**good, "max_tokens": 0}, 400),
        ({**good, "max_tokens": 10**6}, 400),
        ({**good, "model": "nope"}, 404),
        ({**good, "prompt": ""}, 400),
        ({**good, "prompt": []}, 400),
        ({**good, "beam_width": vocab + 1}, 400),
        ({**good, "n": 0}, 400),
        ({**good, "logprobs": 99}, 400),
        ({**good, "prompt": [vocab + 5]}, 400),
        ({**good, "temperature": "hot"}, 422),
        ({**good, "max_tokens": [1]}, 422),
        ({"model": model}, 422),
        ({**good, "no_such_field": 1}, 400),
        ({**good, "stop": [""]}, 400),
        ({**good, "beam_width": 2, "stream": True}, 400),
    ]
    out = [("/v1/completions", body, None, status) for body, status in kinds]
    out += [
        ("/v1/completions", None, b'{"model": "' + model.encode() + b'", "prompt": ', 400),
        ("/v1/completions", None, b"\xff\xfe not json at all", 400),
        ("/v1/completions", None, b'{"model": "x", "prompt": "' + b"a" * (max_body + 10) + b'"}', 413),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}, None, 404),
        ("/v1/tokenize", {"text": 5}, None, 422),
        ("/v1/detokenize", {"tokens": [-3]}, None, 400),
        ("/v1/score", {"text": ""}, None, 400),
        ("/v1/attention", {"model": "nope", "text": "a"}, None, 404),
    ]
    return out


async def burst(url: str, model: str, vocab: int, max_body: int, total: int) -> dict:
    kinds = malformed_requests(model, vocab, max_body)
    plan = [kinds[i % len(kinds)] for i in range(total)]
    random.Random(0).shuffle(plan)
    unexpected: list[str] = []
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=60) as client:

        async def send(path, body, raw, status):
            async with gate:
                try:
                    if raw is not None:
                        r = await client.post(url + path, content=raw, headers={"content-type": "application/json"})
                    else:
                        r = await client.post(url + path, json=body)
                    shape = set(r.json().get("error", {})) == {"message", "type", "param", "code"}
                    if r.status_code != status or not shape:
                        unexpected.append(f"{path} {str(body or raw)[:60]}: {r.status_code} (wanted {status})")
                except (httpx.HTTPError, ValueError) as exc:
                    unexpected.append(f"{path}: {type(exc).__name__}: {exc}")

        t0 = time.perf_counter()
        await asyncio.gather(*(send(*p) for p in plan))
        seconds = time.perf_counter() - t0
        health = await client.get(url + "/health")
        normal = await client.post(
            url + "/v1/completions",
            json={"model": model, "prompt": "ROMEO:", "max_tokens": 8, "min_tokens": 8, "seed": 1},
        )
    completed = normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 8
    return {
        "requests": total,
        "kinds": len(kinds),
        "unexpected": len(unexpected),
        "examples": unexpected[:5],
        "seconds": round(seconds, 2),
        "healthy_after": health.status_code == 200 and health.json()["status"] == "ok",
        "completion_after": completed,
    }


# ---------------------------------------------------------------------------------------- main
def print_table(rows: list[dict], b: dict, targets: dict) -> None:
    print(
        "\n| mode | engine | clients | runs | requests | errors | TTFT p50 ms | TTFT p95 ms | per-token p50 ms "
        "| tokens/s (median) | tokens/s (each run) | vs 1 client | vs thread engine | vs eager |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        ratios = [f"{r[k]:.2f}x" if r.get(k) is not None else "" for k in ("vs_1_client", "vs_thread", "vs_eager")]
        print(
            f"| {r['mode']} | {r['engine']} | {r['clients']} | {len(r['runs'])} | {r['requests']} | {r['errors']} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | {r['per_token_p50_ms']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {', '.join(f'{t:.0f}' for t in r['runs'])} | " + " | ".join(ratios) + " |"
        )
    if b is not None:
        print(
            f"\nmalformed burst: {b['requests']} requests of {b['kinds']} kinds in {b['seconds']} s, "
            f"{b['unexpected']} unexpected answers; healthy after: {b['healthy_after']}; "
            f"a normal completion after: {b['completion_after']}"
        )
        for e in b["examples"]:
            print("  unexpected:", e)
    print("\ntargets:")
    for name, (ok, detail) in targets.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")


def run_mode(a, mode: str, engine: str, levels: list[int], max_body: int, with_burst: bool):
    """Start the server of ``mode`` on ``engine``, run every load level (and the burst); (rows, burst, start-up s)."""
    port = free_port()
    t0 = time.perf_counter()
    server = start_server(a.checkpoint, a.threads, port, max_body, compile=mode == "compiled", engine=engine)
    startup = time.perf_counter() - t0
    url = f"http://127.0.0.1:{port}"
    rows, b = [], None
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        card = httpx.get(f"{url}/v1/models/{model}").json()["card"]
        vocab = card["config"]["vocab_size"]
        knobs = f"sampling T {a.temperature} top-k 50" if a.temperature > 0 else "greedy"
        print(
            f"{mode}, {engine} engine: tinylm serve on {url} ready in {startup:.1f} s: {model} "
            f"({card['parameters']:,} parameters, vocab {vocab}, context {card['config']['context_length']}), "
            f"{a.threads} torch thread(s); {a.requests} streaming requests per client, {a.max_tokens} tokens each, "
            f"{knobs}"
        )
        asyncio.run(level(url, model, 2, 1, 4, 30))  # warm-up: first-call costs out of the measurements
        for clients in levels:
            measured = asyncio.run(level(url, model, clients, a.requests, a.max_tokens, a.seconds, a.temperature))
            rows.append({"mode": mode, "engine": engine, **measured})
            print(
                f"  {clients:2d} clients: {measured['requests']} requests, {measured['errors']} errors, TTFT p50 "
                f"{measured['ttft_p50_ms']} ms p95 {measured['ttft_p95_ms']} ms, {measured['tokens_per_s']} tok/s",
                flush=True,
            )
            for e in measured["error_examples"]:
                print("     error:", e)
        if with_burst:
            b = asyncio.run(burst(url, model, vocab, max_body, a.burst))
    finally:
        stop_server(server)
    return rows, b, startup


def stop_server(server: subprocess.Popen) -> None:
    """Terminate the server process, killing it when it does not exit within 10 s."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()


def medians(runs: list[dict]) -> list[dict]:
    """One row per (mode, engine, clients): the median of its runs' tokens/s and latencies, every
    run's tokens/s, errors summed; then the ratios to one client, to the thread engine and to eager."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["mode"], r["engine"], r["clients"]), []).append(r)
    rows = []
    for (mode, engine, clients), rs in groups.items():
        row = {"mode": mode, "engine": engine, "clients": clients, "runs": [r["tokens_per_s"] for r in rs]}
        for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "per_token_p50_ms"):
            row[k] = round(statistics.median(r[k] for r in rs), 2)
        row["requests"], row["errors"] = sum(r["requests"] for r in rs), sum(r["errors"] for r in rs)
        row["error_examples"] = [e for r in rs for e in r["error_examples"]][:3]
        rows.append(row)
    by = {(r["mode"], r["engine"], r["clients"]): r for r in rows}
    for r in rows:
        one = by.get((r["mode"], r["engine"], 1))
        r["vs_1_client"] = round(r["tokens_per_s"] / one["tokens_per_s"], 2) if one else None
        thread = by.get((r["mode"], "thread", r["clients"]))
        r["vs_thread"] = (
            round(r["tokens_per_s"] / thread["tokens_per_s"], 2) if thread and r["engine"] != "thread" else None
        )
        eager = by.get(("eager", r["engine"], r["clients"]))
        r["vs_eager"] = round(r["tokens_per_s"] / eager["tokens_per_s"], 2) if eager and r["mode"] != "eager" else None
    return rows


def check_targets(rows: list[dict], b: dict | None) -> dict:
    targets = {"no errors": (all(r["errors"] == 0 for r in rows), f"{sum(r['errors'] for r in rows)} errors")}
    if b is not None:
        targets["healthy after the malformed burst"] = (
            b["healthy_after"] and b["completion_after"] and not b["unexpected"],
            f"{b['unexpected']} unexpected answers",
        )
    for r in rows:
        name = f"{r['mode']}, {r['engine']} engine"
        if r["clients"] in CLIENT_TARGETS and r["vs_1_client"] is not None:
            want = CLIENT_TARGETS[r["clients"]]
            targets[f"{name}: {r['clients']} clients >= {want}x the tokens/s of 1"] = (
                r["vs_1_client"] >= want,
                f"{r['vs_1_client']:.2f}x",
            )
        if r["clients"] == 4:
            targets[f"{name}: p95 TTFT at 4 clients <= 250 ms"] = (r["ttft_p95_ms"] <= 250, f"{r['ttft_p95_ms']} ms")
        if r["clients"] == 16 and r["vs_thread"] is not None:
            targets[f"{name}: >= 1.5x the thread engine's tokens/s at 16 clients"] = (
                r["vs_thread"] >= 1.5,
                f"{r['vs_thread']:.2f}x",
            )
    return targets


CLIENT_TARGETS = {16: 5, 32: 7}  # clients -> the multiple of one client's tokens/s they should get


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs" / "demo"))
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument(
        "--modes", help="servers to measure, comma-separated: eager, compiled (default: both; --quick: eager)"
    )
    p.add_argument(
        "--engines",
        default="process",
        help="where the model runs, comma-separated: process (tinylm serve's engine process), thread (--engine "
        "thread: a decoding thread in the server process)",
    )
    p.add_argument("--rounds", type=int, default=1, help="alternating runs of every server (medians reported)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy; above: sampling with top-k 50")
    p.add_argument("--clients", default="1,4,16", help="concurrency levels, comma-separated")
    p.add_argument("--requests", type=int, default=6, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=90, help="time bound of each level")
    p.add_argument("--burst", type=int, default=300, help="malformed requests in the burst (0: none)")
    p.add_argument(
        "--quick", action="store_true", help="eager only, 2 requests per client, 24 tokens, 100 malformed (< 60 s)"
    )
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.max_tokens, a.seconds, a.burst = 2, 24, 15, 100
    modes = (a.modes or ("eager" if a.quick else "eager,compiled")).split(",")
    if set(modes) - {"eager", "compiled"} or not modes:
        p.error(f"--modes {a.modes}: choose from eager, compiled")
    engines = a.engines.split(",")
    if set(engines) - {"process", "thread"} or not engines:
        p.error(f"--engines {a.engines}: choose from process, thread")
    if not Path(a.checkpoint).exists():
        print(f"{a.checkpoint} not found: run `make demo` first (it writes runs/demo) or give --checkpoint")
        return 2
    levels = [int(x) for x in a.clients.split(",")]
    max_body = 100_000
    t_start = time.perf_counter()
    runs, b, startup = [], None, {}
    for k in range(a.rounds):  # every server once per round, in turn: slow drifts of the machine hit each alike
        for mode in modes:
            for engine in engines:
                first = k == 0 and mode == modes[0] and engine == engines[0]
                mode_rows, mode_burst, seconds = run_mode(a, mode, engine, levels, max_body, first and a.burst > 0)
                runs += [{**r, "round": k} for r in mode_rows]
                startup.setdefault(f"{mode}, {engine}", []).append(round(seconds, 1))
                b = b or mode_burst
    rows = medians(runs)
    targets = check_targets(rows, b)
    print_table(rows, b, targets)
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    if a.json:
        setup = {
            "checkpoint": str(a.checkpoint),
            "threads": a.threads,
            "requests_per_client": a.requests,
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "rounds": a.rounds,
            "cpu_count": os.cpu_count(),
            "modes": modes,
            "engines": engines,
            "startup_s": startup,
        }
        report = {"rows": rows, "runs": runs, "burst": b, "setup": setup}
        report["targets"] = {k: {"ok": ok, "value": v} for k, (ok, v) in targets.items()}
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0 if all(ok for ok, _ in targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
