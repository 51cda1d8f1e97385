"""Where the models run: in an engine process of their own (``ProcessEngine``, what ``tinylm serve``
starts), or in the server process, a decoding thread each (``LocalEngine``).

Why a process: in one process the decoding thread and the event loop share one GIL
(docs/notes/issue-27.md), so streaming waits for decoding and decoding for streaming. The engine
process holds the models, their KV caches, the schedulers (``scheduler.py`` stepping
``generation.batch.Batch``) and sampling; the server process (FastAPI: requests, validation,
detokenisation, server-sent events, the playground's routes) holds each model's tokenizer and
config, and the two talk over one pipe. This is vLLM V1's engine core, without its sockets.

The protocol: tuples, pickled.

  server -> engine
    ("add", row_id, model, prompt_ids, cfg, logprobs, prompt_logprobs)  decode a row (``generation.batch.Row``)
    ("cancel", row_id)                                 its client has gone: the row leaves the batch
    ("call", call_id, model, fn, args)                 ``fn(served, *args)`` on the model's decoding
                                                       thread (model None: ``fn(*args)`` on a thread)
    ("load", call_id, name, spec)                      serve a checkpoint under ``name`` (the Runs view)
    ("stop",)                                          close the schedulers and exit
  engine -> server
    ("ready", {name: ServedModel}) or ("failed", exc)  once, after loading: each model's outline
                                                       (tokenizer, config, card; no weights)
    ("fatal", reason)                                  the engine cannot go on (a decoding thread
                                                       stopped; the reason holds its traceback):
                                                       it exits next, and the server restarts it
    ("events", model, active_rows, [(row_id, event)])  one decoding pass's events, in one message
                                                       (active_rows None: unchanged)
    ("result", call_id, ok, value or exception)

Why a ``multiprocessing`` Pipe: one engine talks to one server on one machine, and a Pipe (a Unix
socket pair) frames and pickles messages, goes to a spawned child as an argument, and reads
end-of-file the moment the other side dies, which is how each side learns that the other has
gone. A TCP or ZeroMQ socket (vLLM's, for many engines and front ends) would add a port or a
dependency for nothing here. The child is spawned, not forked: the server process has threads.

Stop strings are checked in the engine, on each row's tokens (``Row.decode``, the rule of
``tinylm generate``), so a row stops at the step it stops alone; the server turns each row's
tokens into the response's text (``completions.new_text``).

A crash of the engine: the server's reader thread reads end-of-file, and at once every route
that needs a model, and /health, answers 503 saying why (with ``Retry-After``); every request in
flight is answered 503 (``scheduler.DecodingStopped``), the crash is logged (with the engine's
traceback when it sent one) and the engine is started again with the same models. A crash loop
is not served for ever: after ``MAX_RESTARTS`` crashes within ``RESTART_WINDOW`` seconds the server
gives up (``on_give_up``: ``tinylm serve`` exits non-zero, for a supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Literal

import torch

from tinylm.errors import TinyLMError
from tinylm.generation.batch import ErrorEvent, Row, ends_row
from tinylm.serving.completions import unavailable
from tinylm.serving.models import ModelSpec, ServedModel
from tinylm.serving.scheduler import DecodingStopped

log = logging.getLogger(__name__)
MAX_RESTARTS = 5  # crashes within RESTART_WINDOW the server recovers from; one more and it gives up
RESTART_WINDOW = 600.0  # seconds
FATAL_EXIT = 70  # the engine's exit code when it cannot go on (EX_SOFTWARE)
SHUTTING_DOWN = "the server is shutting down; send the request again when it is back"
STOP_SECONDS = 10  # a stopping engine gets this long to exit before it is terminated
EngineKind = Literal["process", "thread"]


class ModelSpecs(dict):
    """The models to serve (name -> ModelSpec), not loaded yet, and where they will run:
    ``engine`` "process" (one engine process holds them all) or "thread" (the server process, a
    decoding thread each); ``threads``: the engine's torch threads (None: torch's choice)."""

    def __init__(self, specs: dict[str, ModelSpec], engine: EngineKind = "process", threads: int | None = None):
        super().__init__(specs)
        self.engine, self.threads = engine, threads


@dataclass
class ModelShape:
    """The server process's stand-in for a model the engine holds: what the routes read of it
    (its config, whether it generates, its size). The weights stay in the engine."""

    config: object
    generates: bool
    parameters: int

    def num_parameters(self) -> int:
        return self.parameters


def outline(served: ServedModel) -> ServedModel:
    """``served`` without its weights and scheduler: what the engine sends the server."""
    shape = ModelShape(served.model.config, getattr(served.model, "generates", True), served.model.num_parameters())
    return dataclasses.replace(served, model=shape, scheduler=None)


# ------------------------------------------------------------------------- the engine process
def engine_main(conn, specs: dict[str, ModelSpec], threads: int | None) -> None:
    """The engine process: load the models, then answer the server until it says stop or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the server stops us
    handler = logging.StreamHandler()  # stderr, shared with the server process
    handler.setFormatter(logging.Formatter("engine: %(message)s"))
    logging.getLogger("tinylm").addHandler(handler)
    logging.getLogger("tinylm").setLevel(logging.INFO)
    if threads:
        torch.set_num_threads(threads)
    core = EngineCore(conn)
    try:
        ready = {name: outline(core.host(name, spec)) for name, spec in specs.items()}
    except Exception as exc:  # a checkpoint that does not load: the server says so and exits
        conn.send(("failed", exc))
        return
    core.send(("ready", ready))
    gc.freeze()  # what loading made lives as long as we do: full collections no longer walk it (see app.serve)
    try:
        core.serve()
    except BaseException as exc:  # said to the server with the traceback, then a crash it restarts from
        core.fatal(f"the engine's message loop stopped: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")


