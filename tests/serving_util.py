"""Helpers of the serving tests: a small checkpoint written in a fraction of a second (a seeded GPT
on a character tokenizer, with a metrics.csv so it looks like a run), and `tinylm serve` started
as a real process on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from conftest import make_stories

from tinylm.config import GenerationConfig, ModelConfig
from tinylm.generation.batch import Row, TokenEvent
from tinylm.models.checkpoint import save_checkpoint
from tinylm.models.gpt import GPT
from tinylm.tokenizers.char import CharTokenizer
from tinylm.training.metrics import MetricsLog

REPO = Path(__file__).resolve().parents[1]


def make_run(root: Path, context_length: int = 32) -> Path:
    """runs/<name>/ with checkpoints/best, a metrics.csv of a few rows and an eval.json."""
    torch.manual_seed(0)
    tok = CharTokenizer().train(make_stories())
    model = GPT(
        ModelConfig(vocab_size=tok.vocab_size, context_length=context_length, d_model=32, n_layers=2, n_heads=4)
    ).eval()
    run = root / "tinyrun"
    save_checkpoint(run / "checkpoints" / "best", model, tok, info={"step": 30})
    log = MetricsLog(run / "metrics.csv")
    for step, (train, val) in enumerate([(3.9, 3.8), (3.1, 3.2), (2.6, 2.8)]):
        log.write({"step": 10 * step, "train_loss": train, "val_loss": val})
    (run / "eval.json").write_text(
        json.dumps({"steps": 30, "stopped_because": "max_steps", "eval": {"valid": {"token_ppl": 16.4, "bpb": 4.0}}})
    )
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, seconds: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Until /health answers 200 (a server starting, or its engine starting again); a server
    process that exits meanwhile is an error with its output."""
    deadline = time.monotonic() + seconds
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"tinylm serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            output = ""
            if proc is not None:  # what the server said is the way to know why
                proc.kill()
                output = ": " + proc.communicate()[0][-3000:]
            raise RuntimeError(f"{url} did not answer /health with 200 within {seconds} s{output}")
        time.sleep(0.1)


@contextlib.contextmanager
def live_server(*args: str, timeout: float = 60.0):
    """`tinylm serve ARGS --port P` as a subprocess; yields its base URL, stops it afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinylm.cli", "serve", *args, "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------- rows leaving together
def hold_until_cancelled(served, n: int, seconds: float = 10.0) -> bool:
    """On the model's task thread (``scheduler.call``, in whichever process holds the model): hold
    the model, so that the decoding thread waits before its next step, until ``n`` rows of its
    batch are cancelled. True when they were: they all leave between the same two steps."""
    scheduler = served.scheduler
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if scheduler.turns.decoder_waiting and sum(r.cancelled.is_set() for r in scheduler.batch.rows) >= n:
            return True
        time.sleep(0.0005)
    return False


def leave_together(scheduler, holder, trials: int, seed: int, rows: int = 16) -> int:
    """``trials`` times: ``rows`` endless rows decode, a random subset of them (2 to all) is cancelled
    while the model is held (``hold_until_cancelled``), then the rest. Each trial checks that no row
    got an error and that the batch empties; returns how many trials had the subset leave together."""
    rng, together = random.Random(seed), 0
    for trial in range(trials):
        events: list[list] = [[] for _ in range(rows)]
        endless = [
            Row(
                [2, 5 + i % 7, 6],
                GenerationConfig(max_new_tokens=10**6, min_new_tokens=10**6, temperature=1.0, seed=trial * rows + i),
                events[i].append,
            )
            for i in range(rows)
        ]
        for row in endless:
            scheduler.add(row)
        wait_for(lambda: all(e for e in events), f"trial {trial}: every row's first token")
        subset = rng.sample(endless, rng.randint(2, rows))
        held = scheduler.call(hold_until_cancelled, holder, len(subset))
        turns = getattr(scheduler, "turns", None)  # in this process: seen; in the engine's: given time
        if turns is not None:
            wait_for(lambda: turns.task_running and turns.decoder_waiting, f"trial {trial}: the model held")
        else:
            time.sleep(0.05)
        for row in subset:
            scheduler.cancel(row)
        together += held.result(timeout=30)
        survivors = [i for i, row in enumerate(endless) if row not in subset]
        after = [len(events[i]) for i in survivors]  # the rows that stay must keep decoding
        wait_for(
            lambda: all(
                len(events[i]) >= n + 2 or not isinstance(events[i][-1], TokenEvent) for i, n in zip(survivors, after)
            ),
            f"trial {trial}: two more tokens for every row that stays",
        )
        for row in endless:
            scheduler.cancel(row)
        wait_for(lambda: scheduler.active == 0, f"trial {trial}: the batch empties")
        errors = [e for row_events in events for e in row_events if not isinstance(e, TokenEvent)]
        assert not errors and scheduler.alive, (trial, errors[:1])
    return together


def wait_for(condition, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def stop_the_decoder(served) -> None:
    """On the model's task thread: the next decoding step raises what no pass can go on from (the
    decoding thread stops; in an engine process, the engine exits and is restarted)."""

    def broken(*args, **kwargs):
        raise SystemExit("a planted fault in the decoding step")

    served.scheduler.batch.step = broken
