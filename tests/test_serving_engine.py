"""The model engine in its own process (`tinylm/serving/engine.py`): every route answers as it does
with the model in the server process, completions are token for token `tinylm generate`'s alone and
16 at a time, a cancelled row leaves the engine's batch, and a killed engine is answered 503, then
restarted. One engine process serves the module (starting one takes seconds)."""

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from serving_util import REPO, free_port, leave_together, make_run, stop_the_decoder
from test_serving import KNOBS, PROMPTS, generate_cli

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.generation.batch import Row, TokenEvent
from tinylm.generation.generate import encode_prompt, generate_many
from tinylm.generation.processors import GenerationConfig
from tinylm.models.gpt import GPT
from tinylm.serving import engine as engine_module
from tinylm.serving.app import create_app
from tinylm.serving.completions import Limits
from tinylm.serving.engine import LocalEngine, ModelShape, ModelSpecs, ProcessEngine, start_engine
from tinylm.serving.models import ModelSpec, load_models
from tinylm.serving.scheduler import DecodingStopped, Scheduler
from tinylm.serving.state import RunsRoot

LIMITS = Limits(max_tokens=256, max_choices=16)
VOLATILE = {"id", "created", "seconds", "tokens_per_s"}  # differ between any two runs of a request


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    make_run(root)
    return root


@pytest.fixture(scope="module")
def rope():
    """A GPT built in memory (rotary positions, grouped heads): the engine gets it pickled."""
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=303, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    return GPT(dataclasses.replace(config, positions="rope")).eval()


@pytest.fixture(scope="module")
def engine(root, rope):
    engine = ProcessEngine(threads=1)
    tokenizer = load_models([str(root / "tinyrun")], [], max_batch=1)["tinyrun"]
    tokenizer.scheduler.close()
    models = engine.start(
        {
            "tinyrun": ModelSpec(str(root / "tinyrun"), max_batch=16),
            "rope": ModelSpec("in-memory", max_batch=16, built=(rope, tokenizer.tokenizer, {"format": "tinylm"})),
        }
    )
    yield engine, models
    engine.close()
    assert engine.process.exitcode == 0  # it stopped when told to, not terminated


@pytest.fixture(scope="module")
def client(engine, root):
    engine, models = engine
    with TestClient(create_app(models, LIMITS, runs=RunsRoot(root, max_batch=4), engine=engine)) as c:
        yield c


@pytest.fixture(scope="module")
def local(root):
    """The same checkpoint in this process (decoding on a thread): what the engine must answer."""
    models = load_models([str(root / "tinyrun")], [], max_batch=16)
    with TestClient(create_app(models, LIMITS, runs=RunsRoot(root, max_batch=4))) as c:
        yield c
    for served in c.app.state.server.models.values():
        served.scheduler.close()


def stable(body):
    """``body`` without the fields that differ between two runs of one request (ids, times)."""
    if isinstance(body, dict):
        return {k: stable(v) for k, v in body.items() if k not in VOLATILE}
    if isinstance(body, list):
        return [stable(v) for v in body]
    return body


