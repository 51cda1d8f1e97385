"""One decoding thread per model that batches every request in flight (continuous batching).

Each row of the batch is one choice of one request. Between two decoding steps, new rows join
(their prompts are prefilled together, left-padded, by ``generation.core.prefill``, and their keys
and values are copied into the batch's cache, right-aligned with the rows already there) and
finished or abandoned rows leave. A row's output is what ``tinylm generate`` gives it alone:

- the cache of each row holds exactly the tokens it holds alone (its padding slots are masked
  out and its positions are its own), so each row's logits are its logits alone;
- each row keeps its own ``GenerationConfig``, history rules (repetition penalty, n-gram ban)
  and ``torch.Generator``, and picks its token with ``select_next`` as ``TokenStream`` does;
- a row that reaches the context slides exactly as ``TokenStream`` does: its last
  ``context_length // 2`` tokens are prefilled again (positions restart at 0).

Batched matrix products may round differently from a single row's in the last bits; the tests
check that the tokens are the same, alone and under concurrency.

Compiled (``compile=True``, ``tinylm serve --compile``): the step runs under ``torch.compile``,
which specialises on shapes, so the cache's shapes come from a few buckets and stay put as rows
join and leave: its batch dimension holds a power of two of rows (1, 2, 4, ..., ``max_batch``;
the rows beyond the real ones are padding whose logits are dropped) and its slots are the
model's context when that is short (one bucket), else a power of two times 64. Rows joining a
batch of the same bucket are written into the cache in place. Every batch bucket of a short
context is compiled when the scheduler starts (each compile time printed), longer contexts
compile each bucket on first use. ``bucketed=True`` without ``compile`` gives the same shapes
eagerly (the tests check the bucket bookkeeping that way, fast).

Other model work (beam search, scoring, attention maps) runs on the same thread between steps
(``submit``), so one model is never used by two threads at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinylm.config import GenerationConfig
from tinylm.generation.core import prefill
from tinylm.generation.decode import decode_step, prepare_for_inference
from tinylm.generation.generate import hits_stop_string
from tinylm.generation.processors import HistoryProcessor
from tinylm.generation.sampling import select_next
from tinylm.models.gpt import KVCache

log = logging.getLogger("tinylm")


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None  # log p of the token under the model (before any decoding knob)
    top: list[tuple[int, float]] | None = None  # the ``Row.logprobs`` most likely (id, log p)


@dataclass
class DoneEvent:
    finish_reason: str  # "stop_token" | "stop_string" | "length"
    tokens: list[int]
    seconds: float  # from the row's first step to its last
    stop_token: int | None = None  # the stop id that ended the row (not in ``tokens``)


@dataclass
class ErrorEvent:
    message: str
    param: str | None = None  # set when the request's knobs caused it (a client error, not the server's)


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """One sequence to continue: what a request asks for one of its choices."""

    prompt_ids: list[int]  # already fitted to the context (``fit_prompts``)
    cfg: GenerationConfig  # ``cfg.seed`` seeds this row's generator
    emit: Callable[[object], None]  # receives TokenEvent / DoneEvent / ErrorEvent, on the decoding thread
    decode: Callable[[list[int]], str] | None = None  # for stop strings
    logprobs: int | None = None  # report the top-N alternatives of each token (None: no log probs)
    cancelled: threading.Event = field(default_factory=threading.Event)

    # decoding state, owned by the scheduler's thread
    seq: list[int] = field(default_factory=list)  # prompt + accepted tokens (the sliding window's source)
    out: list[int] = field(default_factory=list)
    cached: int = 0  # this row's real tokens in the cache (its next position)
    generator: torch.Generator | None = None
    history: HistoryProcessor | None = None
    started: float = 0.0

    def cancel(self) -> None:
        self.cancelled.set()


SHORT_CONTEXT = 256  # up to this context a compiled cache always has the context's slots: one bucket
SLOT_BUCKET = 64  # longer contexts: 64, 128, 256, ... slots


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes of a bucketed cache: powers of two, and ``max_batch`` itself."""
    return sorted({min(2**k, max_batch) for k in range(max_batch.bit_length() + 1)})


def slot_bucket(needed: int, context_length: int) -> int:
    """Cache slots of a bucketed cache that must hold ``needed`` slots."""
    if context_length <= SHORT_CONTEXT:
        return context_length
    slots = SLOT_BUCKET
    while slots < needed:
        slots *= 2
    return min(context_length, slots)


