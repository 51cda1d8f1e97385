"""The decoding core: rows decoding together, one step at a time (continuous batching).

``Batch`` holds rows (each one sequence to continue, with its own ``GenerationConfig``, history
rules and generator), their KV cache, and the step loop every decoder drives: ``TokenStream``
(``tinylm generate``) steps it until its rows are done, the server's scheduler steps it on its
own thread while rows join and leave, beam search uses its prefill, window and step.

A step: rows whose cache reached the context slide (their last ``context_length // 2`` tokens,
``window``, are prefilled again, positions restarting at 0); rows already in the batch feed
their last token through ``decode_step``; rows joining them ride along that step, their prompts'
tokens more rows of its products (``gpt.StepPrompts``: a join costs a few rows, not a forward
of its own), each in a cache row of its own, right-aligned with the step's slot. Rows starting
an empty batch, sliding rows, rows scoring their prompts, prompts longer than the cache so far
and compiled steps are prefilled together instead (left-padded) and their keys and values
copied into the batch's cache, right-aligned with the rows there. Then each row's next token is
chosen with its own knobs and checked against its stop rules.
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
from tinylm.generation.core import (
    ScoredTokens,
    cache_slots,
    full_forward,
    model_device,
    prefill,
    scored_tokens,
    window,
)
from tinylm.generation.decode import decode_step
from tinylm.generation.processors import NEG_INF, NgramBan, mark_seen, penalise_seen
from tinylm.generation.sampling import RowKnobs, choose
from tinylm.models.gpt import KVCache, StepPrompts, step_prompts


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None  # log p of the token under the model (before any decoding knob)
    top: list[tuple[int, float]] | None = None  # the ``Row.logprobs`` most likely (id, log p)

    def __reduce__(self):
        """Pickled as its fields: the engine process sends one per row per step, and a dataclass's
        own pickling (its ``__dict__``) takes half again as long to write and twice to read."""
        return TokenEvent, (self.token, self.logprob, self.top)


@dataclass
class PromptEvent:
    """A row's prompt scored by its prefill (``Row.prompt_logprobs``): for each prompt token after
    the first, its log p given the tokens before it, and the most likely (id, log p) there."""

    scored: ScoredTokens


@dataclass
class DoneEvent:
    finish_reason: str  # "stop_token" | "stop_string" | "length"
    tokens: list[int]
    seconds: float  # from the row's first step to its last
    stop_token: int | None = None  # the stop id that ended the row (not in ``tokens``)
    stop: TokenEvent | None = None  # with ``Row.logprobs``: that stop token's log p and alternatives


@dataclass
class ErrorEvent:
    message: str
    param: str | None = None  # set when the request's knobs caused it (a client error, not the server's)


def ends_row(event) -> bool:
    """Whether ``event`` is a row's last (a row emits nothing after its DoneEvent or ErrorEvent)."""
    return isinstance(event, (DoneEvent, ErrorEvent))


def no_allowed_token(step: int) -> str:
    return (
        f"no token is allowed at step {step + 1}: no_repeat_ngram_size / min_new_tokens ban the whole "
        "vocabulary (ask for fewer new tokens or a smaller n-gram ban)"
    )


COMPACT_SLOTS = 16  # rows leaving drop the cache's unused leading slots once this many are unused


def _token_event(t: int, logits: torch.Tensor, row: int, logprobs: int | None) -> TokenEvent:
    """Token ``t`` of row ``row`` of the step's ``logits`` (B, V), with its log p where asked."""
    event = TokenEvent(t)
    if logprobs is not None:
        logp = torch.log_softmax(logits[row].float(), dim=-1)
        event.logprob = float(logp[t])
        if logprobs > 0:
            values, ids = logp.topk(min(logprobs, logp.numel()))
            event.top = list(zip(ids.tolist(), values.tolist()))
    return event


def _emit_prompt_logprobs(rows: list[Row], ids: list[list[int]], logits: torch.Tensor) -> None:
    """A PromptEvent for each of ``rows`` that asked for one (``Row.prompt_logprobs``), from the
    logits of its left-padded prefill (B, L, V) (row j's ids are ``ids[j]``)."""
    length = logits.size(1)
    for j, r in enumerate(rows):
        if r.prompt_logprobs is None:
            continue
        if len(ids[j]) < 2:  # a lone token has nothing before it to be scored against
            r.emit(PromptEvent(ScoredTokens.join([], r.prompt_logprobs)))
            continue
        first = length - len(ids[j])  # the row's first real position
        logp = torch.log_softmax(logits[j, first : length - 1].float(), dim=-1)  # predicts ids[j][1:]
        r.emit(PromptEvent(scored_tokens(logp, ids[j][1:], r.prompt_logprobs)))