def token_ids(client, **body) -> list[int]:
    r = client.post("/v1/completions", json={"model": "tinyrun", "max_tokens": 48, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["tinylm"]["token_ids"]


# ------------------------------------------------------------------------------------ routes
def test_the_engine_holds_the_weights_and_the_server_the_tokenizer(client, engine):
    engine, models = engine
    assert engine.process.is_alive() and engine.process.pid != os.getpid()
    assert isinstance(models["tinyrun"].model, ModelShape)  # no weights in the server process
    assert (
        models["tinyrun"].tokenizer.encode("The dog")
        == client.post("/v1/tokenize", json={"model": "tinyrun", "text": "The dog"}).json()["ids"]
    )
    health = client.get("/health").json()
    assert health == {"status": "ok", "models": ["tinyrun", "rope"], "active_rows": {"tinyrun": 0, "rope": 0}}


def test_engine_thread_keeps_the_models_in_this_process(root):
    """`tinylm serve --engine thread`: what the benchmark compares the engine process with."""
    engine, models = start_engine(ModelSpecs({"tinyrun": ModelSpec(str(root / "tinyrun"), max_batch=2)}, "thread"))
    assert isinstance(engine, LocalEngine) and isinstance(models["tinyrun"].scheduler, Scheduler)
    assert isinstance(models["tinyrun"].model, GPT)
    models["tinyrun"].scheduler.close()


ROUTES = [
    ("GET", "/v1/models/tinyrun", None),
    ("POST", "/v1/tokenize", {"text": "The dog ran."}),
    ("POST", "/v1/detokenize", {"tokens": [5, 6, 7]}),
    ("POST", "/v1/score", {"text": "The dog ran."}),
    ("POST", "/v1/attention", {"text": "The dog ran."}),
    ("POST", "/v1/tinylm/lens", {"text": "The dog ran.", "top": 3}),
    ("POST", "/v1/tinylm/score", {"text": "The dog ran.", "models": ["tinyrun"], "top": 3}),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 9, "seed": 3, "logprobs": 2, "echo": True}),
    ("POST", "/v1/completions", {"prompt": "The", "max_tokens": 6, "temperature": 0, "stop": ["e"], "n": 2, "seed": 1}),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 5, "beam_width": 3, "n": 2, "logprobs": 2, "seed": 1}),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 0, "echo": True, "logprobs": 1, "seed": 1}),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 7, "seed": 5, "stream": True, "logprobs": 1}),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}),  # errors are the same too
    ("POST", "/v1/completions", {"prompt": [[5, 999999]]}),
    ("GET", "/v1/tinylm/runs", None),
]


@pytest.mark.parametrize(("method", "route", "body"), ROUTES, ids=[f"{m} {r}" for m, r, _ in ROUTES])
def test_every_route_answers_as_with_the_model_in_the_server_process(client, local, method, route, body):
    if body is not None and route != "/v1/tinylm/score" and "runs" not in route:
        body = {"model": "tinyrun", **body}
    got, want = (c.request(method, route, json=body) for c in (client, local))
    assert got.status_code == want.status_code
    assert answer(got) == answer(want)


def answer(r):
    """A response's JSON, or its stream's events, without the fields that differ between runs."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        return stable(r.json())
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert len(events) > 3 and events[-1] == "[DONE]"
    return [stable(json.loads(e)) for e in events[:-1]]


def test_runs_load_and_samples_run_in_the_engine(client, local, engine):
    engine, _ = engine
    body = {"run": "tinyrun", "checkpoint": "best"}
    first = client.post("/v1/tinylm/runs/load", json=body)
    assert first.status_code == 200 and first.json() == {"model": "tinyrun-best", "reloaded": False, "step": 30}
    assert "tinyrun-best" in engine.specs  # a restarted engine loads it again
    old = client.app.state.server.models["tinyrun-best"]
    assert token_ids(client, model="tinyrun-best", prompt="The", temperature=0) == token_ids(
        client, prompt="The", temperature=0
    )
    again = client.post("/v1/tinylm/runs/load", json=body).json()
    assert again["reloaded"] and not old.scheduler.alive
    assert client.app.state.server.models["tinyrun-best"].scheduler.alive
    samples = {"run": "tinyrun", "checkpoint": "best", "max_tokens": 8}
    got, want = (c.post("/v1/tinylm/runs/samples", json=samples) for c in (client, local))
    assert got.status_code == 200 and got.json() == want.json()


# ---------------------------------------------------------------------------- same tokens
CASES = [(p, k, 10 + i) for i, (p, k) in enumerate((p, k) for p in PROMPTS for k in KNOBS)]  # 12 requests


def test_tokens_are_tinylm_generate_s_alone_and_16_at_a_time(client, root, capsys):
    """Greedy and seeded sampling, each knob; 48 tokens slide past the context (32). The 16
    concurrent requests are the 12 cases and 4 of them again."""
    want = [generate_cli(capsys, root / "tinyrun", p, k, 48, seed) for p, k, seed in CASES]
    alone = [token_ids(client, prompt=p, seed=seed, **k) for p, k, seed in CASES]
    assert alone == want
    sixteen = CASES + CASES[:4]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda case: token_ids(client, prompt=case[0], seed=case[2], **case[1]), sixteen))
    assert together == want + want[:4]


def test_rows_leaving_together_in_the_engine_do_not_stop_it(client, root, engine, capsys):
    """The class's disconnects in the engine process: 100 times, 16 streaming rows, a random subset
    cancelled while the model is held between two steps, then the rest; no row gets an error, the
    engine lives on (/health ok) and a request after them is `tinylm generate`'s token for token."""
    engine, models = engine
    scheduler = models["tinyrun"].scheduler
    assert leave_together(scheduler, models["tinyrun"], trials=100, seed=1) >= 80
    assert client.get("/health").json()["status"] == "ok" and engine.crashes == 0
    p, k, seed = CASES[1]
    assert token_ids(client, prompt=p, seed=seed, **k) == generate_cli(capsys, root / "tinyrun", p, k, 48, seed)


