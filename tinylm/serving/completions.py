"""`/v1/completions` without the HTTP: a request checked and turned into decoding rows (``plan_completion``),
the rows decoded on the model's scheduler and their tokens turned back into OpenAI's response
(``complete``) or its server-sent events (``sse_stream``).

The rules a request follows (docs/serving.md):

- prompt i (of a list) with ``n`` choices gives choices ``i * n .. i * n + n - 1``; choice k
  samples with seed ``seed + k``. That is what ``tinylm generate --prompt ... --seed seed`` does
  for prompt k, so the server and the command give the same tokens.
- a text prompt starts with the tokenizer's start id (as in ``tinylm generate``); a prompt given
  as token ids is used as it is.
- a prompt longer than the context keeps its last ``context_length`` tokens
  (``generation.core.fit_prompts``); the response carries the warning in ``warnings``.
- as OpenAI does, the text ends before the first stop string (``tinylm generate`` prints it).
- ``logprobs``: log probabilities under the model itself (before temperature and the other
  knobs), with the top-N alternatives of each token.
- ``echo`` with ``logprobs`` scores every prompt token as given (the first has no log probability,
  ``null``; a prompt longer than the context with the strided windows of ``tinylm evaluate``);
  ``max_tokens: 0`` then asks for nothing more. A choice that ended on a stop token lists that
  token last (its text is empty), as OpenAI does: lm-evaluation-harness's ``local-completions``
  model asks for one new token and drops the last entry (docs/evaluation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import secrets
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

import orjson

from tinylm.config import ConfigError, GenerationConfig, knob_names
from tinylm.errors import TinyLMError
from tinylm.generation.batch import DoneEvent, ErrorEvent, PromptEvent, Row, TokenEvent, ends_row
from tinylm.generation.core import ScoredTokens, fit_prompts
from tinylm.generation.generate import encode_prompt, generate_many, prompt_head
from tinylm.serving.scheduler import DecodingStopped
from tinylm.serving.schemas import CompletionRequest
from tinylm.tokenizers.base import ContinuationText

MAX_LOGPROBS = 20
JSON_SLICE = 128  # entries of a long list built and written at once (``json_body``): about a millisecond
MAX_STOPS = 16
# GenerationConfig's knob -> the request's field, for the knobs a request carries
REQUEST_FIELDS = knob_names("http")


@dataclass
class Limits:
    max_tokens: int = 512  # max_tokens above this is refused
    max_choices: int = 16  # prompts x n per request
    max_body_bytes: int = 1_000_000
    # tokens one request may have scored (echo with logprobs, /v1/score, /v1/tinylm/score): it bounds
    # the work and the response, at most this many entries times (1 + 2 x the alternatives asked)
    max_score_tokens: int = 16_384


def check_scored(tokens: int, limit: int, param: str) -> None:
    """413 naming the limit when a request would score more than ``limit`` tokens."""
    if tokens > limit:
        raise APIError(
            413,
            f"{param}: scoring it takes {tokens} tokens, more than this server's limit of {limit} "
            "(tinylm serve --max-score-tokens)",
            param,
            "score_too_large",
        )


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after  # seconds, sent as Retry-After (every 503 has one)

    def __reduce__(self):  # raised in the engine process, it travels back pickled
        return APIError, (self.status, self.message, self.param, self.code, self.kind, self.retry_after)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


RETRY_AFTER = 2  # seconds a 503 asks a client to wait when nothing better is known


def unavailable(message: str, retry_after: int = RETRY_AFTER) -> APIError:
    """503: the model engine is down (it crashed and is restarting, it gave up, or the server is
    shutting down); the client is told when to try again."""
    return APIError(503, message, None, "engine_unavailable", "server_error", retry_after)


@dataclass
class Choice:
    index: int
    prompt: str  # the prompt's text as the reader sees it (for echo)
    prompt_ids: list[int]  # what decoding starts from: the prompt's last context_length ids
    cfg: GenerationConfig
    echo_ids: list[int] = field(default_factory=list)  # every id of the prompt, scored with echo
    stop_id: int | None = None  # the stop token that ended it, as the decoder reports it
    stop: tuple | None = None  # with echo and logprobs: (id, log p, alternatives) of that stop token
    stop_scored: TokenEvent | None = None  # that stop token's log p as the decoder reported it
    prompt_part: tuple | None = None  # with echo and logprobs: (ids, log p, alternatives), scored in the prefill
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # tinylm's: stop_token | stop_string | length
    seconds: float = 0.0
    shown: str = ""  # text already streamed
    streamed: ContinuationText | None = None  # the continuation's text, decoded as tokens arrive


@dataclass
class Plan:
    choices: list[Choice]
    seed: int
    warnings: list[str]
    request: CompletionRequest
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))

    @property
    def beam(self) -> bool:
        return self.request.beam_width > 1

    @property
    def scoring_only(self) -> bool:
        """max_tokens 0 (with echo): the prompt is scored, nothing is decoded."""
        return self.request.max_tokens == 0

    @property
    def stops(self) -> tuple[str, ...]:
        return self.choices[0].cfg.stop_strings if self.choices else ()

    @property
    def scores_in_prefill(self) -> bool:
        """With echo and logprobs, the rows' prefills score the prompts (one forward for both)
        when the rows decode, every prompt fits the context and the response is whole (a stream
        sends the scored prompt first); otherwise ``echo_logprobs`` does."""
        r = self.request
        return (
            r.echo
            and r.logprobs is not None
            and not r.stream
            and not self.scoring_only
            and not self.beam
            and all(c.echo_ids == c.prompt_ids for c in self.choices)
        )


# ------------------------------------------------------------------------------------ checking
def _check_request(r: CompletionRequest, limits: Limits) -> None:
    """What only a request has: the server's limits, logprobs, streaming, OpenAI's neutral fields
    (the decoding knobs are GenerationConfig's to check)."""
    if r.max_tokens == 0 and not r.echo:
        raise bad("max_tokens", "0 asks for no new token: only with echo (to score the prompt)")
    if r.max_tokens == 0 and r.stream:
        raise bad("stream", "max_tokens 0 only scores the prompt; there is nothing to stream")
    if not 0 <= r.max_tokens <= limits.max_tokens:
        raise bad(
            "max_tokens",
            f"must be between 0 (with echo) and {limits.max_tokens} (this server's limit), got {r.max_tokens}",
        )
    if r.n < 1:
        raise bad("n", f"must be >= 1, got {r.n}")
    if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {r.logprobs}")
    if r.beam_width > 1 and r.stream:
        raise bad(
            "stream",
            "beam search cannot stream (the best beam is known only at the end); "
            "set stream to false or beam_width to 1",
        )
    if r.beam_width > 1 and r.n > r.beam_width:
        raise bad("n", f"with beam search n is the number of best beams returned, at most beam_width ({r.beam_width})")
    if r.seed is not None and not -(2**63) <= r.seed <= 2**63 - 1 - limits.max_choices:
        raise bad("seed", f"must be a 64-bit integer (at most {2**63 - 1 - limits.max_choices}), got {r.seed}")
    neutral = {
        "presence_penalty": r.presence_penalty == 0,
        "frequency_penalty": r.frequency_penalty == 0,
        "logit_bias": not r.logit_bias,
        "suffix": r.suffix is None,
        "best_of": r.best_of in (None, r.n),
    }
    for name, ok in neutral.items():
        if not ok:
            raise bad(
                name,
                "is not supported by tinylm (see repetition_penalty and no_repeat_ngram_size)",
                "unsupported_parameter",
            )


def generation_config(r: CompletionRequest, served, stops: tuple[str, ...], seed: int) -> GenerationConfig:
    """The request's knobs as the GenerationConfig every choice decodes with, checked against the
    model; a bad knob is a 400 naming the request's field."""
    knobs = {name: getattr(r, field) for name, field in REQUEST_FIELDS.items()}
    cfg = GenerationConfig(
        **{
            **knobs,
            "top_p": None if r.top_p == 1 else r.top_p,
            "stop_strings": stops,
            "stop_ids": tuple(served.tokenizer.stop_ids) + tuple(r.stop_ids),
            "seed": seed,
            "seed_per_row": True,
            "num_return_sequences": r.n if r.beam_width > 1 else 1,
        }
    )
    try:
        return cfg.validate(served.vocab_size)
    except ConfigError as exc:
        param = REQUEST_FIELDS.get(exc.key, exc.key)
        raise APIError(400, f"{param}: {exc}", param, "invalid_value") from exc


def _stops(r: CompletionRequest) -> tuple[str, ...]:
    stops = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise bad("stop", "stop strings must not be empty")
    return tuple(stops)


def _prompts(r: CompletionRequest, served) -> list[tuple[str, list[int]]]:
    """(text, ids) per prompt: a string, a list of strings, a list of ids or a list of id lists."""
    p = r.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise bad("prompt", "must not be empty", "empty_prompt")
    out = []
    for item in p:
        if not item:
            raise bad("prompt", "must not be empty", "empty_prompt")
        if isinstance(item, str):
            try:
                ids = encode_prompt(served.tokenizer, item)
            except TinyLMError as exc:
                raise bad("prompt", str(exc), "empty_prompt") from exc
            out.append((prompt_head(served.tokenizer, item, ids), ids))
        else:
            served.check_ids(item, "prompt")
            out.append((served.tokenizer.decode(item), list(item)))
    return out


def plan_completion(served, r: CompletionRequest, limits: Limits) -> Plan:
    """Check the request against the model and the limits; one Choice per row to decode."""
    _check_request(r, limits)
    stops = _stops(r)
    prompts = _prompts(r, served)
    if len(prompts) * r.n > limits.max_choices:
        raise bad(
            "n", f"prompts x n must be at most {limits.max_choices} (this server's limit), got {len(prompts)} x {r.n}"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted = fit_prompts([ids for _, ids in prompts], served.context_length)
    notes = [str(w.message) for w in caught]
    if r.echo and r.logprobs is not None:  # every distinct prompt is scored whole
        distinct = {tuple(ids) for _, ids in prompts}
        check_scored(sum(map(len, distinct)), limits.max_score_tokens, "prompt")
    seed = r.seed if r.seed is not None else secrets.randbelow(2**31)
    base = generation_config(r, served, stops, seed)
    # choice k samples with seed + k, except that one beam search (seed + i) gives the n best beams of prompt i
    beam = r.beam_width > 1
    choices = [
        Choice(
            i * r.n + j, text, ids, dataclasses.replace(base, seed=seed + (i if beam else i * r.n + j)), echo_ids=full
        )
        for i, ((text, full), ids) in enumerate(zip(prompts, fitted))
        for j in range(r.n)
    ]
    if r.max_tokens == 0:
        for c in choices:
            c.finish_reason = "length"
    return Plan(choices, seed, notes if r.max_tokens else [], r)


# ----------------------------------------------------------------------------------- responses
def visible_text(text: str, stops: tuple[str, ...], final: bool) -> str:
    """The part of a growing continuation that can be shown: up to the first stop string; while
    decoding, without a trailing incomplete character or a tail that may become a stop string."""
    cuts = [text.find(s) for s in stops if s in text]
    if cuts:
        return text[: min(cuts)]
    if final:
        return text
    text = text.rstrip("\ufffd")
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


def new_text(choice: Choice, tokenizer, stops, final: bool) -> str:
    """What to stream next for ``choice`` (its visible text beyond what was already sent)."""
    if choice.streamed is None:
        choice.streamed = ContinuationText(tokenizer.decode, choice.prompt_ids)
    text = visible_text(choice.streamed.update(choice.tokens), stops, final)
    if len(text) <= len(choice.shown) or not text.startswith(choice.shown):
        return ""
    piece, choice.shown = text[len(choice.shown) :], text
    return piece


def prompt_offsets(ids: list[int], tokenizer, pieces: list[str], start: int = 0) -> Sequence[int]:
    """Where each prompt token starts in the prompt's text, from ``start``: start + len(decode(ids[:k])).
    When the tokens' own texts (``pieces``) add up to the text, their running lengths; otherwise (a
    character cut between tokens, words joined with spaces) ``PrefixLengths``."""
    if "".join(pieces) == tokenizer.decode(ids):
        return list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=start))
    return PrefixLengths(ids, tokenizer.decode, start)


