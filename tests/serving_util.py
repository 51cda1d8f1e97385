"""Helpers of the serving tests: a small checkpoint written in a fraction of a second (a seeded GPT
on a character tokenizer, with a metrics.csv so it looks like a run), and `tinylm serve` started
as a real process on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from conftest import make_stories

from tinylm.config import ModelConfig
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
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tinylm serve exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("tinylm serve did not answer /health in time")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
