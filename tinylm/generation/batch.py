"""The decoding core: rows decoding together, one step at a time (continuous batching).

``Batch`` holds rows (each one sequence to continue, with its own ``GenerationConfig``, history
rules and generator), their KV cache, and the step loop every decoder drives: ``TokenStream``
(``tinylm generate``) steps it until its rows are done, the server's scheduler steps it on its
own thread while rows join and leave, beam search uses its prefill, window and step.

A step: rows whose cache reached the context slide (their last ``context_length // 2`` tokens,
``window``, are prefilled again, positions restarting at 0); rows already in the batch feed
their last token through ``decode_step``; rows joining are prefilled together (left-padded)
and their keys and values copied into the batch's cache, right-aligned with the rows there;
then each row's next token is chosen with its own knobs and checked against its stop rules.
A row's output is what it gets alone: its cache holds exactly its own tokens (its padding slots
are masked out and its positions are its own). Batched products may round differently from a
single row's in the last bits; the tests check that the tokens are the same.

Bucketed caches (``bucketed=True``, what a compiled step wants: ``torch.compile`` specialises
on shapes): the batch dimension holds a power of two of rows (1, 2, 4, ..., ``max_batch``; the
rows beyond the real ones are padding whose logits are dropped) and the slots come from
``core.cache_slots``; rows joining a batch of the same bucket are written in place.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinylm.config import GenerationConfig
from tinylm.generation.core import cache_slots, full_forward, model_device, prefill, window
from tinylm.generation.decode import decode_step
from tinylm.generation.processors import HistoryProcessor
from tinylm.generation.sampling import select_next
from tinylm.models.gpt import KVCache


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


def no_allowed_token(step: int) -> str:
    return (
        f"no token is allowed at step {step + 1}: no_repeat_ngram_size / min_new_tokens ban the whole "
        "vocabulary (ask for fewer new tokens or a smaller n-gram ban)"
    )


def _token_event(t: int, logits: torch.Tensor, logprobs: int | None) -> TokenEvent:
    event = TokenEvent(t)
    if logprobs is not None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        event.logprob = float(logp[t])
        if logprobs > 0:
            values, ids = logp.topk(min(logprobs, logp.numel()))
            event.top = list(zip(ids.tolist(), values.tolist()))
    return event


def hits_stop_string(decode: Callable[[list[int]], str], ids: list[int], stop_strings) -> bool:
    """Whether the text of ``ids`` holds a stop string, checked after each new token: only the end
    can hold a new match, so decoding a generous tail keeps this cheap."""
    tail = decode(ids[-64:])
    return any(s in tail for s in stop_strings)


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """One sequence to continue."""

    prompt_ids: list[int]  # already fitted to the context (``fit_prompts``)
    cfg: GenerationConfig  # ``cfg.seed`` seeds this row's generator unless the batch shares one
    emit: Callable[[object], None]  # receives TokenEvent / DoneEvent / ErrorEvent
    decode: Callable[[list[int]], str] | None = None  # for stop strings
    logprobs: int | None = None  # report the top-N alternatives of each token (None: no log probs)
    token_events: bool = True  # False: tokens are read off ``out`` (no event per token: less work per step)
    cancelled: threading.Event = field(default_factory=threading.Event)

    # decoding state, owned by whoever steps the batch
    seq: list[int] = field(default_factory=list)  # prompt + accepted tokens (the sliding window's source)
    out: list[int] = field(default_factory=list)
    cached: int = 0  # this row's real tokens in the cache (its next position)
    generator: torch.Generator | None = None
    history: HistoryProcessor | None = None
    started: float = 0.0
    finished: bool = False

    def cancel(self) -> None:
        self.cancelled.set()


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes of a bucketed cache: powers of two, and ``max_batch`` itself."""
    return sorted({min(2**k, max_batch) for k in range(max_batch.bit_length() + 1)})