class PrefixLengths(Sequence):
    """start + len(decode(ids[:k])) for each k, computed in order as they are read, each prefix's
    text kept up to date a token at a time (``ContinuationText``): linear, where decoding each
    prefix whole took 26 s for 16,384 tokens; and read a slice at a time (``json_body``), a long
    scored prompt's offsets never hold the event loop at once."""

    def __init__(self, ids: list[int], decode: Callable, start: int = 0):
        self.ids, self.text, self.prefix, self.known = ids, ContinuationText(decode, []), [], [start]
        self.start = start

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k):
        if not isinstance(k, slice) and not -len(self) <= k < len(self):
            raise IndexError(k)
        stop = k.indices(len(self))[1] if isinstance(k, slice) else k % len(self) + 1
        while len(self.known) < stop:
            self.prefix.append(self.ids[len(self.known) - 1])
            self.known.append(self.start + len(self.text.update(self.prefix)))
        return self.known[: len(self)][k]


class Chained(Sequence):
    """Two sequences read as one (a prompt's offsets, then the continuation's)."""

    def __init__(self, first: Sequence, second: Sequence):
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __getitem__(self, k):
        if not isinstance(k, slice):
            if not -len(self) <= k < len(self):
                raise IndexError(k)
            k %= len(self)
            return self.first[k] if k < len(self.first) else self.second[k - len(self.first)]
        a, b, step = k.indices(len(self))
        n = len(self.first)
        return (list(self.first[a : min(b, n)]) + list(self.second[max(a - n, 0) : max(b - n, 0)]))[::step]


