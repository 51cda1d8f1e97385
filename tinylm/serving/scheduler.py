"""One decoding thread per model that steps the decoding core (``generation.batch.Batch``) over
every request in flight (continuous batching).

Each row of the batch is one choice of one request; between two steps new rows join and finished
or abandoned rows leave, and each row gets what ``tinylm generate`` gives it alone (the batch's
docstring says how). Compiled (``compile=True``, ``tinylm serve --compile``): the cache's shapes
come from the batch's buckets, and for a short context (one slot bucket) every batch bucket is
compiled when the scheduler starts, so no request waits for a compile later.

Other model work (beam search, scoring, attention maps: ``call``) runs on a task thread of its
own, taking turns with the decoding thread (``Turns``): while rows decode, a task pauses at each
transformer block's boundary for the next decoding step, so one client scoring a long text costs
the streams at most a block of its forward per token, and the model is never used by two threads
at once. A beam search pauses so during its prefill only: its own decoding steps call the blocks'
``forward`` past the hook, and run to its end while the streams wait. A compiled step
(``--compile``) keeps the blocks unhooked (a hook would make torch.compile trace it): there a task
runs whole between two steps.

``after_pass`` (set by the engine process, ``engine.py``) runs on the decoding thread after every
pass of the loop: the events a step emitted leave for the server process together, in one message.

The loop cannot die silently. Every pass (rows leaving, joining and stepping, the tasks) runs under
one ``torch.inference_mode()``: the cache's tensors are inference tensors, and an in-place copy of
one outside that mode raises. A pass that raises fails the rows of the batch with an error event,
drops the cache and goes on with the next requests. Anything the loop cannot go on from (an
exception escaping a pass) ends the thread: every row it holds or that comes later is told so
(``DecodingStopped``), ``failure`` says why (``/health`` shows it) and ``on_failure`` is called.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from tinylm.generation.batch import Batch, ErrorEvent, Row, batch_buckets
from tinylm.generation.core import cache_slots
from tinylm.generation.decode import decode_step

log = logging.getLogger(__name__)
SHORT_CONTEXT = 256  # contexts up to this are served from one cache size (the whole context)


@dataclass
class DecodingStopped(ErrorEvent):
    """The decoding thread or the engine holding a row stopped: the request is answered 503 (the
    server's state, not the request's fault), and sent again it may succeed."""


class Turns:
    """The decoding thread and the task thread take turns on the model, strictly alternating while
    both have work: the decoding thread waits (``decoding``) until the running task reaches a
    block boundary (``pause``), steps, and the task goes on to its next boundary at least."""

    def __init__(self):
        self.cond = threading.Condition()
        self.task_running = self.task_paused = self.decoder_waiting = False

    @contextlib.contextmanager
    def decoding(self):
        with self.cond:
            self.decoder_waiting = True
            self.cond.wait_for(lambda: not self.task_running or self.task_paused)
            self.decoder_waiting = False
        try:
            yield
        finally:
            with self.cond:
                self.task_paused = False  # the task's turn: the next step waits for its next boundary
                self.cond.notify_all()

    def pause(self) -> None:
        """On the task thread between two blocks: the decoding thread's turn if it waits for one."""
        if not self.decoder_waiting:  # read without the lock: a miss waits for the next boundary
            return
        with self.cond:
            self.task_paused = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.task_paused)

    @contextlib.contextmanager
    def task(self):
        with self.cond:
            self.task_running = True
        try:
            yield
        finally:
            with self.cond:
                self.task_running = self.task_paused = False
                self.cond.notify_all()


