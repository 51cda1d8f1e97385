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

Other model work (beam search, scoring, attention maps) runs on the same thread between steps
(``submit``), so one model is never used by two threads at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
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


class Scheduler:
    """``add(row)`` from any thread; tokens come back through ``row.emit`` on the decoding thread."""

    def __init__(self, model, max_batch: int = 32, name: str = "model"):
        self.model, self.max_batch = model, max_batch
        self.context_length = model.config.context_length
        self.inbox: queue.Queue = queue.Queue()
        self.rows: list[Row] = []  # in the order of the cache's batch dimension
        self.cache: KVCache | None = None
        self.pending: torch.Tensor | None = None  # (B,) each row's last token, not yet in the cache
        self.prepared = None  # the model's decoding weights, checked again whenever rows join
        self.steps = 0  # decoding steps run (for tests and the health endpoint)
        self.max_rows_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tinylm-decode-{name}", daemon=True)
        self._thread.start()

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
        return len(self.rows)

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
        fresh = [(r, list(r.prompt_ids)) for r in started] + [(r, r.seq[-(self.context_length // 2):]) for r in sliding]

        logits_old = None
        if self.rows:
            if self.cache.length >= self.cache.max_len:
                self._compact()
            if self.cache.length >= self.cache.max_len:
                self._resize(self.context_length)
            positions = torch.tensor([r.cached for r in self.rows], dtype=torch.long)
            logits_old = decode_step(self.prepared, self.cache, self.pending, positions)
            for r in self.rows:
                r.cached += 1
        if fresh:
            self.prepared = prepare_for_inference(self.model)
            rows = [ids for _, ids in fresh]
            cache, logits_new, _ = prefill(self.model, rows, max(len(ids) for ids in rows))
            for (r, ids) in fresh:
                r.cached = len(ids)
            self._merge([r for r, _ in fresh], cache)
            logits = logits_new if logits_old is None else torch.cat([logits_old, logits_new])
        else:
            logits = logits_old
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, len(self.rows))
        self._select(logits)

    def _start(self, r: Row) -> None:
        cfg = r.cfg
        r.seq, r.out, r.started = list(r.prompt_ids), [], time.perf_counter()
        r.generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None and not cfg.greedy else None
        history = HistoryProcessor(cfg, [r.prompt_ids], self.model.config.vocab_size, torch.device("cpu"))
        r.history = history if history.active else None

    def _select(self, logits: torch.Tensor) -> None:
        """Each row's next token from its logits row, with its own knobs and generator. Rows whose
        knobs shape the distribution alike go through ``select_next`` together (row-wise ops: the
        same numbers as one at a time); each draws from its own generator."""
        scores = logits
        for i, r in enumerate(self.rows):
            if r.history is None:
                continue
            row = r.history(logits[i : i + 1].float(), len(r.out))
            if not bool(torch.isfinite(row).any()):
                r.emit(ErrorEvent(f"no token is allowed at step {len(r.out) + 1}: no_repeat_ngram_size / "
                                  "min_new_tokens ban the whole vocabulary "
                                  "(ask for fewer tokens or a smaller n-gram ban)", "no_repeat_ngram_size"))
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
            generators = None if cfg.greedy else [self.rows[i].generator for i in members]
            index = torch.tensor(members)
            tokens[index] = select_next(scores.index_select(0, index), cfg, generators)
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
        keep = [i for i, r in enumerate(self.rows) if r not in leaving]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.pending = None, None
            return
        index = torch.tensor(keep, dtype=torch.long)
        self.cache.reorder(index)
        self.pending = self.pending.index_select(0, index)
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
        cache = self.model.new_kv_cache(len(self.rows), size)
        for dst, src in ((cache.k, old.k), (cache.v, old.v)):
            for d, s in zip(dst, src):
                d[:, :, :n] = s[:, :, :n]
        cache.length = n
        cache.key_mask = torch.ones(len(self.rows), size, dtype=torch.bool)
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
        size = min(self.context_length, length + remaining)
        cache = self.model.new_kv_cache(total, size)
        cache.length = length
        cache.key_mask = torch.ones(total, size, dtype=torch.bool)
        offset = 0
        for part, n_rows in ((old, len(self.rows)), (new, len(rows))):
            if part is None or n_rows == 0:
                continue
            start = length - part.length  # left padding added to this part
            for dst, src in ((cache.k, part.k), (cache.v, part.v)):
                for d, s in zip(dst, src):
                    d[offset : offset + n_rows, :, start:length] = s[:, :, : part.length]
            cache.key_mask[offset : offset + n_rows, :start] = False
            if part.key_mask is not None:
                cache.key_mask[offset : offset + n_rows, start:length] = part.key_mask[:, : part.length]
            offset += n_rows
        self.cache = cache
        self.rows = self.rows + rows  # ``_select`` sets every row's pending token next