class Hosted:
    """A model in the engine process, and the events of its rows not sent yet. ``flush`` runs on
    its decoding thread after each pass, so a step's events leave together."""

    def __init__(self, served: ServedModel, send, fatal: Callable[[str], None]):
        self.served, self.send, self.events, self.sent_active = served, send, [], 0
        served.scheduler.after_pass = self.flush
        served.scheduler.on_failure = lambda reason: fatal(f"model '{served.name}': {reason}")

    def flush(self) -> None:
        active = self.served.scheduler.active
        if self.events or active != self.sent_active:
            events, self.events, self.sent_active = self.events, [], active
            self.send(("events", self.served.name, active, events))


class EngineCore:
    """The engine process's side of the pipe: its models by name and the rows in flight by id."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()
        self.models: dict[str, Hosted] = {}
        self.rows: dict[int, tuple[Hosted, Row]] = {}

    def send(self, message) -> None:
        """Pickled by the sending thread, then written under the lock (decoding threads and task
        threads all send): a large result pickles without holding up the decoding thread's events."""
        data = ForkingPickler.dumps(message)
        with self.lock:
            self.conn.send_bytes(data)

    def fatal(self, reason: str) -> None:
        """The engine cannot go on: tell the server why (it logs it and restarts us), then exit."""
        with contextlib.suppress(Exception):
            self.send(("fatal", reason))
        os._exit(FATAL_EXIT)

    def host(self, name: str, spec: ModelSpec) -> ServedModel:
        """Load and serve ``spec`` as ``name``; a model already of that name is replaced, and its
        rows in flight end with an error."""
        hosted = Hosted(ServedModel.load(spec, name), self.send, self.fatal)
        old, self.models[name] = self.models.get(name), hosted
        if old is not None:
            old.served.scheduler.close()
            gone = [i for i, (h, _) in list(self.rows.items()) if h is old]
            message = f"the model '{name}' was reloaded while this request decoded; send it again"
            for i in gone:
                del self.rows[i]
            self.send(("events", name, None, [(i, ErrorEvent(message)) for i in gone]))
        return hosted.served

    def serve(self) -> None:
        handlers = {"add": self.add, "cancel": self.cancel, "call": self.call, "load": self.load}
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the server has gone
                break
            if message[0] == "stop":
                break
            try:
                handlers[message[0]](*message[1:])
            except Exception as exc:  # one bad message must not take the engine down
                log.exception("message %r failed", message[0])
                self.fail(message, exc)
        for hosted in self.models.values():
            hosted.served.scheduler.close()

    def fail(self, message: tuple, exc: Exception) -> None:
        """Whoever waits on a message that failed is told so: a call gets the exception, a row an error."""
        if message[0] in ("call", "load"):
            self.send(("result", message[1], False, exc))
        elif message[0] == "add":
            error = ErrorEvent(f"the engine could not start this row: {type(exc).__name__}: {exc}")
            self.send(("events", message[2], None, [(message[1], error)]))

    def add(
        self, row_id: int, model: str, prompt_ids: list[int], cfg, logprobs: int | None, prompt_logprobs: int | None
    ) -> None:
        hosted = self.models[model]

        def emit(event) -> None:  # on the decoding thread
            hosted.events.append((row_id, event))
            if ends_row(event):
                self.rows.pop(row_id, None)

        row = Row(prompt_ids, cfg, emit, hosted.served.tokenizer.decode, logprobs, prompt_logprobs)
        self.rows[row_id] = (hosted, row)
        hosted.served.scheduler.add(row)

    def cancel(self, row_id: int) -> None:
        hosted, row = self.rows.pop(row_id, (None, None))
        if row is not None:
            hosted.served.scheduler.cancel(row)

    def call(self, call_id: int, model: str | None, fn, args: tuple) -> None:
        if model is None:
            threading.Thread(target=lambda: self.reply(call_id, lambda: fn(*args)), daemon=True).start()
            return
        served = self.models[model].served
        future = served.scheduler.call(fn, served, *args)
        future.add_done_callback(lambda f: self.reply(call_id, f.result))

    def load(self, call_id: int, name: str, spec: ModelSpec) -> None:
        run = lambda: outline(self.host(name, spec))  # noqa: E731
        threading.Thread(target=lambda: self.reply(call_id, run), daemon=True).start()

    def reply(self, call_id: int, result) -> None:
        """Send ``result()``, or the exception it raises, back to the server."""
        try:
            message = ("result", call_id, True, result())
        except BaseException as exc:  # handed to the waiting request
            message = ("result", call_id, False, exc)
        try:
            self.send(message)
        except Exception as exc:  # a value or an exception that does not pickle
            self.send(("result", call_id, False, RuntimeError(f"{type(exc).__name__}: {exc}")))