class Scheduler:
    """``add(row)`` from any thread; tokens come back through ``row.emit`` on the decoding thread."""

    def __init__(
        self, model, max_batch: int = 32, name: str = "model", compile: bool = False, bucketed: bool | None = None
    ):
        self.model, self.max_batch = model, max_batch
        self.context_length = model.config.context_length
        self.compile = compile
        self.bucketed = compile if bucketed is None else bucketed
        self.inbox: queue.Queue = queue.Queue()
        self.rows: list[Row] = []  # in the order of the cache's batch dimension
        self.cache: KVCache | None = None
        self.pending: torch.Tensor | None = None  # (B,) each row's last token, not yet in the cache
        self.prepared = None  # the model's decoding weights, checked again whenever rows join
        self.steps = 0  # decoding steps run (for tests and the health endpoint)
        self.max_rows_seen = 0
        self._active = 0  # rows decoding, published between steps (mid-step, sliding rows are briefly out)
        self._stop = threading.Event()
        self.compile_seconds: dict[tuple[int, int], float] = {}  # (rows, slots) -> seconds, compiled at start
        if compile and self.context_length <= SHORT_CONTEXT:
            self._compile_buckets()
        self._thread = threading.Thread(target=self._loop, name=f"tinylm-decode-{name}", daemon=True)
        self._thread.start()

    def _compile_buckets(self) -> None:
        """Compile the step for every batch bucket now: no request waits for a compile later."""
        started = time.perf_counter()
        prepared = prepare_for_inference(self.model)
        slots = slot_bucket(self.context_length, self.context_length)
        with torch.inference_mode():
            for rows in batch_buckets(self.max_batch):
                cache = self.model.new_kv_cache(rows, slots)
                cache.key_mask = torch.ones(rows, slots, dtype=torch.bool)
                t0 = time.perf_counter()
                # tokens and positions as distinct tensors, as in serving (the compiled code guards on aliasing)
                tokens, positions = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
                decode_step(prepared, cache, tokens, positions, compile=True)
                self.compile_seconds[rows, slots] = time.perf_counter() - t0
        print(
            f"compiled the decoding step for {len(self.compile_seconds)} batch buckets "
            f"({', '.join(str(b) for b, _ in self.compile_seconds)} rows x {slots} cache slots) in "
            f"{time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )

    def _capacity(self, rows: int) -> int:
        """The cache's batch size for ``rows`` rows (bucketed: a batch bucket, the rest padding)."""
        return next(b for b in batch_buckets(self.max_batch) if b >= rows) if self.bucketed else rows

    def _slots(self, needed: int) -> int:
        needed = min(needed, self.context_length)
        return slot_bucket(needed, self.context_length) if self.bucketed else needed

    # ------------------------------------------------------------------------ public interface
    def add(self, row: Row) -> None:
        self.inbox.put(row)

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn()`` on the decoding thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((fn, future))
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
        while not self._stop.is_set():
            for item in self._drain(block=not self.rows and not waiting):
                if isinstance(item, Row):
                    waiting.append(item)
                elif isinstance(item, tuple):
                    self._run_task(*item)
            room = self.max_batch - len(self.rows)
            joining, waiting = waiting[:room], waiting[room:]
            joining = [r for r in joining if not r.cancelled.is_set()]
            self._leave([r for r in self.rows if r.cancelled.is_set()])
            if self.rows or joining:
                try:
                    self._step(joining)
                except Exception as exc:  # a bug or a broken model must not take the server down
                    log.exception("decoding step failed")
                    for r in self.rows + joining:
                        r.emit(ErrorEvent(f"generation failed: {type(exc).__name__}: {exc}"))
                    self.rows, self.cache, self.pending = [], None, None
            self._active = len(self.rows)

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

    # ------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def _step(self, joining: list[Row]) -> None:
        # rows whose cache reached the context slide like TokenStream: re-prefill the last context_length // 2
        sliding = [r for r in self.rows if r.cached >= self.context_length]
        self._leave(sliding)
        started = []
        for r in joining:
            try:
                self._start(r)
                started.append(r)
            except (ValueError, RuntimeError) as exc:  # e.g. a seed torch cannot take: this row only
                r.emit(ErrorEvent(f"cannot start this generation: {exc}", "seed"))
        fresh = [(r, list(r.prompt_ids)) for r in started] + [
            (r, r.seq[-(self.context_length // 2) :]) for r in sliding
        ]

        logits_old = None
        if self.rows:
            if self.cache.length >= self.cache.max_len:
                self._compact()
            if self.cache.length >= self.cache.max_len:
                self._resize(self.context_length)
            logits_old = self._decode()
        if fresh:
            self.prepared = prepare_for_inference(self.model)
            rows = [ids for _, ids in fresh]
            cache, logits_new, _ = prefill(self.model, rows, max(len(ids) for ids in rows))
            for r, ids in fresh:
                r.cached = len(ids)
            self._merge([r for r, _ in fresh], cache)
            logits = logits_new if logits_old is None else torch.cat([logits_old, logits_new])
        else:
            logits = logits_old
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, len(self.rows))
        self._active = len(self.rows)  # before the first tokens go out: a client that sees one sees its row
        self._select(logits)

    def _decode(self) -> torch.Tensor:
        """One token for every row (padding rows: token 0 at position 0, their logits dropped)."""
        n, padding = len(self.rows), self.cache.batch_size - len(self.rows)
        positions = torch.tensor([r.cached for r in self.rows] + [0] * padding, dtype=torch.long)
        tokens = torch.cat([self.pending, self.pending.new_zeros(padding)]) if padding else self.pending
        logits = decode_step(self.prepared, self.cache, tokens, positions, self.compile)
        for r in self.rows:
            r.cached += 1
        return logits[:n] if padding else logits

    def _start(self, r: Row) -> None:
        cfg = r.cfg
        r.seq, r.out, r.started = list(r.prompt_ids), [], time.perf_counter()
        r.generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None and not cfg.greedy else None
        history = HistoryProcessor(cfg, [r.prompt_ids], self.model.config.vocab_size, torch.device("cpu"))
        r.history = history if history.active else None

    def _select(self, logits: torch.Tensor) -> None:
        """Each row's next token from its logits row, with its own knobs and generator. Rows whose
        knobs shape the distribution alike are shaped together (row-wise ops: the same numbers as
        one at a time); each sampled row draws from its own generator (``select_next``'s batched per-row draw)."""
        scores = logits
        for i, r in enumerate(self.rows):
            if r.history is None:
                continue
            row = r.history(logits[i : i + 1].float(), len(r.out))
            if not bool(torch.isfinite(row).any()):
                r.emit(
                    ErrorEvent(
                        f"no token is allowed at step {len(r.out) + 1}: no_repeat_ngram_size / "
                        "min_new_tokens ban the whole vocabulary "
                        "(ask for fewer tokens or a smaller n-gram ban)",
                        "no_repeat_ngram_size",
                    )
                )
                r.cancel()
                row = logits[i : i + 1].float()  # any token: the row leaves at the end of this step
            if scores is logits:
                scores = logits.float().clone()
            scores[i] = row[0]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.rows):
            c = r.cfg
            groups.setdefault((c.greedy, c.temperature, c.top_k, c.top_p, c.min_p), []).append(i)
        tokens = torch.empty(len(self.rows), dtype=torch.long)
        for members in groups.values():
            cfg = self.rows[members[0]].cfg
            group = scores if len(members) == len(self.rows) else scores.index_select(0, torch.tensor(members))
            picked = select_next(group, cfg, None if cfg.greedy else [self.rows[i].generator for i in members])
            if len(members) == len(self.rows):
                tokens = picked
            else:
                tokens[torch.tensor(members)] = picked
        token_list = tokens.tolist()
        for i, r in enumerate(self.rows):
            if r.cancelled.is_set():
                continue
            if r.history is not None:
                r.history.observe(tokens[i : i + 1], [token_list[i]])
            self._accept(r, token_list[i], logits[i : i + 1])
        self.pending = tokens
        self._leave([r for r in self.rows if r.cancelled.is_set()])

    def _accept(self, r: Row, t: int, row_logits: torch.Tensor) -> None:
        cfg = r.cfg
        if t in cfg.stop_ids:
            return self._finish(r, "stop_token", t)
        r.out.append(t)
        r.seq.append(t)
        event = TokenEvent(t)
        if r.logprobs is not None:
            logp = torch.log_softmax(row_logits[0].float(), dim=-1)
            event.logprob = float(logp[t])
            if r.logprobs > 0:
                values, ids = logp.topk(min(r.logprobs, logp.numel()))
                event.top = list(zip(ids.tolist(), values.tolist()))
        r.emit(event)
        if cfg.stop_strings and r.decode is not None and hits_stop_string(r.decode, r.out, cfg.stop_strings):
            return self._finish(r, "stop_string")
        if len(r.out) >= cfg.max_new_tokens:
            self._finish(r, "length")

    def _finish(self, r: Row, reason: str, stop_token: int | None = None) -> None:
        r.emit(DoneEvent(reason, list(r.out), time.perf_counter() - r.started, stop_token))
        r.cancel()  # leaves the batch at the end of this step

    # ----------------------------------------------------------------------------- the cache
    def _leave(self, leaving: list[Row]) -> None:
        if not leaving:
            return
        gone = {id(r) for r in leaving}
        kept = [id(r) not in gone for r in self.rows]
        n = sum(kept)
        if not n:
            self.rows, self.cache, self.pending = [], None, None
            return
        # the rows beyond the first n that stay fill the places of those that leave: only they are
        # copied (in place), and the kept rows are the first n of the cache
        tail = [i for i in range(n, len(self.rows)) if kept[i]]
        order = [i if kept[i] else tail.pop() for i in range(n)]
        rest = sorted(set(range(self.cache.batch_size)) - set(order))
        self.rows = [self.rows[i] for i in order]
        self.pending = self.pending.index_select(0, torch.tensor(order, dtype=torch.long))
        cache = self.cache
        cache.reorder(torch.tensor(order + rest, dtype=torch.long))
        capacity = self._capacity(n)
        if capacity < cache.batch_size:  # the first rows of a contiguous tensor: views, no copy
            cache.k, cache.v = [t[:capacity] for t in cache.k], [t[:capacity] for t in cache.v]
            cache.key_mask = cache.key_mask[:capacity]
        cache.key_mask[n:] = True  # padding attends to anything: finite logits, dropped
        if not self.bucketed:  # fewer slots for the next merge; a bucketed cache compacts when full
            self._compact()

    def _compact(self) -> None:
        """Drop the leading slots no row uses any more (every row's tokens are the last slots)."""
        cache = self.cache
        shift = cache.length - max(r.cached for r in self.rows)
        if shift <= 0:
            return
        n = cache.length - shift
        for tensors in (cache.k, cache.v):
            for t in tensors:
                t[:, :, :n] = t[:, :, shift : cache.length].clone()
        cache.key_mask[:, :n] = cache.key_mask[:, shift : cache.length].clone()
        cache.key_mask[:, n:] = True
        cache.length = n

    def _resize(self, size: int) -> None:
        """Move the cache into ``size`` slots (the filled ones keep their places)."""
        old, n = self.cache, self.cache.length
        cache = self.model.new_kv_cache(old.batch_size, size)
        for dst, src in ((cache.k, old.k), (cache.v, old.v)):
            for d, s in zip(dst, src):
                d[:, :, :n] = s[:, :, :n]
        cache.length = n
        cache.key_mask = torch.ones(old.batch_size, size, dtype=torch.bool)
        cache.key_mask[:, :n] = old.key_mask[:, :n]
        self.cache = cache

    def _merge(self, rows: list[Row], new: KVCache) -> None:
        """Append the freshly prefilled rows to the batch, every row's tokens right-aligned."""
        old = self.cache
        length = max(new.length, old.length if old is not None else 0)
        total = len(self.rows) + len(rows)
        # slots for what the rows may still generate, not always the whole context: a batch of 32
        # rows of a 1,024-token model would hold gigabytes of cache it mostly never fills
        remaining = max(r.cfg.max_new_tokens - len(r.out) for r in self.rows + rows)
        size, capacity = self._slots(length + remaining), self._capacity(total)
        if old is not None and old.batch_size == capacity and old.max_len == size and old.length >= new.length:
            self._write_rows(old, len(self.rows), new)  # the same bucket: no new cache
        else:
            cache = self.model.new_kv_cache(capacity, size)
            cache.length = length
            cache.key_mask = torch.ones(capacity, size, dtype=torch.bool)
            if old is not None and self.rows:
                self._write_rows(cache, 0, old, len(self.rows))
            self._write_rows(cache, len(self.rows), new)
            self.cache = cache
        self.rows = self.rows + rows  # ``_select`` sets every row's pending token next

    @staticmethod
    def _write_rows(cache: KVCache, offset: int, part: KVCache, n_rows: int | None = None) -> None:
        """Copy the first ``n_rows`` rows of ``part`` (default: all) into ``cache`` from row
        ``offset``, their filled slots right-aligned with ``cache.length``, the slots before masked."""
        n_rows = part.batch_size if n_rows is None else n_rows
        rows, start = slice(offset, offset + n_rows), cache.length - part.length  # left padding added to this part
        for dst, src in ((cache.k, part.k), (cache.v, part.v)):
            for d, s in zip(dst, src):
                d[rows, :, start : cache.length] = s[:n_rows, :, : part.length]
        cache.key_mask[rows, :start] = False
        cache.key_mask[rows, start:] = True
        if part.key_mask is not None:
            cache.key_mask[rows, start : cache.length] = part.key_mask[:n_rows, : part.length]