def test_a_model_built_in_memory_decodes_in_the_engine_as_in_this_process(client, rope, engine):
    tokenizer = engine[1]["rope"].tokenizer
    knobs = [{"temperature": 0}, {"temperature": 0.9, "top_k": 20}]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: token_ids(client, model="rope", prompt="Once", seed=4, **k), knobs * 2))
    cfg = GenerationConfig(max_new_tokens=48, seed=4, seed_per_row=True, stop_ids=tuple(tokenizer.stop_ids))
    want = [
        generate_many(rope, [encode_prompt(tokenizer, "Once")], dataclasses.replace(cfg, **k))[0].tokens for k in knobs
    ]
    assert got == want * 2


# ------------------------------------------------------------------------- cancel and crash
def long_row(events: list, started: threading.Event) -> Row:
    """A row that would decode for minutes: only cancelling it (or a crash) ends it early."""

    def emit(event):
        events.append(event)
        started.set()

    cfg = GenerationConfig(max_new_tokens=10**6, min_new_tokens=10**6, temperature=1.0, seed=1)
    return Row([2, 5, 6], cfg, emit)


def active_rows(engine, name: str, want: int, seconds: float = 10) -> int:
    deadline = time.monotonic() + seconds
    while engine.schedulers[name].active != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.schedulers[name].active


def test_a_cancelled_row_leaves_the_engine_batch(engine):
    engine, models = engine
    scheduler = models["tinyrun"].scheduler
    events, started = [], threading.Event()
    row = long_row(events, started)
    scheduler.add(row)
    assert started.wait(30) and active_rows(engine, "tinyrun", 1) == 1
    scheduler.cancel(row)  # what a client's disconnect does (completions.start_rows)
    assert active_rows(engine, "tinyrun", 0) == 0
    assert not engine.rows and not engine.row_ids
    assert all(isinstance(e, TokenEvent) for e in events)


