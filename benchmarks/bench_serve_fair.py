"""Fair to everyone: streaming clients while one client scores the largest prompt the server allows.

Starts `tinylm serve` (the demo model, ``runs/demo``, or ``--checkpoint``; ``--threads`` torch
threads) and runs two conditions in turn, ``--rounds`` times (A B A B ...; the order swapped every
other round):

- ``alone``: ``--streams`` clients (15) each stream completions of ``--max-tokens`` tokens one after
  another for ``--seconds``;
- ``scoring``: the same, while one more client sends, one after another, the largest scoring
  request the server accepts: ``echo`` with ``logprobs`` 5 and ``max_tokens`` 0 over a prompt of
  ``--max-score-tokens`` token ids (what `tinylm serve --max-score-tokens` allows; the server is
  started with it); with ``--beside beam``, the other client asks beam search instead (width
  ``--beam-width``, ``--max-tokens`` tokens), and the condition is named ``beam``.

Reported per condition (medians over rounds, each round's value beside): the streams' p95 time to
first token, their p95 gap between two tokens (every gap of every request), tokens/s, errors; for
the other client its requests and seconds per request. The ratios scoring / alone are the
measure of fairness: the target is at most 2x for both p95s.

    python benchmarks/bench_serve_fair.py [--quick] [--rounds 3] [--streams 15] [--seconds 20]
                                          [--max-score-tokens 16384] [--beside scoring|beam] [--beam-width 10]
                                          [--checkpoint runs/demo] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import PROMPTS, free_port, percentile, sse_events, start_server, stop_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = 2.0  # scoring / alone, for the p95 time to first token and the p95 gap between tokens


async def stream(url: str, model: str, seed: int, max_tokens: int) -> dict:
    """One streaming completion: its time to first token and every gap between two tokens."""
    body = {"model": model, "prompt": PROMPTS[seed % len(PROMPTS)], "max_tokens": max_tokens, "min_tokens": max_tokens}
    body.update(temperature=0.8, top_k=50, seed=seed, stream=True)
    host, port = url.removeprefix("http://").split(":")
    t0, times = time.perf_counter(), []
    async for status, event in sse_events(host, int(port), "/v1/completions", body):
        if status != 200 or '"error"' in event:
            return {"ok": False, "why": event[:200]}
        if event.startswith("data: {") and '"finish_reason":null' in event.replace(" ", ""):
            times.append(time.perf_counter())
    if not times:
        return {"ok": False, "why": "no token"}
    return {"ok": True, "ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": len(times)}


def scorer(url: str, body: dict, seconds: float) -> list[float]:
    """The one other client, in a process of its own (reading its megabytes of response must not
    delay the streams' clocks): ``body`` (the largest allowed scoring request, or a beam search),
    again and again for ``seconds``."""
    seconds_each, until = [], time.perf_counter() + seconds
    with httpx.Client(timeout=600) as client:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"the other client's request failed: {r.status_code} {r.text[:300]}")
            seconds_each.append(time.perf_counter() - t0)
    return seconds_each


async def condition(url: str, a, other: dict | None) -> dict:
    results: list[dict] = []
    until = time.perf_counter() + a.seconds

    async def client(c: int) -> None:
        k = 0
        while time.perf_counter() < until:
            results.append(await stream(url, a.model, 1000 * c + k, a.max_tokens))
            k += 1

    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(1) as pool:
        scoring = [asyncio.wrap_future(pool.submit(scorer, url, other, a.seconds))] if other is not None else []
        done = await asyncio.gather(*(client(c) for c in range(a.streams)), *scoring)
    ok = [r for r in results if r["ok"]]
    row = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p95_ms": round(1000 * percentile([r["ttft"] for r in ok], 0.95), 1),
        "gap_p95_ms": round(1000 * percentile([g for r in ok for g in r["gaps"]], 0.95), 2),
        "gap_p50_ms": round(1000 * percentile([g for r in ok for g in r["gaps"]], 0.5), 2),
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / (time.perf_counter() - t0), 1),
    }
    if other is not None:
        row["other_requests"], row["other_s_p50"] = len(done[-1]), round(statistics.median(done[-1]), 2)
    return row


def other_request(url: str, a) -> dict:
    """The other client's request: the largest scoring request the server allows, or beam search
    of width ``--beam-width`` over ``--max-tokens`` tokens."""
    if a.beside == "beam":
        return {"model": a.model, "prompt": PROMPTS[0], "max_tokens": a.max_tokens, "beam_width": a.beam_width}
    ids = scoring_prompt(url, a.max_score_tokens)
    return {"model": a.model, "prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0}


def scoring_prompt(url: str, tokens: int) -> list[int]:
    """``tokens`` token ids of Shakespeare-like text (the prompts repeated), as the model encodes them."""
    text = "\n".join(PROMPTS) + "\n"
    ids: list[int] = []
    while len(ids) < tokens:
        ids += httpx.post(url + "/v1/tokenize", json={"text": text * 64}).json()["ids"]
    return ids[:tokens]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "runs" / "demo"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0, help="each condition of each round")
    p.add_argument("--max-score-tokens", type=int, default=16_384)
    p.add_argument("--beside", choices=("scoring", "beam"), default="scoring", help="what the other client asks")
    p.add_argument("--beam-width", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="1 round, 4 streams, 3 s, 512 scored tokens")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.streams, a.seconds, a.max_tokens, a.max_score_tokens = 1, 4, 3.0, 16, 512
    if not Path(a.checkpoint).exists():
        print(f"{a.checkpoint} not found: run `make demo` first (it writes runs/demo) or give --checkpoint")
        return 2
    port = free_port()
    server = start_server(
        a.checkpoint, a.threads, port, 10_000_000, extra=["--max-score-tokens", str(a.max_score_tokens)]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        a.model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        other = other_request(url, a)
        runs: dict[str, list[dict]] = {"alone": [], a.beside: []}
        for k in range(a.rounds):
            order = ["alone", a.beside] if k % 2 == 0 else [a.beside, "alone"]
            for name in order:
                runs[name].append(asyncio.run(condition(url, a, other if name != "alone" else None)))
                print(f"round {k + 1} {name}: {runs[name][-1]}", flush=True)
    finally:
        stop_server(server)
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    ratios = {key: round(medians[a.beside][key] / medians["alone"][key], 2) for key in ("ttft_p95_ms", "gap_p95_ms")}
    print("\n| condition | requests | errors | TTFT p95 ms | gap p50 ms | gap p95 ms | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, m in medians.items():
        print(
            f"| {name} | {m['requests']:.0f} | {m['errors']:.0f} | {m['ttft_p95_ms']:.1f} | {m['gap_p50_ms']:.2f} "
            f"| {m['gap_p95_ms']:.2f} | {m['tokens_per_s']:.1f} |"
        )
    asked = f"{a.max_score_tokens} tokens scored" if a.beside == "scoring" else f"beam {a.beam_width}"
    print(
        f"\n{a.beside} / alone: TTFT p95 {ratios['ttft_p95_ms']}x, gap p95 {ratios['gap_p95_ms']}x "
        f"(target <= {TARGET}x); "
        f"the other client: {medians[a.beside]['other_requests']:.0f} requests ({asked}), "
        f"{medians[a.beside]['other_s_p50']} s each (median)"
    )
    errors = sum(r["errors"] for rs in runs.values() for r in rs)
    met = errors == 0 and all(v <= TARGET for v in ratios.values())
    if a.json:
        setup = {k: getattr(a, k) for k in ("checkpoint", "threads", "rounds", "streams", "max_tokens", "seconds")}
        setup["checkpoint"] = str(a.checkpoint).removeprefix(f"{REPO}/")  # no machine path in a result
        setup.update(
            max_score_tokens=a.max_score_tokens, beside=a.beside, beam_width=a.beam_width, cpu_count=os.cpu_count()
        )
        report = {"runs": runs, "medians": medians, "ratios": ratios, "target": TARGET, "met": met, "setup": setup}
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