# ------------------------------------------------------------------------- the server process
class RemoteScheduler:
    """The server process's handle on one model's scheduler in the engine process: the part of
    ``Scheduler``'s interface that the routes use."""

    def __init__(self, engine: "ProcessEngine", name: str):
        self.engine, self.name, self.active, self.closed = engine, name, 0, False

    def add(self, row: Row) -> None:
        self.engine.add(self.name, row)

    def cancel(self, row: Row) -> None:
        self.engine.cancel(row)

    def call(self, fn, served, *args) -> concurrent.futures.Future:
        """``fn(served, *args)`` in the engine, where its own ServedModel stands in for ``served``."""
        return self.engine.request("call", self.name, fn, args)

    @property
    def alive(self) -> bool:
        return not self.closed and self.engine.down is None

    @property
    def failure(self) -> str | None:
        """Why this model cannot decode now (``Scheduler.failure``'s counterpart): the engine's state."""
        return self.engine.down

    def close(self) -> None:
        """Stop using this handle (the engine closes the model's scheduler when it replaces it)."""
        self.closed = True


def settle(future: concurrent.futures.Future, ok: bool, value) -> None:
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except concurrent.futures.InvalidStateError:  # a request that gave up waiting cancelled it
        pass


class ProcessEngine:
    """The engine process, seen from the server: start it, send it rows and calls, hand their
    events and results to the waiting requests (a reader thread), restart it after a crash."""

    def __init__(self, threads: int | None = None):
        self.specs: dict[str, ModelSpec] = {}  # what a restarted engine loads
        self.threads = threads
        self.lock = threading.Lock()  # one sender at a time; a crash is handled between two sends
        self.rows: dict[int, Row] = {}  # the rows in flight by id, and their ids
        self.row_ids: dict[Row, int] = {}
        self.calls: dict[int, concurrent.futures.Future] = {}
        self.schedulers: dict[str, RemoteScheduler] = {}
        self.ids = itertools.count()
        self.down: str | None = None  # why the engine cannot answer now (None: it can)
        self.crashes, self.closing = 0, False
        self.recent_crashes: deque[float] = deque()  # when, within the last RESTART_WINDOW seconds
        self.last_words: str | None = None  # the engine's "fatal" reason, logged with its crash
        self.start_seconds = 1.0  # how long the engine took to load its models: a 503's Retry-After
        self.on_give_up: Callable[[str], None] | None = None  # the server exits (``app.serve``)
        self.process = self.conn = None

    def start(self, specs: dict[str, ModelSpec]) -> dict[str, ServedModel]:
        """Start the engine process, wait until its models are loaded, and return them as the
        server's routes use them (tokenizer and config here, weights and scheduler there)."""
        self.specs = dict(specs)
        models = {name: self.serve(name, served) for name, served in self.spawn().items()}
        threading.Thread(target=self.read, name="tinylm-engine-reader", daemon=True).start()
        return models

    @property
    def retry_after(self) -> int:
        """Seconds a client should wait before sending again while the engine is down."""
        return max(1, math.ceil(self.start_seconds))

    def spawn(self) -> dict[str, ServedModel]:
        started = time.monotonic()
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(
            target=engine_main, args=(child, self.specs, self.threads), name="tinylm-engine", daemon=True
        )
        process.start()
        child.close()  # the child holds its end now: our copy would hide its exit
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            process.join(STOP_SECONDS)
            raise TinyLMError(f"the model engine exited while loading the models (exit code {process.exitcode})")
        if kind == "failed":
            process.join(STOP_SECONDS)
            raise value
        self.process, self.conn = process, conn
        self.start_seconds = time.monotonic() - started
        return value

    def serve(self, name: str, served: ServedModel) -> ServedModel:
        served.scheduler = self.schedulers[name] = RemoteScheduler(self, name)
        return served

    # ------------------------------------------------------------------------------ sending
    def send(self, message: tuple) -> None:
        """Send under ``self.lock`` (held by the caller); an engine that has just died is a 503."""
        try:
            self.conn.send(message)
        except OSError as exc:  # the reader thread is about to see it too, and restart the engine
            raise unavailable(f"the model engine process is not answering ({exc})") from exc

    def add(self, model: str, row: Row) -> None:
        with self.lock:
            if self.down is not None:
                raise unavailable(self.down, self.retry_after)
            row_id = next(self.ids)
            self.rows[row_id], self.row_ids[row] = row, row_id
            self.send(("add", row_id, model, row.prompt_ids, row.cfg, row.logprobs, row.prompt_logprobs))

    def cancel(self, row: Row) -> None:
        row.cancel()
        row_id = self.row_ids.pop(row, None)
        with self.lock:
            if self.rows.pop(row_id, None) is not None and self.down is None:  # not finished yet
                with contextlib.suppress(OSError):  # an engine that has just died dropped the row already
                    self.conn.send(("cancel", row_id))

    def request(self, kind: str, *fields) -> concurrent.futures.Future:
        """Send (kind, call_id, *fields); the future gets the engine's result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.down is not None:
                raise unavailable(self.down, self.retry_after)
            call_id = next(self.ids)
            self.calls[call_id] = future
            try:
                self.send((kind, call_id, *fields))
            except BaseException:
                del self.calls[call_id]
                raise
        return future

    async def load(self, spec: ModelSpec, name: str) -> ServedModel:
        """Serve ``spec`` as ``name`` from now on (replacing a model of that name)."""
        served = await asyncio.wrap_future(self.request("load", name, spec))
        self.specs[name] = spec  # a restarted engine loads it too
        return self.serve(name, served)

    async def run(self, fn, *args):
        """``fn(*args)`` in the engine process, on a thread of its own (work that loads its own model)."""
        return await asyncio.wrap_future(self.request("call", None, fn, args))

    # ------------------------------------------------------------------------------ reading
    def read(self) -> None:
        """The reader thread: events to their rows, results to their futures, until the engine is
        stopped; a crash restarts it."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if self.closing or not self.restart():
                    return
                continue
            try:
                self.dispatch(message)
            except Exception:  # a request's bug must not stop every other request's events
                log.exception("engine message %r failed", message[0])

    def dispatch(self, message: tuple) -> None:
        if message[0] == "fatal":
            self.last_words = message[1]
        elif message[0] == "events":
            _, model, active, events = message
            if active is not None and model in self.schedulers:
                self.schedulers[model].active = active
            for row_id, event in events:
                row = self.rows.pop(row_id, None) if ends_row(event) else self.rows.get(row_id)
                if row is not None:
                    row.emit(event)
                    if ends_row(event):
                        self.row_ids.pop(row, None)
        elif message[0] == "result":
            _, call_id, ok, value = message
            future = self.calls.pop(call_id, None)
            if future is not None:
                settle(future, ok, value)

    def restart(self) -> bool:
        """After a crash: 503 at once, fail what was in flight, start the engine again; False when
        giving up (too many crashes in the window, or it does not start)."""
        with self.lock:  # /health and every route say so from this moment
            self.down = "the model engine process stopped; restarting it"
        for scheduler in self.schedulers.values():
            scheduler.active = 0
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():  # the pipe broke but the process lives on: it must not decode twice
            self.process.kill()
            self.process.join()
        reason = f"the model engine process stopped (exit code {self.process.exitcode})"
        self.fail_in_flight(f"{reason} while this request decoded; send it again")
        now = time.monotonic()
        self.crashes += 1
        self.recent_crashes.append(now)
        while self.recent_crashes and self.recent_crashes[0] < now - RESTART_WINDOW:
            self.recent_crashes.popleft()
        words, self.last_words = self.last_words, None
        log.error(
            "%s, crash %d in %.0f s (at most %d)%s",
            reason,
            len(self.recent_crashes),
            RESTART_WINDOW,
            MAX_RESTARTS,
            f"; it said: {words}" if words else "",
        )
        if len(self.recent_crashes) > MAX_RESTARTS:
            return self.give_up(
                f"{reason}, {len(self.recent_crashes)} times in {RESTART_WINDOW:.0f} s: no more restarts"
            )
        self.down = f"{reason}; restarting it"
        try:
            self.spawn()
        except Exception as exc:
            return self.give_up(f"{reason}, and it failed to start again ({exc})")
        self.down = None
        log.warning("the model engine is running again")
        return True

    def give_up(self, reason: str) -> bool:
        self.down = f"{reason}; start `tinylm serve` again"
        log.error(self.down)
        if self.on_give_up is not None:
            self.on_give_up(self.down)
        return False

    def fail_in_flight(self, message: str) -> None:
        """Every row in flight gets ``message`` (a 503), every call waiting on the engine too."""
        with self.lock:
            rows, self.rows, self.row_ids, calls, self.calls = self.rows, {}, {}, self.calls, {}
        for row in rows.values():
            row.emit(DecodingStopped(message))
        for future in calls.values():
            settle(future, False, unavailable(message))

    def close(self) -> None:
        """Stop the engine: what is in flight is answered 503, the engine closes its schedulers and
        exits (terminated if it does not)."""
        self.closing = True
        with self.lock:
            self.down = SHUTTING_DOWN
            with contextlib.suppress(OSError, AttributeError):  # already gone, or never started
                self.conn.send(("stop",))
        self.fail_in_flight(SHUTTING_DOWN)
        if self.process is None:
            return
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_SECONDS)