@pytest.mark.slow  # two engine processes started, one killed and started again (~15 s)
def test_a_killed_engine_is_answered_503_then_restarted(root):
    with pytest.raises(TinyLMError, match="does not exist"):  # a model that does not load: said at start
        ProcessEngine(threads=1).start({"x": ModelSpec(str(root / "missing"))})
    engine = ProcessEngine(threads=1)
    models = engine.start({"tinyrun": ModelSpec(str(root / "tinyrun"), max_batch=4)})
    with TestClient(create_app(models, LIMITS, engine=engine)) as client:
        before = token_ids(client, prompt="The", temperature=0)
        events, started = [], threading.Event()
        models["tinyrun"].scheduler.add(long_row(events, started))
        assert started.wait(30) and active_rows(engine, "tinyrun", 1) == 1
        os.kill(engine.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        while client.get("/health").status_code == 200 and time.monotonic() - killed < 5:
            pass
        flipped = time.monotonic() - killed
        health = client.get("/health")
        assert flipped < 0.5 and health.status_code == 503  # the moment the pipe reads end-of-file
        assert health.json()["active_rows"] == {"tinyrun": 0} and int(health.headers["Retry-After"]) >= 1
        deadline = time.monotonic() + 10
        while not isinstance(events[-1], DecodingStopped) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(events[-1], DecodingStopped) and "exit code -9" in events[-1].message  # in flight: told
        # the engine takes seconds to start again: meanwhile every route that needs the model says why
        health = client.get("/health")
        assert health.status_code == 503 and "restarting" in health.json()["error"]
        r = client.post("/v1/completions", json={"model": "tinyrun", "prompt": "The"})
        assert (
            r.status_code == 503 and "the model engine process stopped (exit code -9)" in r.json()["error"]["message"]
        )
        assert int(r.headers["Retry-After"]) >= 1  # every 503 says when to try again
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get("/health").json()["status"] == "ok"
        assert token_ids(client, prompt="The", temperature=0) == before
    engine.close()
    assert engine.process.exitcode == 0 and engine.crashes == 1


@pytest.mark.slow  # an engine started four times (~15 s)
def test_a_stopped_decoder_restarts_the_engine_and_a_crash_loop_gives_up(root, monkeypatch, caplog):
    """A decoding thread that cannot go on ends the engine with its traceback in the server's log,
    and the engine restarts; crashes count within a window, and one more than the budget gives up
    (``on_give_up``: `tinylm serve` exits) while old crashes no longer count."""
    monkeypatch.setattr(engine_module, "MAX_RESTARTS", 1)
    monkeypatch.setattr(engine_module, "RESTART_WINDOW", 3600.0)
    engine = ProcessEngine(threads=1)
    models = engine.start({"tinyrun": ModelSpec(str(root / "tinyrun"), max_batch=4)})
    gave_up = []
    engine.on_give_up = gave_up.append
    scheduler = models["tinyrun"].scheduler
    try:
        scheduler.call(stop_the_decoder, models["tinyrun"]).result(timeout=30)
        events, started = [], threading.Event()
        scheduler.add(long_row(events, started))
        assert started.wait(30) and isinstance(events[-1], DecodingStopped)
        deadline = time.monotonic() + 60
        while (engine.crashes < 1 or engine.down is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.down is None and engine.crashes == 1 and not gave_up
        said = [r.getMessage() for r in caplog.records if "exit code 70" in r.getMessage()]
        assert said and "a planted fault in the decoding step" in said[0] and "Traceback" in said[0]
        engine.recent_crashes[0] -= 7200  # the first crash is older than the window now
        os.kill(engine.process.pid, signal.SIGKILL)
        while (engine.crashes < 2 or engine.down is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.down is None and not gave_up  # one crash in the window: within the budget
        os.kill(engine.process.pid, signal.SIGKILL)
        while not gave_up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gave_up and "2 times in 3600 s: no more restarts" in gave_up[0] and engine.down == gave_up[0]
    finally:
        engine.close()


@pytest.mark.slow  # a real `tinylm serve` and its engine (~8 s)
def test_ctrl_c_stops_the_server_and_its_engine(root):
    port = free_port()
    cmd = [sys.executable, "-m", "tinylm.cli", "serve", "--checkpoint", str(root / "tinyrun"), "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        engines = [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(engines) == 1  # the engine, a child of the server
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0, server.stdout.read()
        assert not Path(f"/proc/{engines[0]}").exists()  # it exited with the server (and was reaped)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