class Mapped(Sequence):
    """``fn(item)`` for each of ``items``, built when read: a long scored prompt's alternatives are
    built a slice at a time as the response is written (``json_body``), not all at once."""

    def __init__(self, fn: Callable, items: list):
        self.fn, self.items = fn, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, k):
        return [self.fn(x) for x in self.items[k]] if isinstance(k, slice) else self.fn(self.items[k])


def logprobs_json(
    choice: Choice, tokenizer, start: int = 0, offset: int = 0, prompt_part=None, lazy: bool = False
) -> dict:
    """OpenAI's legacy completions ``logprobs`` for tokens ``start:``, text offsets from ``offset``
    (with echo, ``prompt_part`` = (tokens, logprobs, tops) of the prompt comes first). OpenAI keys
    the alternatives by their text, which merges tokens of equal text; ``tinylm_top`` lists them
    all with their ids. ``lazy``: the alternatives as ``Mapped`` (for ``json_body``)."""

    texts: dict[int, str] = {}  # each id's text, decoded once: a scored prompt lists each id many times

    def text(i: int) -> str:
        if i not in texts:
            texts[i] = tokenizer.decode([i])
        return texts[i]

    def top_dict(alternatives):
        if alternatives is None:  # the first prompt token: nothing before it
            return None
        d: dict[str, float] = {}
        for i, lp in alternatives:
            d.setdefault(text(i), lp)
        return d

    def top_list(alternatives):  # tinylm's: every alternative, also those whose texts are equal
        if alternatives is None:
            return None
        return [{"id": i, "token": text(i), "logprob": lp} for i, lp in alternatives]

    tokens, logprobs, prompt_alternatives, alternatives, offsets, prompt_at = [], [], [], [], [], []
    if prompt_part is not None:
        ids, lps, prompt_alternatives = prompt_part
        tokens += [text(i) for i in ids]
        prompt_at = prompt_offsets(ids, tokenizer, tokens, offset)
        logprobs += lps
        offset += len(tokenizer.decode(ids))
    new = [(k, choice.tokens[k], choice.logprobs[k], choice.top[k]) for k in range(start, len(choice.tokens))]
    if choice.stop is not None:  # the stop token, after the text
        new.append((len(choice.tokens), *choice.stop))
    for k, i, lp, alts in new:  # position, id, log p, alternatives
        offsets.append(offset + len(tokenizer.decode_continuation(choice.prompt_ids, choice.tokens[:k])))
        tokens.append(text(i))
        logprobs.append(lp)
        alternatives.append(alts)
    alternatives = Chained(prompt_alternatives, alternatives)
    tops, ids_top = Mapped(top_dict, alternatives), Mapped(top_list, alternatives)
    offsets = Chained(prompt_at, offsets)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops if lazy else tops[:],
        "text_offset": offsets if lazy else offsets[:],
        "tinylm_top": ids_top if lazy else ids_top[:],
    }


