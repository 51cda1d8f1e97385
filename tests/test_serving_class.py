"""`tinylm serve` as a class meets it, as real processes: clients leaving together (both engines),
the port taken or chosen by the system, Ctrl-C and SIGTERM with streams open, and an engine that
keeps crashing."""

import concurrent.futures
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving_util import REPO, free_port, live_server, make_run, wait_healthy

pytestmark = pytest.mark.slow  # server processes (~3 s each)
ENDLESS = {"model": "tinyrun", "prompt": "Once", "max_tokens": 1_000_000, "min_tokens": 1_000_000, "stream": True}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("class"))


def serve_command(run: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tinylm.cli", "serve", "--checkpoint", str(run), "--threads", "1", *args]


def stream_until(url: str, leave: threading.Barrier, tokens: int = 3) -> int:
    """An endless stream read for ``tokens`` chunks, then left when every client of the barrier is there."""
    with httpx.stream("POST", url + "/v1/completions", timeout=30, json=ENDLESS) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(tokens):
            next(lines)
        leave.wait(timeout=30)
    return r.status_code


def engine_pid(server: subprocess.Popen) -> int:
    """The server's engine process (its other child is multiprocessing's resource tracker; a restarted
    engine is a child of the thread that started it)."""
    children = [
        c for task in Path(f"/proc/{server.pid}/task").iterdir() for c in (task / "children").read_text().split()
    ]
    return next(int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text())


def wait_for_rows(url: str, want: int, seconds: float = 30) -> int:
    deadline = time.monotonic() + seconds
    while (rows := httpx.get(url + "/health").json()["active_rows"]["tinyrun"]) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return rows


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_streams_leaving_together_over_http(run, engine):
    """Ten times: 16 streaming clients, a random subset of them (2 to all) closing their connections
    together; the others keep streaming. Then /health is ok and a request decodes as before."""
    rng = random.Random(3)
    args = ("--checkpoint", str(run), "--threads", "1", "--max-tokens", "1000000", "--engine", engine)
    with live_server(*args) as url:
        want = httpx.post(
            url + "/v1/completions", json={"model": "tinyrun", "prompt": "The", "max_tokens": 20, "temperature": 0}
        ).json()
        for trial in range(10):
            leaving = rng.randint(2, 16)
            leave, stay = threading.Barrier(leaving), threading.Barrier(17 - leaving)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                streams = [pool.submit(stream_until, url, leave if i < leaving else stay) for i in range(16)]
                deadline = time.monotonic() + 30
                while leave.n_waiting < leaving and time.monotonic() < deadline and not any(s.done() for s in streams):
                    time.sleep(0.01)
                assert wait_for_rows(url, 16 - leaving) == 16 - leaving, trial  # they left, the rest decode
                stay.wait(timeout=30)
                assert [s.result() for s in streams] == [200] * 16
            assert wait_for_rows(url, 0) == 0
            assert httpx.get(url + "/health").json()["status"] == "ok", trial
        again = httpx.post(
            url + "/v1/completions", json={"model": "tinyrun", "prompt": "The", "max_tokens": 20, "temperature": 0}
        )
        assert again.json()["choices"][0]["tinylm"]["token_ids"] == want["choices"][0]["tinylm"]["token_ids"]


def test_a_busy_port_fails_before_loading_and_port_0_says_its_port(run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        busy = subprocess.run(serve_command(run, "--port", str(port)), cwd=REPO, capture_output=True, text=True)
        seconds = time.monotonic() - started
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}: the port is in use" in busy.stderr
    assert "serving" not in busy.stderr + busy.stdout and seconds < 15  # the imports, no model loaded
    server = subprocess.Popen(
        serve_command(run, "--port", "0"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = server.stdout.readline()
        while "serving" not in line and line:
            line = server.stdout.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        assert port != 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_ends_every_stream_with_an_error_and_done(run, sig):
    """Four streams open when the server is told to stop: each ends with an error event saying so
    and [DONE]; the server exits 0, with its engine, and prints no traceback."""
    port = free_port()
    server = subprocess.Popen(
        serve_command(run, "--port", str(port), "--max-tokens", "1000000"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        engine = engine_pid(server)
        streams, opened = [], threading.Barrier(5)

        def read_stream() -> list[str]:
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json=ENDLESS) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if len(lines) == 2:
                            opened.wait(timeout=30)
                return lines

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(read_stream) for _ in range(4)]
            opened.wait(timeout=30)
            server.send_signal(sig)
            ends = [s.result(timeout=30)[-2:] for s in streams]
        assert server.wait(timeout=30) == 0
        output = server.stdout.read()
        for error, done in ends:
            assert "the server is shutting down" in error and done == "data: [DONE]"
        assert "Traceback" not in output, output
        assert not Path(f"/proc/{engine}").exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_an_engine_that_keeps_crashing_ends_the_server_with_one_line(run):
    """Six crashes in the window (five are recovered from): the server exits non-zero, saying why."""
    port = free_port()
    server = subprocess.Popen(
        serve_command(run, "--port", str(port)), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for crash in range(6):
            wait_healthy(url)
            os.kill(engine_pid(server), signal.SIGKILL)
            if crash < 5:
                time.sleep(0.5)
        assert server.wait(timeout=60) == 2
        last = server.stderr.read().strip().splitlines()[-1]
        assert last.startswith("tinylm serve: error: the model engine process stopped (exit code -9), 6 times in 600 s")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