class Scheduler:
    """``add(row)`` from any thread; tokens come back through ``row.emit`` on the decoding thread."""

    def __init__(
        self, model, max_batch: int = 32, name: str = "model", compile: bool = False, bucketed: bool | None = None
    ):
        self.model, self.max_batch = model, max_batch
        context = model.config.context_length
        bucketed = compile if bucketed is None else bucketed
        # a short context is one slot bucket: every batch bucket compiles at start, none later
        one_shape = bucketed and context <= SHORT_CONTEXT
        self.batch = Batch(model, max_batch, compile, bucketed, min_slots=context if one_shape else 0)
        self.inbox: queue.Queue = queue.Queue()
        self.max_rows_seen = 0
        self._active = 0  # rows decoding, published between steps (mid-step, sliding rows are briefly out)
        self._stop = threading.Event()
        self.compile_seconds: dict[tuple[int, int], float] = {}  # (rows, slots) -> seconds, compiled at start
        self.after_pass: Callable[[], None] | None = None
        self.failure: str | None = None  # why the decoding thread stopped (None: it runs, or was closed)
        self.on_failure: Callable[[str], None] | None = None  # called on the decoding thread as it stops
        self.turns, self.tasks = Turns(), queue.Queue()
        self._joining: list[Row] = []  # the rows joining the pass in progress
        self._task_ident: int | None = None
        self._task_thread = threading.Thread(target=self._run_tasks, name=f"tinylm-task-{name}", daemon=True)
        blocks = [] if compile else getattr(model, "blocks", [])
        self._hooks = [b.register_forward_pre_hook(self._between_blocks) for b in blocks]
        if compile and one_shape:
            self._compile_buckets()
        elif not compile and hasattr(model, "warm_blocked_products"):
            model.warm_blocked_products(2 * max_batch)  # a step's rows, and as many prompt tokens joining
        self._thread = threading.Thread(target=self._loop, name=f"tinylm-decode-{name}", daemon=True)
        self._thread.start()
        self._task_thread.start()

    def _compile_buckets(self) -> None:
        """Compile the step for every batch bucket now: no request waits for a compile later."""
        started = time.perf_counter()
        self.model.prepare_for_decoding()
        context = self.model.config.context_length
        slots = cache_slots(context, context, bucketed=True)
        with torch.inference_mode():
            for rows in batch_buckets(self.max_batch):
                cache = self.model.new_kv_cache(rows, slots)
                cache.key_mask = torch.ones(rows, slots, dtype=torch.bool)
                t0 = time.perf_counter()
                # tokens and positions as distinct tensors, as in serving (the compiled code guards on aliasing)
                tokens, positions = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
                decode_step(self.model, cache, tokens, positions, compile=True)
                self.compile_seconds[rows, slots] = time.perf_counter() - t0
        log.info(
            "compiled the decoding step for %d batch buckets (%s rows x %d cache slots) in %.1f s",
            len(self.compile_seconds),
            ", ".join(str(b) for b, _ in self.compile_seconds),
            slots,
            time.perf_counter() - started,
        )

    @property
    def rows(self) -> list[Row]:
        return self.batch.rows

    @property
    def cache(self):
        return self.batch.cache

    @property
    def steps(self) -> int:
        return self.batch.steps

    # ------------------------------------------------------------------------ public interface
    def add(self, row: Row) -> None:
        self.inbox.put(row)
        if self.failure is not None:  # the thread has stopped: nothing will take the row but us
            self._fail_inbox()

    def cancel(self, row: Row) -> None:
        """The row leaves the batch at the next step (its client has gone, or has all it wants)."""
        row.cancel()

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the task thread, taking turns with the decoding steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((lambda: fn(*args), future))
        return future

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    @property
    def active(self) -> int:
        return self._active

    def close(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self.tasks.put(None)
        self._thread.join(timeout=5)
        for hook in self._hooks:
            hook.remove()

    # ------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        waiting: list[Row] = []  # rows taken from the inbox, not in the batch yet
        try:
            with torch.inference_mode():  # every tensor operation of the loop: see the module's docstring
                while not self._stop.is_set():
                    self._pass(waiting)
        except BaseException as exc:  # the loop cannot go on: said, never silent
            self._stopped(exc, waiting)
            return
        self._fail(self.batch.rows + waiting, "the model was closed while this request decoded; send it again")

    def _pass(self, waiting: list[Row]) -> None:
        """Take what came in, let cancelled rows leave, step the batch with the rows that fit."""
        batch = self.batch
        for item in self._drain(block=not batch.rows and not waiting):
            if isinstance(item, Row):
                waiting.append(item)
            elif isinstance(item, tuple):
                self.tasks.put(item)
        room = self.max_batch - len(batch.rows)
        joining = self._joining = [r for r in waiting[:room] if not r.cancelled.is_set()]
        del waiting[:room]
        try:
            if batch.rows or joining:
                with self.turns.decoding():
                    batch.leave([r for r in batch.rows if r.cancelled.is_set()])
                    if batch.rows or joining:
                        self._step(joining)
        except Exception as exc:  # a bug or a broken model must not take the server down
            log.exception("decoding step failed")
            self._fail(batch.rows + joining, f"generation failed: {type(exc).__name__}: {exc}", ErrorEvent)
            batch.clear()
        self._active = len(batch.rows)
        if self.after_pass is not None:
            self.after_pass()

    def _stopped(self, exc: BaseException, waiting: list[Row]) -> None:
        """The decoding thread ends on ``exc``: its rows, and those still to come, are told why."""
        self.failure = f"the decoding thread stopped: {type(exc).__name__}: {exc}"
        trace = traceback.format_exc()
        log.error("%s\n%s", self.failure, trace)
        held = {id(r): r for r in self.batch.rows + self._joining + waiting}  # a joining row may be both
        self._fail(list(held.values()), f"{self.failure}; send the request again")
        self.batch.rows = []
        self._active = 0
        self._fail_inbox()
        if self.on_failure is not None:
            self.on_failure(f"{self.failure}\n{trace}")

    @staticmethod
    def _fail(rows: list[Row], message: str, event=DecodingStopped) -> None:
        for r in rows:
            if not r.cancelled.is_set():
                r.emit(event(message))

    def _fail_inbox(self) -> None:
        """Everything waiting in the inbox of a stopped thread: rows get an error, tasks the exception."""
        gone = RuntimeError(self.failure)
        for item in self._drain(block=False):
            if isinstance(item, Row):
                self._fail([item], f"{self.failure}; send the request again")
            elif isinstance(item, tuple) and item[1].set_running_or_notify_cancel():
                item[1].set_exception(gone)

    def _step(self, joining: list[Row]) -> None:
        def published(rows: list[Row]) -> None:  # before the first tokens go out: a client that sees one sees its row
            self.max_rows_seen = max(self.max_rows_seen, len(rows))
            self._active = len(rows)

        self.batch.step(joining, before_select=published)

    def _drain(self, block: bool) -> list:
        items = []
        try:
            items.append(self.inbox.get(block=block))
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _run_tasks(self) -> None:
        """The task thread: one task at a time, in the order they came, taking turns with the steps."""
        self._task_ident = threading.get_ident()
        with torch.inference_mode():
            for item in iter(self.tasks.get, None):
                with self.turns.task():
                    self._run_task(*item)

    def _between_blocks(self, module, args) -> None:
        """A forward pre-hook on each block: on the task thread, the decoding thread's turn."""
        self.give_turn()

    def give_turn(self) -> None:
        """On the task thread, the decoding thread's turn if it waits for one (a beam search calls
        this between its steps, which run the blocks without their hooks); elsewhere nothing."""
        if threading.get_ident() == self._task_ident:
            self.turns.pause()

    def _run_task(self, fn, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the waiting request
            future.set_exception(exc)