def choice_json(c: Choice, text: str, logprobs: dict | None = None, final: bool = False) -> dict:
    """A choice of the response or of a chunk. The final one carries OpenAI's finish reason and
    tinylm's extension: the token ids (what `tinylm generate --json` prints) and speed."""
    out = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": None}
    if final:
        out["finish_reason"] = {None: None, "length": "length"}.get(c.finish_reason, "stop")
        out["tinylm"] = {
            "token_ids": c.tokens,
            "finish": c.finish_reason,
            "seconds": round(c.seconds, 4),
            "tokens_per_s": round(len(c.tokens) / c.seconds, 1) if c.seconds > 0 else None,
        }
    return out


def response_json(plan: Plan, model: str, choices: list[dict], **more) -> dict:
    """The envelope of the response and of each chunk."""
    return dict(id=plan.id, object="text_completion", created=plan.created, model=model, choices=choices, **more)


def usage(plan: Plan) -> dict:
    prompt = sum(len(ids) for ids in {c.index // plan.request.n: c.prompt_ids for c in plan.choices}.values())
    completion = sum(len(c.tokens) for c in plan.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_json(plan: Plan, tokenizer, model: str, prompt_parts: dict | None, lazy: bool = False) -> dict:
    r, out = plan.request, []
    for c in plan.choices:
        text = visible_text(tokenizer.decode_continuation(c.prompt_ids, c.tokens), plan.stops, final=True)
        lp = None
        if r.logprobs is not None:
            lp = logprobs_json(c, tokenizer, prompt_part=(prompt_parts or {}).get(c.index), lazy=lazy)
        out.append(choice_json(c, (c.prompt if r.echo else "") + text, lp, final=True))
    more = {"warnings": plan.warnings} if plan.warnings else {}
    return response_json(plan, model, out, usage=usage(plan), seed=plan.seed, **more)


# ------------------------------------------------------------------------------------ decoding
class Outbox:
    """Events from the decoding thread to the requests' queues on the event loop: one wake-up of
    the loop carries every event of a step (a wake-up per token per row costs more than the
    event itself when 16 streams decode together)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    def put(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            wake, self.scheduled = not self.scheduled, True
        if wake:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def prompt_part(ids: list[int], scored: ScoredTokens) -> tuple:
    """(ids, log p, alternatives) of an echoed prompt: the first token has none (nothing before it)."""
    return ids, [None, *scored.logprobs.tolist()], Chained([None], scored.alternatives())


async def echo_logprobs(served, plan: Plan) -> dict | None:
    """With echo and logprobs (None otherwise): every prompt token's log probability (the first has
    none), the distinct prompts of the request scored together."""
    if not (plan.request.echo and plan.request.logprobs is not None):
        return None
    rows = [list(r) for r in dict.fromkeys(tuple(c.echo_ids) for c in plan.choices)]
    scored = await served.on_model_thread("rows_logprobs", rows, plan.request.logprobs, param="prompt")
    parts = {tuple(r): prompt_part(r, s) for r, s in zip(rows, scored)}
    return {c.index: parts[tuple(c.echo_ids)] for c in plan.choices}


def beam_choices(served, choices: list[Choice], logprobs: int | None) -> list[Choice]:
    """Beam search for one prompt's ``n`` choices, on the model's thread: the choices filled in (an
    engine process sends back copies)."""
    t0 = time.perf_counter()
    results = generate_many(
        served.model, [choices[0].prompt_ids], choices[0].cfg, served.tokenizer.decode, served.scheduler.give_turn
    )
    seconds = time.perf_counter() - t0
    for c, g in zip(choices, results):
        c.tokens, c.finish_reason, c.seconds = g.tokens, g.finish_reason, seconds
        if logprobs is not None and g.tokens:
            scored, first = served.sequence_logprobs(c.prompt_ids + g.tokens, logprobs), len(c.prompt_ids) - 1
            c.logprobs, c.top = scored.logprobs[first:].tolist(), scored.alternatives()[first:]
    return choices


async def beam(served, plan: Plan) -> None:
    """Beam search on the model's thread, one prompt at a time (as `tinylm generate` does)."""
    n = plan.request.n
    for first in range(0, len(plan.choices), n):  # prompt i's n beams are choices i * n .. i * n + n - 1
        plan.choices[first : first + n] = await served.on_model_thread(
            beam_choices, plan.choices[first : first + n], plan.request.logprobs, param="prompt"
        )


@contextlib.contextmanager
def start_rows(served, plan: Plan, outbox: Outbox):
    """A scheduler row per choice, its events on the yielded queue as (index, event), until the block is left."""
    events: asyncio.Queue = asyncio.Queue()
    rows = [
        Row(
            c.prompt_ids,
            c.cfg,
            lambda event, index=c.index: outbox.put(events, (index, event)),
            served.tokenizer.decode,
            plan.request.logprobs,
            plan.request.logprobs if plan.scores_in_prefill else None,
        )
        for c in plan.choices
    ]
    try:
        for row in rows:
            served.scheduler.add(row)
        yield events
    finally:  # rows added before one failed to be added are cancelled too
        for row in rows:
            served.scheduler.cancel(row)


def record(plan: Plan, index: int, event) -> None:
    c = plan.choices[index]
    if isinstance(event, TokenEvent):
        c.tokens.append(event.token)
        c.logprobs.append(event.logprob)
        c.top.append(event.top or [])
    elif isinstance(event, DoneEvent):
        c.finish_reason, c.seconds, c.stop_id = event.finish_reason, event.seconds, event.stop_token
        c.stop_scored = event.stop
    elif isinstance(event, PromptEvent):
        c.prompt_part = prompt_part(c.echo_ids, event.scored)
    elif isinstance(event, DecodingStopped):
        raise unavailable(event.message)
    elif isinstance(event, ErrorEvent):  # with a param: a knob the model could not honour; without: the server's fault
        raise (
            bad(event.param, event.message)
            if event.param is not None
            else APIError(500, event.message, None, "generation_failed", "server_error")
        )


def check_alive(served) -> None:
    """A 503 when the model's decoder has stopped: its rows were told so, but a request whose row
    it never took must not wait for ever."""
    if not served.scheduler.alive:
        raise unavailable(served.scheduler.failure or "the model's decoder has stopped")


async def decode(served, plan: Plan, outbox: Outbox, is_disconnected: Callable[[], Awaitable[bool]]) -> None:
    """Every choice decoded to its end, or until the client has gone."""
    left, checked = len(plan.choices), time.monotonic()
    with start_rows(served, plan, outbox) as events:
        while left:
            if time.monotonic() - checked > 0.25:  # tokens may keep the queue from ever timing out
                if await is_disconnected():
                    return
                checked = time.monotonic()
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                check_alive(served)
                continue
            record(plan, index, event)
            left -= isinstance(event, DoneEvent)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def sse_events(served, plan: Plan, outbox: Outbox, prompt_parts: dict | None) -> AsyncIterator[str]:
    """Server-sent events: a chunk per token per choice, a last one with the finish reason, usage if asked, [DONE]."""
    r, tok, left = plan.request, served.tokenizer, len(plan.choices)
    pending: list[str] = []  # chunks of the events taken from the queue, not yet written
    with start_rows(served, plan, outbox) as events:  # left when the client disconnects too
        try:
            first = {"warnings": plan.warnings} if plan.warnings else {}
            for c in plan.choices if r.echo or first else ():  # a chunk each for the echoed prompt or warnings
                part = (prompt_parts or {}).get(c.index)
                lp = logprobs_json(c, tok, prompt_part=part) if part is not None else None
                yield sse(response_json(plan, served.name, [choice_json(c, c.prompt if r.echo else "", lp) | first]))
            while left:
                # every event already waiting goes out in one write: when the loop falls behind the
                # decoding thread (16 streams), a write per token would cost more than the token
                ready = [await events.get()]  # a stopped decoder fails its rows: an event always comes
                while not events.empty():
                    ready.append(events.get_nowait())
                for index, event in ready:
                    record(plan, index, event)
                    c, final = plan.choices[index], ends_row(event)
                    left -= final
                    lp = None
                    if r.logprobs is not None and not final:
                        lp = logprobs_json(c, tok, start=len(c.tokens) - 1, offset=len(c.prompt) if r.echo else 0)
                    choice = choice_json(c, new_text(c, tok, plan.stops, final), lp, final)
                    pending.append(sse(response_json(plan, served.name, [choice])))
                yield "".join(pending)
                pending.clear()
            if r.stream_options is not None and r.stream_options.include_usage:
                yield sse(response_json(plan, served.name, [], usage=usage(plan)))
            yield "data: [DONE]\n\n"
        except APIError as exc:  # the chunks before the failed event still go out, then the error
            yield "".join(pending) + sse(exc.body()) + "data: [DONE]\n\n"


# -------------------------------------------------------------------------------- entry points
async def complete(served, plan: Plan, outbox: Outbox, is_disconnected: Callable[[], Awaitable[bool]]) -> dict:
    """The whole response: the prompt scored (with echo and logprobs), the choices decoded (nothing
    with max_tokens 0), by beam search or on the scheduler's rows."""
    prompt_parts = None if plan.scores_in_prefill else await echo_logprobs(served, plan)
    if not plan.scoring_only:
        await (beam(served, plan) if plan.beam else decode(served, plan, outbox, is_disconnected))
        if plan.scores_in_prefill:
            prompt_parts = {c.index: c.prompt_part for c in plan.choices}
        ended = [c for c in plan.choices if c.finish_reason == "stop_token"]
        if prompt_parts is not None and ended:  # scoring: the stop token that ended a choice is listed too
            for c in ended:
                if c.stop_scored is not None:
                    c.stop = (c.stop_scored.token, c.stop_scored.logprob, c.stop_scored.top or [])
            unscored = [c for c in ended if c.stop is None]  # beams: their stop ids are not reported
            if unscored:
                stops = await served.on_model_thread("stop_tokens", unscored, plan.request.logprobs, param="prompt")
                for c, stop in zip(unscored, stops):
                    c.stop = stop
    scored = sum(len(c.echo_ids) for c in plan.choices) if prompt_parts is not None else 0
    return completion_json(plan, served.tokenizer, served.name, prompt_parts, lazy=scored > JSON_SLICE)


def dumps(value) -> bytes:
    """Compact UTF-8 JSON, as Starlette's JSONResponse writes it, by orjson: a scored prompt's
    16,384 entries take a tenth of json's time to encode, time in which no stream moves. A lazy
    sequence (``Mapped``, ``Chained``) is written as the list it reads as."""
    return orjson.dumps(value, default=list)


def has_long_list(value) -> bool:
    """Whether ``value`` holds a list longer than a slice (then ``json_body`` writes it)."""
    if isinstance(value, dict):
        return any(has_long_list(v) for v in value.values())
    if isinstance(value, Sequence) and not isinstance(value, str):
        return len(value) > JSON_SLICE or any(has_long_list(v) for v in value)
    return False


def json_parts(value):
    """``value`` as JSON text in parts; None between two slices of a long list (``json_body``)."""
    if not has_long_list(value):
        yield dumps(value)
    elif isinstance(value, dict):
        yield b"{"
        for n, (key, item) in enumerate(value.items()):
            yield (b"," if n else b"") + dumps(key) + b":"
            yield from json_parts(item)
        yield b"}"
    elif len(value) > JSON_SLICE:  # a long list of short items
        yield b"["
        for a in range(0, len(value), JSON_SLICE):
            yield (b"," if a else b"") + dumps(list(value[a : a + JSON_SLICE]))[1:-1]
            yield None
        yield b"]"
    else:  # a short list holding a long one
        yield b"["
        for n, item in enumerate(value):
            yield b"," if n else b""
            yield from json_parts(item)
        yield b"]"


async def json_body(body: dict) -> AsyncIterator[bytes]:
    """A large response (a scored prompt's log probabilities, scores of a long text) built and
    written a slice at a time, the event loop free between slices: the whole of it at once is
    hundreds of milliseconds in which no stream moves and no request is read."""
    pending: list[bytes] = []
    for part in json_parts(body):
        if part is not None:
            pending.append(part)
            continue
        yield b"".join(pending)
        pending.clear()
        await asyncio.sleep(0)
    yield b"".join(pending)


async def sse_stream(served, plan: Plan, outbox: Outbox) -> AsyncIterator[str]:
    """The response as server-sent events. The prompt is scored (with echo and logprobs) before the
    first event, so a prompt it cannot score is an HTTP error, not an event."""
    return sse_events(served, plan, outbox, await echo_logprobs(served, plan))
