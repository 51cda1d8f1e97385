"""The server's and the engine's memory over many requests: does it settle, or grow without bound?

Starts `tinylm serve` (the demo model, ``runs/demo``, or ``--checkpoint``; one torch thread) and
sends ``--requests`` requests (10,000) from ``--clients`` concurrent clients (16), a mix of what a
class sends: short and long completions, streamed or not, greedy and sampled, with log
probabilities, echoed and scored prompts, several choices, clients that leave mid-stream, and
malformed bodies. Every ``--every`` requests (500) it reads the resident memory (VmRSS) of the
server process and of its engine process from /proc.

Reported: the curve (requests, server MB, engine MB), the growth after warm-up (from the first
point at or past ``--every`` x 2 requests to the last) in MB and in MB per 1,000 requests.

    python benchmarks/bench_serve_memory.py [--quick] [--requests 10000] [--clients 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import PROMPTS, free_port, sse_events, start_server, stop_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = [""]  # the served model's name, read from /v1/models at the start


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def engine_pid(server_pid: int) -> int:
    """The engine: the server's child started by multiprocessing's spawn (the other is its resource tracker)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text():
                return int(child)
    raise SystemExit("no engine process found under the server")


def request(k: int) -> tuple[str, dict, bool]:
    """The k-th request of the mix: (path, body, stream and leave early)."""
    rng = random.Random(k)
    prompt = PROMPTS[k % len(PROMPTS)]
    kind = k % 8
    body = {
        "model": MODEL[0],
        "prompt": prompt,
        "max_tokens": rng.choice([4, 16, 48]),
        "seed": k,
        "temperature": rng.choice([0, 0.8]),
    }
    if kind == 1:
        body.update(stream=True)
    elif kind == 2:
        body.update(logprobs=3)
    elif kind == 3:
        body.update(echo=True, logprobs=2, max_tokens=0, prompt=prompt * rng.randint(1, 20))
    elif kind == 4:
        body.update(n=3)
    elif kind == 5:
        return "/v1/completions", {**body, "stream": True, "max_tokens": 200, "min_tokens": 200}, True
    elif kind == 6:
        return "/v1/score", {"text": prompt * rng.randint(1, 10)}, False
    elif kind == 7:
        body.update(temperature=-1)  # refused: 400
    return "/v1/completions", body, False


async def send(url: str, k: int) -> bool:
    path, body, leave = request(k)
    host, port = url.removeprefix("http://").split(":")
    if body.get("stream"):
        events = 0
        async for status, _ in sse_events(host, int(port), path, body):
            events += 1
            if leave and events >= 3:  # the client goes away mid-stream
                break
        return events > 0
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(url + path, json=body)
        return r.status_code in (200, 400)


async def load(url: str, pids: tuple[int, int], a) -> tuple[list[dict], int]:
    curve, failures, next_k = [], 0, 0
    lock = asyncio.Lock()

    async def client() -> None:
        nonlocal next_k, failures
        while True:
            async with lock:
                k, next_k = next_k, next_k + 1
            if k >= a.requests:
                return
            failures += not await send(url, k)
            if (k + 1) % a.every == 0:
                curve.append(
                    {"requests": k + 1, "server_mb": round(rss_mb(pids[0]), 1), "engine_mb": round(rss_mb(pids[1]), 1)}
                )
                print(curve[-1], flush=True)

    await asyncio.gather(*(client() for _ in range(a.clients)))
    return sorted(curve, key=lambda p: p["requests"]), failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs" / "demo"))
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--quick", action="store_true", help="400 requests, a point every 100")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.every = 400, 100
    if not Path(a.checkpoint).exists():
        print(f"{a.checkpoint} not found: run `make demo` first (it writes runs/demo) or give --checkpoint")
        return 2
    port = free_port()
    server = start_server(a.checkpoint, 1, port, 1_000_000)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        pids = (server.pid, engine_pid(server.pid))
        MODEL[0] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        start = {"requests": 0, "server_mb": round(rss_mb(pids[0]), 1), "engine_mb": round(rss_mb(pids[1]), 1)}
        curve, failures = asyncio.run(load(url, pids, a))
        healthy = httpx.get(url + "/health").status_code == 200
    finally:
        stop_server(server)
    curve = [start, *curve]
    warm = next((q for q in curve if q["requests"] >= 2 * a.every), curve[0])
    last = curve[-1]
    span = max(1, last["requests"] - warm["requests"])
    growth = {
        who: {
            "mb": round(last[f"{who}_mb"] - warm[f"{who}_mb"], 1),
            "mb_per_1000": round(1000 * (last[f"{who}_mb"] - warm[f"{who}_mb"]) / span, 2),
        }
        for who in ("server", "engine")
    }
    print("\n| requests | server MB | engine MB |\n|---:|---:|---:|")
    for q in curve:
        print(f"| {q['requests']} | {q['server_mb']} | {q['engine_mb']} |")
    print(
        f"\nafter {warm['requests']} requests: server {growth['server']['mb']:+} MB "
        f"({growth['server']['mb_per_1000']:+} MB per 1,000), engine {growth['engine']['mb']:+} MB "
        f"({growth['engine']['mb_per_1000']:+} MB per 1,000); {failures} failed requests; healthy {healthy}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    if a.json:
        report = {"curve": curve, "growth": growth, "failures": failures, "healthy": healthy}
        report["setup"] = {
            "checkpoint": str(a.checkpoint).removeprefix(f"{REPO}/"),  # no machine path in a result
            "requests": a.requests,
            "clients": a.clients,
            "cpu_count": os.cpu_count(),
        }
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0 if failures == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