def hits_stop_string(decode: Callable[[list[int]], str], ids: list[int], stop_strings) -> bool:
    """Whether the text of ``ids`` holds a stop string, checked after each new token: only the end
    can hold a new match, so decoding a generous tail keeps this cheap."""
    tail = decode(ids[-64:])
    return any(s in tail for s in stop_strings)


@dataclass
class RowRules:
    """The history rules of the batch's rows as tensors, in ``rows`` order: repetition penalty
    ((B, 1), 1 on rows without; ``seen`` (B, V)), min_new_tokens ((B,), with ``stop_mask`` (B, V)
    the ids it bans) and the rows with a no-repeat n-gram ban (``ngram_rows``)."""

    penalty: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    min_new: torch.Tensor | None = None
    stop_mask: torch.Tensor | None = None
    ngram_rows: list[int] = field(default_factory=list)


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """One sequence to continue."""

    prompt_ids: list[int]  # already fitted to the context (``fit_prompts``)
    cfg: GenerationConfig  # ``cfg.seed`` seeds this row's draws unless the batch shares a generator
    emit: Callable[[object], None]  # receives TokenEvent / DoneEvent / ErrorEvent
    decode: Callable[[list[int]], str] | None = None  # for stop strings
    logprobs: int | None = None  # report the top-N alternatives of each token (None: no log probs)
    # score the prompt in its prefill (a PromptEvent first) with the top-N alternatives of each token
    prompt_logprobs: int | None = None
    token_events: bool = True  # False: tokens are read off ``out`` (no event per token: less work per step)
    cancelled: threading.Event = field(default_factory=threading.Event)

    # decoding state, owned by whoever steps the batch
    seq: list[int] = field(default_factory=list)  # prompt + accepted tokens (the sliding window's source)
    out: list[int] = field(default_factory=list)
    cached: int = 0  # this row's real tokens in the cache (its next position)
    seed: int | None = None  # the row's stream of draws (``sampling.stream_uniforms``); None: greedy or shared
    seen: torch.Tensor | None = None  # (1, V) the tokens the row holds (repetition penalty): a view into the batch's
    ngrams: NgramBan | None = None
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
        self.knobs: tuple[RowKnobs, RowRules] | None = None  # the rows' knobs as tensors, while the rows stay
        self.steps = 0

    def _rows_changed(self) -> None:
        self.positions = self.knobs = None

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
        row's pending token goes into the cache, rows at the context slide, joining rows read
        their prompts. Rows that slid move to the end of ``rows``."""
        return self._forward(joining)

    def _forward(self, joining: list[Row]) -> torch.Tensor:
        started = [r for r in joining if self._start(r)]
        self.steps += 1
        if self.use_cache:
            return self._forward_cached(started)
        if started:
            self.rows = self.rows + started
            self._rows_changed()
            scoring = [r for r in started if r.prompt_logprobs is not None]
            if scoring:  # the reference path: a forward of their own
                rows = [r.prompt_ids for r in scoring]
                _emit_prompt_logprobs(scoring, rows, prefill(self.model, rows, max(map(len, rows)), True)[1])
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
            if started and not sliding and self._joins_step(started):
                return self._decode_joining(started)
            logits_old = self._decode()
        if not fresh:
            return logits_old
        self.model.prepare_for_decoding()
        rows = [ids for _, ids in fresh]
        scoring = any(r.prompt_logprobs is not None for r in started)
        cache, logits_new, _ = prefill(self.model, rows, max(len(ids) for ids in rows), scoring)
        if scoring:  # every position's logits: the rows that asked score their prompts from them
            _emit_prompt_logprobs([r for r, _ in fresh[: len(started)]], rows, logits_new)
            logits_new = logits_new[:, -1]
        for r, ids in fresh:
            r.cached = len(ids)
        self._merge([r for r, _ in fresh], cache)
        return logits_new if logits_old is None else torch.cat([logits_old, logits_new])

    def _joins_step(self, joining: list[Row]) -> bool:
        """Whether ``joining`` rows can ride along this step with their prompts (``_decode_joining``):
        an eager, unbucketed cache, no prompt to score, every prompt fitting before the step's slot."""
        return (
            not self.compile
            and not self.bucketed
            and all(r.prompt_logprobs is None for r in joining)
            and max(len(r.prompt_ids) for r in joining) <= self.cache.length + 1
        )

    def _decode_joining(self, joining: list[Row]) -> torch.Tensor:
        """One step for the rows there and the ``joining`` rows' prompts together: a join costs a
        few more rows of the step's products, not a forward of its own. Each joining row takes a
        cache row after the batch's, its prompt right-aligned with this step's slot. The model's
        decoding layouts are those its rows began with (``prepare_for_decoding`` checks every weight:
        at 32 rows a join comes every other step, and the rows there step without that check)."""
        n, slot = len(self.rows), self.cache.length
        self._make_room(joining, slot)
        firsts = torch.tensor([slot + 1 - len(r.prompt_ids) for r in joining], device=self.device)  # first slots
        self.cache.key_mask[n : n + len(joining)] = (
            torch.arange(self.cache.max_len, device=self.device) >= firsts[:, None]
        )
        logits = self._decode(step_prompts([r.prompt_ids for r in joining], n, slot, self.device))
        for r in joining:
            r.cached = len(r.prompt_ids)
        self.rows = self.rows + joining  # ``select`` sets every row's pending token next
        self._rows_changed()
        return logits

    def _decode(self, prompts: StepPrompts | None = None) -> torch.Tensor:
        """One token for every row (padding rows: token 0 at position 0, their logits dropped);
        with ``prompts``, the logits of the joining rows follow (``_decode_joining``)."""
        n = len(self.rows)
        padding = 0 if prompts is not None else self.cache.batch_size - n
        if self.positions is None:  # the rows changed: their positions again
            cached = [r.cached for r in self.rows] + [0] * padding
            self.positions = torch.tensor(cached, dtype=torch.long, device=self.device)
        tokens = torch.cat([self.pending, self.pending.new_zeros(padding)]) if padding else self.pending
        logits = decode_step(self.model, self.cache, tokens, self.positions, self.compile, prompts)
        self.positions[:n] += 1  # padding rows stay at position 0
        for r in self.rows:
            r.cached += 1
        return logits[:n] if padding else logits

    def _start(self, r: Row) -> bool:
        cfg = r.cfg
        r.seq, r.out, r.started = list(r.prompt_ids), [], time.perf_counter()
        r.seed = None
        if not cfg.greedy and self.shared_generator is None:  # unseeded: a seed from torch's generator
            r.seed = cfg.seed if cfg.seed is not None else int(torch.randint(2**62, ()))
        vocab_size = self.model.config.vocab_size
        r.seen = mark_seen([r.prompt_ids], vocab_size, self.device) if cfg.repetition_penalty != 1.0 else None
        r.ngrams = NgramBan(cfg.no_repeat_ngram_size, [r.prompt_ids]) if cfg.no_repeat_ngram_size else None
        return True

    # ------------------------------------------------------------------------ choosing tokens
    def select(self, logits: torch.Tensor) -> None:
        """Each row's next token from its logits row, with its own knobs and seed, for every row
        at once (``sampling.choose``); then each row takes its token (events, stop rules)."""
        knobs, rules = self._row_knobs()
        draws = [len(r.out) for r in self.rows]  # the tokens each row chose before
        scores = self._apply_rules(logits, rules, draws)
        tokens = choose(scores, knobs, self.shared_generator, draws)
        if rules.seen is not None:
            rules.seen.scatter_(1, tokens[:, None], True)
        leaving = []
        for i, (r, t) in enumerate(zip(self.rows, tokens.tolist())):  # per row: no tensor work unless asked
            if r.ngrams is not None:
                r.ngrams.observe([t])
            if r.finished:  # riding along (``keep_finished``)
                continue
            if not r.cancelled.is_set():
                self._accept(r, t, logits, i)
            if r.cancelled.is_set():  # cancelled from outside, or finished here
                leaving.append(r)
        self.pending = tokens
        self.leave(leaving)

    def _row_knobs(self) -> tuple[RowKnobs, RowRules]:
        """The rows' knobs and history rules as tensors, built again only when the rows change.
        Each row's ``seen`` becomes a view into the batch's mask, so the batch's updates are the
        row's when it moves to another batch."""
        if self.knobs is None:
            rows, cfgs = self.rows, [r.cfg for r in self.rows]
            seeds = None if self.shared_generator is not None else [r.seed or 0 for r in rows]
            knobs = RowKnobs.of(cfgs, seeds, self.device)
            rules = RowRules(ngram_rows=[i for i, r in enumerate(rows) if r.ngrams is not None])
            if any(r.seen is not None for r in rows):
                none = torch.zeros(1, self.model.config.vocab_size, dtype=torch.bool, device=self.device)
                rules.seen = torch.cat([none if r.seen is None else r.seen for r in rows])
                rules.penalty = torch.tensor([c.repetition_penalty for c in cfgs], device=self.device)[:, None]
                for i, r in enumerate(rows):
                    if r.seen is not None:
                        r.seen = rules.seen[i : i + 1]
            if any(c.min_new_tokens > 0 and c.stop_ids for c in cfgs):
                rules.min_new = torch.tensor([c.min_new_tokens for c in cfgs], device=self.device)
                rules.stop_mask = mark_seen([list(c.stop_ids) for c in cfgs], self.model.config.vocab_size, self.device)
            self.knobs = knobs, rules
        return self.knobs

    def _apply_rules(self, logits: torch.Tensor, rules: RowRules, draws: list[int]) -> torch.Tensor:
        """Repetition penalty, no-repeat n-grams, then min_new_tokens (the order of processors.py).
        A row whose rules ban every token gets an error and leaves; its token is any."""
        if rules.seen is None and rules.min_new is None and not rules.ngram_rows:
            return logits
        scores = logits.float().clone()  # rows are written below; ``logits`` stay the model's
        if rules.seen is not None:
            scores = penalise_seen(scores, rules.seen, rules.penalty)
        for i in rules.ngram_rows:
            if not self.rows[i].finished:
                scores[i] = self.rows[i].ngrams(scores[i : i + 1])[0]
        if rules.min_new is not None:
            early = torch.tensor(draws, device=self.device) < rules.min_new
            scores = scores.masked_fill(rules.stop_mask & early[:, None], NEG_INF)
        if rules.ngram_rows or rules.min_new is not None:
            for i in torch.nonzero(~torch.isfinite(scores).any(-1)).flatten().tolist():
                r = self.rows[i]
                if not r.finished:
                    r.emit(ErrorEvent(no_allowed_token(len(r.out)), "no_repeat_ngram_size"))
                    r.cancel()
                scores[i] = logits[i].float()  # any token: the row leaves at the end of this step
        return scores

    def _accept(self, r: Row, t: int, logits: torch.Tensor, i: int) -> None:
        """Row ``r`` (row ``i`` of the step's ``logits``) takes token ``t``, or ends on it."""
        cfg = r.cfg
        if t in cfg.stop_ids:
            stop = _token_event(t, logits, i, r.logprobs) if r.logprobs is not None else None
            return self._finish(r, "stop_token", t, stop)
        r.out.append(t)
        r.seq.append(t)
        if r.token_events:
            r.emit(_token_event(t, logits, i, r.logprobs))
        if cfg.stop_strings and r.decode is not None and hits_stop_string(r.decode, r.out, cfg.stop_strings):
            return self._finish(r, "stop_string")
        if len(r.out) >= cfg.max_new_tokens:
            self._finish(r, "length")

    def _finish(self, r: Row, reason: str, stop_token: int | None = None, stop: TokenEvent | None = None) -> None:
        r.emit(DoneEvent(reason, list(r.out), time.perf_counter() - r.started, stop_token, stop))
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
        # copied (in place), and the kept rows are the first n of the cache; the cache rows after
        # those become padding and keep what they hold (nothing is copied into them)
        tail = [i for i in range(n, len(self.rows)) if kept[i]]
        order = [i if kept[i] else tail.pop() for i in range(n)]
        rest = list(range(n, self.cache.batch_size))
        self.rows = [self.rows[i] for i in order]
        self._rows_changed()
        self.pending = self.pending.index_select(0, torch.tensor(order, dtype=torch.long, device=self.device))
        cache = self.cache
        cache.reorder(torch.tensor(order + rest, dtype=torch.long, device=self.device))
        capacity = self.capacity(n)
        if capacity < cache.batch_size:
            _show_rows(cache, capacity)
        cache.key_mask[n:] = True  # padding attends to anything: finite logits, dropped
        if not self.bucketed:  # fewer slots to attend and for the next merge; a bucketed cache compacts when full
            self._compact(COMPACT_SLOTS)

    def _compact(self, least: int = 1) -> None:
        """Drop the leading slots no row uses any more (every row's tokens are the last slots), if
        there are at least ``least`` of them: compacting copies the whole cache's filled slots, and
        the row that leaves is usually the oldest, a few slots longer than the next."""
        cache = self.cache
        shift = cache.length - max(r.cached for r in self.rows)
        if shift < max(least, 1):
            return
        n = cache.length - shift
        tensors = [(t, 2) for t in (*cache.k, *cache.v)] + [(cache.key_mask, 1)]  # and their slot dimension
        if n > 4 * shift:  # a few slots dropped: one copy through a temporary beats many short ones
            for t, slots in tensors:
                t.narrow(slots, 0, n).copy_(t.narrow(slots, shift, n).clone())
        else:  # in runs of ``shift`` slots, first to last: each run's source lies past what is
            # written so far (no run reads a slot already overwritten), and each slot is copied once
            for start in range(0, n, shift):
                size = min(shift, n - start)
                for t, slots in tensors:
                    t.narrow(slots, start, size).copy_(t.narrow(slots, start + shift, size))
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
        self._make_room(rows, max(new.length, self.cache.length if self.cache is not None else 0))
        _write_rows(self.cache, len(self.rows), new)
        self.rows = self.rows + rows  # ``select`` sets every row's pending token next
        self._rows_changed()

    def _make_room(self, rows: list[Row], length: int) -> None:
        """A cache with ``length`` slots filled and room for ``rows`` after the batch's rows, its
        tensors showing them: the cache there when it has the room, else a new one holding the
        batch's rows (right-aligned, as before)."""
        old = self.cache
        total = len(self.rows) + len(rows)
        # slots for what the rows may still generate, not always the whole context: a batch of 32
        # rows of a 1,024-token model would hold gigabytes of cache it mostly never fills
        # slots in buckets (64 times a power of two) and room for a bucket of rows, so that most
        # joins write their rows into the cache they find (an eager step reads only the filled
        # slots of the rows in the batch: the room costs memory, not time)
        remaining = max(r.cfg.max_new_tokens - len(r.out) for r in self.rows + rows)
        size = cache_slots(max(length + remaining, self.min_slots), self.context_length, bucketed=True)
        capacity = self.capacity(total)
        if old is not None and _room(old) >= capacity and old.max_len == size and old.length >= length:
            _show_rows(old, capacity)  # no new cache
            return
        room = next(b for b in batch_buckets(self.max_batch) if b >= capacity)
        cache = self.model.new_kv_cache(room, size)
        cache.length = length
        cache.key_mask = torch.ones(room, size, dtype=torch.bool, device=self.device)
        _show_rows(cache, capacity)
        if old is not None and self.rows:
            _write_rows(cache, 0, old, len(self.rows))
        self.cache = cache


def _whole(cache: KVCache) -> list[torch.Tensor]:
    """The tensors (keys, values, key mask) whose first rows the cache's tensors are. Recorded on
    the cache by ``_show_rows``: a view made under inference mode does not know its base."""
    whole = getattr(cache, "whole", None)
    if whole is None or whole[0].data_ptr() != cache.k[0].data_ptr():  # none, or not these tensors
        whole = cache.whole = [*cache.k, *cache.v, cache.key_mask]
    return whole


def _room(cache: KVCache) -> int:
    """The rows the cache's storage holds (its tensors may be views of the first rows)."""
    return _whole(cache)[0].size(0)


def _show_rows(cache: KVCache, rows: int) -> None:
    """Make the cache's tensors views of the first ``rows`` rows of their storage (more or fewer
    than now): the first rows of a contiguous tensor, so no copy."""
    whole = _whole(cache)
    if rows == cache.batch_size:
        return
    n = len(cache.k)
    cache.k, cache.v = [t[:rows] for t in whole[:n]], [t[:rows] for t in whole[n : 2 * n]]
    cache.key_mask = whole[-1][:rows]


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
