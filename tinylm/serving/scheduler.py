"""One decoding thread per model that steps the decoding core (``generation.batch.Batch``) over
every request in flight (continuous batching).

Each row of the batch is one choice of one request; between two steps new rows join and finished
or abandoned rows leave, and each row gets what ``tinylm generate`` gives it alone (the batch's
docstring says how). Compiled (``compile=True``, ``tinylm serve --compile``): the cache's shapes
come from the batch's buckets, and for a short context (one slot bucket) every batch bucket is
compiled when the scheduler starts, so no request waits for a compile later.

Other model work (beam search, scoring, attention maps) runs on the same thread between steps
(``call``), so one model is never used by two threads at once.

``after_pass`` (set by the engine process, ``engine.py``) runs on the decoding thread after every
pass of the loop: the events a step emitted leave for the server process together, in one message.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable

import torch

from tinylm.generation.batch import Batch, ErrorEvent, Row, batch_buckets
from tinylm.generation.core import cache_slots
from tinylm.generation.decode import decode_step

log = logging.getLogger(__name__)
SHORT_CONTEXT = 256  # contexts up to this are served from one cache size (the whole context)


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
        if compile and one_shape:
            self._compile_buckets()
        elif not compile and hasattr(model, "warm_blocked_products"):
            model.warm_blocked_products(2 * max_batch)  # a step's rows, and as many prompt tokens joining
        self._thread = threading.Thread(target=self._loop, name=f"tinylm-decode-{name}", daemon=True)
        self._thread.start()

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

    def cancel(self, row: Row) -> None:
        """The row leaves the batch at the next step (its client has gone, or has all it wants)."""
        row.cancel()

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the decoding thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((lambda: fn(*args), future))
        return future

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def active(self) -> int:
        return self._active

    def close(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        waiting: list[Row] = []
        batch = self.batch
        while not self._stop.is_set():
            for item in self._drain(block=not batch.rows and not waiting):
                if isinstance(item, Row):
                    waiting.append(item)
                elif isinstance(item, tuple):
                    self._run_task(*item)
            room = self.max_batch - len(batch.rows)
            joining, waiting = waiting[:room], waiting[room:]
            joining = [r for r in joining if not r.cancelled.is_set()]
            batch.leave([r for r in batch.rows if r.cancelled.is_set()])
            if batch.rows or joining:
                try:
                    self._step(joining)
                except Exception as exc:  # a bug or a broken model must not take the server down
                    log.exception("decoding step failed")
                    for r in batch.rows + joining:
                        r.emit(ErrorEvent(f"generation failed: {type(exc).__name__}: {exc}"))
                    batch.clear()
            self._active = len(batch.rows)
            if self.after_pass is not None:
                self.after_pass()

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

    def _run_task(self, fn, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                future.set_result(fn())
        except BaseException as exc:  # handed to the waiting request
            future.set_exception(exc)