class LocalEngine:
    """The models in the server process, each decoding on its own thread: what ``create_app``
    serves when handed loaded ServedModels (the tests), and ``tinylm serve --engine thread``."""

    down: str | None = None  # None until it closes: a stopped decoding thread shows on /health by itself
    retry_after = 1
    on_give_up = None  # it never restarts anything, so never gives up

    def __init__(self):
        self.models: list[ServedModel] = []  # what it loaded, closed with it

    def start(self, specs: dict[str, ModelSpec]) -> dict[str, ServedModel]:
        models = {name: ServedModel.load(spec, name) for name, spec in specs.items()}
        self.models += models.values()
        return models

    async def load(self, spec: ModelSpec, name: str) -> ServedModel:
        served = await asyncio.to_thread(ServedModel.load, spec, name)
        self.models.append(served)
        return served

    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    def close(self) -> None:
        """Close every model it loaded: their rows in flight are answered 503."""
        self.down = SHUTTING_DOWN
        for served in self.models:
            served.scheduler.close()


def start_engine(specs: ModelSpecs) -> tuple[ProcessEngine | LocalEngine, dict[str, ServedModel]]:
    """The engine ``specs.engine`` names, started, and the models it serves."""
    engine = ProcessEngine(specs.threads) if specs.engine == "process" else LocalEngine()
    return engine, engine.start(specs)