class Batch:
    """Rows decoding together. ``step(joining)`` runs one step for every row and the rows joining.

    shared_generator: one generator all rows draw from in one call (Hugging Face's batched
    draws; rows must then share their knobs), else each row's own seeded generator.
    keep_finished: finished rows keep riding along (their tokens ignored) so that a shared
    generator draws for the same rows at every step; otherwise they leave the batch.
    """

    def __init__(
        self,
        model,
        max_batch: int = 32,
        compile: bool = False,
        bucketed: bool | None = None,
        use_cache: bool = True,
        shared_generator: torch.Generator | None = None,
        keep_finished: bool = False,
        min_slots: int = 0,
    ):
        self.model, self.max_batch, self.compile = model, max_batch, compile
        self.bucketed = compile if bucketed is None else bucketed
        self.use_cache, self.shared_generator, self.keep_finished = use_cache, shared_generator, keep_finished
        self.min_slots = min_slots  # a cache never smaller (a server keeps one shape for a short context)
        self.context_length = model.config.context_length
        self.device = model_device(model)
        self.rows: list[Row] = []  # in the order of the cache's batch dimension
        self.cache: KVCache | None = None
        self.pending: torch.Tensor | None = None  # (B,) each row's last token, not yet in the cache
        self.positions: torch.Tensor | None = None  # (B,) each row's next position, while the rows stay
        self.groups: list[tuple] | None = None  # the rows by knobs (``_knob_groups``), while the rows stay
        self.steps = 0

    def _rows_changed(self) -> None:
        self.positions = self.groups = None

    def clear(self) -> None:
        """Drop every row and the cache (a step failed: its rows were told so)."""
        self.rows, self.cache, self.pending = [], None, None
        self._rows_changed()

    def capacity(self, rows: int) -> int:
        """The cache's batch size for ``rows`` rows (bucketed: a batch bucket, the rest padding)."""
        return next(b for b in batch_buckets(self.max_batch) if b >= rows) if self.bucketed else rows

    # ------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, joining: list[Row] = (), before_select: Callable[[list[Row]], None] | None = None) -> None:
        """One token for every row (and the first for each joining row); events go to ``emit``.
        ``before_select`` sees the rows of this step before any token goes out."""
        logits = self._forward(joining)
        if before_select is not None:
            before_select(self.rows)
        self.select(logits)

    @torch.inference_mode()
    def forward(self, joining: list[Row] = ()) -> torch.Tensor:
        """The next-token logits of every row, in ``rows`` order (B, V), joining rows last: each
        row's pending token goes into the cache, rows at the context slide, joining rows are
        prefilled. Rows that slid move to the end of ``rows``."""
        return self._forward(joining)

    def _forward(self, joining: list[Row]) -> torch.Tensor:
        started = [r for r in joining if self._start(r)]
        self.steps += 1
        if self.use_cache:
            return self._forward_cached(started)
        if started:
            self.rows = self.rows + started
            self._rows_changed()
        return full_forward(self.model, [r.seq[-self.context_length :] for r in self.rows])

    def feed(self, tokens: torch.Tensor) -> None:
        """Make ``tokens`` (B,) the rows' next tokens without choosing them here (beam search)."""
        for r, t in zip(self.rows, tokens.tolist()):
            r.seq.append(t)
            r.out.append(t)
        self.pending = tokens

    def reorder(self, order: list[int], start: int = 0) -> None:
        """Row i becomes old row ``order[i]`` (a row named twice is copied): beam search keeping
        and duplicating its beams. ``start``: the cache slots before it are the same in every
        row that is copied (``KVCache.reorder``)."""
        used, rows = set(), []
        for i in order:
            row = self.rows[i]
            if i in used:
                row = copy.copy(row)
                row.seq, row.out = list(row.seq), list(row.out)
            used.add(i)
            rows.append(row)
        self.rows = rows
        self._rows_changed()
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        if self.cache is not None:
            self.cache.reorder(index, start)
        if self.pending is not None:
            self.pending = self.pending.index_select(0, index)

    def _forward_cached(self, started: list[Row]) -> torch.Tensor:
        sliding = [r for r in self.rows if r.cached >= self.context_length]
        self.leave(sliding)
        fresh = [(r, list(r.prompt_ids)) for r in started] + [(r, window(r.seq, self.context_length)) for r in sliding]
        logits_old = None
        if self.rows:
            if self.cache.length >= self.cache.max_len:
                self._compact()
            if self.cache.length >= self.cache.max_len:
                self._resize(self.context_length)
            logits_old = self._decode()
        if not fresh:
            return logits_old
        self.model.prepare_for_decoding()
        rows = [ids for _, ids in fresh]
        cache, logits_new, _ = prefill(self.model, rows, max(len(ids) for ids in rows))
        for r, ids in fresh:
            r.cached = len(ids)
        self._merge([r for r, _ in fresh], cache)
        return logits_new if logits_old is None else torch.cat([logits_old, logits_new])

    def _decode(self) -> torch.Tensor:
        """One token for every row (padding rows: token 0 at position 0, their logits dropped)."""
        n, padding = len(self.rows), self.cache.batch_size - len(self.rows)
        if self.positions is None:  # the rows changed: their positions again
            cached = [r.cached for r in self.rows] + [0] * padding
            self.positions = torch.tensor(cached, dtype=torch.long, device=self.device)
        tokens = torch.cat([self.pending, self.pending.new_zeros(padding)]) if padding else self.pending
        logits = decode_step(self.model, self.cache, tokens, self.positions, self.compile)
        self.positions[:n] += 1  # padding rows stay at position 0
        for r in self.rows:
            r.cached += 1
        return logits[:n] if padding else logits

    def _start(self, r: Row) -> bool:
        cfg = r.cfg
        r.seq, r.out, r.started = list(r.prompt_ids), [], time.perf_counter()
        try:
            seeded = cfg.seed is not None and not cfg.greedy and self.shared_generator is None
            r.generator = torch.Generator(device=self.device).manual_seed(cfg.seed) if seeded else None
        except (ValueError, RuntimeError) as exc:  # e.g. a seed torch cannot take: this row only
            r.emit(ErrorEvent(f"cannot start this generation: {exc}", "seed"))
            return False
        history = HistoryProcessor(cfg, [r.prompt_ids], self.model.config.vocab_size, self.device)
        r.history = history if history.active else None
        return True

    # ------------------------------------------------------------------------ choosing tokens
    def select(self, logits: torch.Tensor) -> None:
        """Each row's next token from its logits row, with its own knobs and generator. Rows whose
        knobs shape the distribution alike are shaped together (row-wise ops: the same numbers as
        one at a time); each sampled row draws from its own generator in one batched call."""
        scores = self._apply_history(logits)
        groups = self._knob_groups()
        if len(groups) == 1:
            tokens = select_next(scores, groups[0][0], groups[0][2])
        else:
            tokens = torch.empty(len(self.rows), dtype=torch.long, device=self.device)
            for cfg, members, generators in groups:
                tokens[members] = select_next(scores.index_select(0, members), cfg, generators)
        leaving = []
        for i, t in enumerate(tokens.tolist()):
            r = self.rows[i]
            if r.history is not None:
                r.history.observe(tokens[i : i + 1], [t])
            if r.finished:  # riding along (``keep_finished``)
                continue
            if not r.cancelled.is_set():
                self._accept(r, t, logits[i : i + 1])
            if r.cancelled.is_set():  # cancelled from outside, or finished here
                leaving.append(r)
        self.pending = tokens
        self.leave(leaving)

    def _knob_groups(self) -> list[tuple]:
        """(knobs, the rows' indices (a tensor), their generators) for each group of rows whose
        knobs shape the distribution alike."""
        if self.groups is None:
            by_knobs: dict[tuple, list[int]] = {}
            for i, r in enumerate(self.rows):
                c = r.cfg
                by_knobs.setdefault((c.greedy, c.temperature, c.top_k, c.top_p, c.min_p), []).append(i)
            self.groups = []
            for members in by_knobs.values():
                cfg = self.rows[members[0]].cfg
                generators = self.shared_generator
                if generators is None and not cfg.greedy:
                    generators = [self.rows[i].generator for i in members]
                self.groups.append((cfg, torch.tensor(members, device=self.device), generators))
        return self.groups

    def _apply_history(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits
        for i, r in enumerate(self.rows):
            if r.history is None or r.finished:
                continue
            row = r.history(logits[i : i + 1].float(), len(r.out))
            if not bool(torch.isfinite(row).any()):
                r.emit(ErrorEvent(no_allowed_token(len(r.out)), "no_repeat_ngram_size"))
                r.cancel()
                row = logits[i : i + 1].float()  # any token: the row leaves at the end of this step
            if scores is logits:
                scores = logits.float().clone()
            scores[i] = row[0]
        return scores

    def _accept(self, r: Row, t: int, row_logits: torch.Tensor) -> None:
        cfg = r.cfg
        if t in cfg.stop_ids:
            return self._finish(r, "stop_token", t)
        r.out.append(t)
        r.seq.append(t)
        if r.token_events:
            r.emit(_token_event(t, row_logits[0], r.logprobs))
        if cfg.stop_strings and r.decode is not None and hits_stop_string(r.decode, r.out, cfg.stop_strings):
            return self._finish(r, "stop_string")
        if len(r.out) >= cfg.max_new_tokens:
            self._finish(r, "length")

    def _finish(self, r: Row, reason: str, stop_token: int | None = None) -> None:
        r.emit(DoneEvent(reason, list(r.out), time.perf_counter() - r.started, stop_token))
        r.finished = True
        if not self.keep_finished:
            r.cancel()  # leaves the batch at the end of this step

    # ----------------------------------------------------------------------------- the cache
    def leave(self, leaving: list[Row]) -> None:
        """Take rows out of the batch; the rows after them move up into their places."""
        if not leaving:
            return
        gone = {id(r) for r in leaving}
        kept = [id(r) not in gone for r in self.rows]
        n = sum(kept)
        if not n or not self.use_cache:
            self.rows = [r for r, k in zip(self.rows, kept) if k]
            self._rows_changed()
            self.cache = self.pending = None
            return
        # the rows beyond the first n that stay fill the places of those that leave: only they are
        # copied (in place), and the kept rows are the first n of the cache
        tail = [i for i in range(n, len(self.rows)) if kept[i]]
        order = [i if kept[i] else tail.pop() for i in range(n)]
        rest = sorted(set(range(self.cache.batch_size)) - set(order))
        self.rows = [self.rows[i] for i in order]
        self._rows_changed()
        self.pending = self.pending.index_select(0, torch.tensor(order, dtype=torch.long, device=self.device))
        cache = self.cache
        cache.reorder(torch.tensor(order + rest, dtype=torch.long, device=self.device))
        capacity = self.capacity(n)
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
        cache.key_mask = torch.ones(old.batch_size, size, dtype=torch.bool, device=self.device)
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
        size = cache_slots(max(length + remaining, self.min_slots), self.context_length, self.bucketed)
        capacity = self.capacity(total)
        if old is not None and old.batch_size == capacity and old.max_len == size and old.length >= new.length:
            _write_rows(old, len(self.rows), new)  # the same bucket: no new cache
        else:
            cache = self.model.new_kv_cache(capacity, size)
            cache.length = length
            cache.key_mask = torch.ones(capacity, size, dtype=torch.bool, device=self.device)
            if old is not None and self.rows:
                _write_rows(cache, 0, old, len(self.rows))
            _write_rows(cache, len(self.rows), new)
            self.cache = cache
        self.rows = self.rows + rows  # ``select`` sets every row's pending token next
        self._rows_changed()


def _write_rows(cache: KVCache, offset: int, part: KVCache, n_rows: int | None = None) -> None:
    """Copy the first ``n_rows`` rows of ``part`` (default: all) into ``cache`` from row ``offset``,
    their filled slots right-aligned with ``cache.length``, the slots before masked."""
    n_rows = part.batch_size if n_rows is None else n_rows
    rows, start = slice(offset, offset + n_rows), cache.length - part.length  # left padding added to this part
    for dst, src in ((cache.k, part.k), (cache.v, part.v)):
        for d, s in zip(dst, src):
            d[rows, :, start : cache.length] = s[:n_rows, :, : part.length]
    cache.key_mask[rows, :start] = False
    cache.key_mask[rows, start:] = True
    if part.key_mask is not None:
        cache.key_mask[rows, start : cache.length] = part.key_mask[:n_rows, : part.length]
