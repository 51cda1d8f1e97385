"""`/v1/completions` without the HTTP: a request checked and turned into decoding rows, and the
rows' tokens turned back into OpenAI's response objects (whole, or as stream chunks).

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

import dataclasses
import itertools
import secrets
import time
import warnings
from dataclasses import dataclass, field

from tinylm.config import ConfigError, GenerationConfig, knob_names
from tinylm.errors import TinyLMError
from tinylm.generation.core import fit_prompts
from tinylm.generation.generate import encode_prompt, prompt_head
from tinylm.serving.schemas import CompletionRequest

MAX_LOGPROBS = 20
MAX_STOPS = 16
# GenerationConfig's knob -> the request's field, for the knobs a request carries
REQUEST_FIELDS = knob_names("http")


@dataclass
class Limits:
    max_tokens: int = 512  # max_tokens above this is refused
    max_choices: int = 16  # prompts x n per request
    max_body_bytes: int = 1_000_000


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


@dataclass
class Choice:
    index: int
    prompt: str  # the prompt's text as the reader sees it (for echo)
    prompt_ids: list[int]  # what decoding starts from: the prompt's last context_length ids
    cfg: GenerationConfig
    echo_ids: list[int] = field(default_factory=list)  # every id of the prompt, scored with echo
    stop_id: int | None = None  # the stop token that ended it, as the decoder reports it
    stop: tuple | None = None  # with echo and logprobs: (id, log p, alternatives) of that stop token
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # tinylm's: stop_token | stop_string | length
    seconds: float = 0.0
    shown: str = ""  # text already streamed


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
    text = visible_text(tokenizer.decode_continuation(choice.prompt_ids, choice.tokens), stops, final)
    if len(text) <= len(choice.shown) or not text.startswith(choice.shown):
        return ""
    piece, choice.shown = text[len(choice.shown) :], text
    return piece


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


def prompt_offsets(ids: list[int], tokenizer, pieces: list[str]) -> list[int]:
    """Where each prompt token starts in the prompt's text: len(decode(ids[:k])). When the tokens'
    own texts (``pieces``) add up to the text, their running lengths (no decode per prefix: a
    long echoed prompt would cost quadratic time); otherwise (a character cut between tokens,
    words joined with spaces) prefix by prefix."""
    if "".join(pieces) == tokenizer.decode(ids):
        return list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0))
    return [len(tokenizer.decode(ids[:k])) for k in range(len(ids))]


def logprobs_json(choice: Choice, tokenizer, start: int = 0, offset: int = 0, prompt_part=None) -> dict:
    """OpenAI's legacy completions ``logprobs`` for tokens ``start:``, text offsets from ``offset``
    (with echo, ``prompt_part`` = (tokens, logprobs, tops) of the prompt comes first). OpenAI keys
    the alternatives by their text, which merges tokens of equal text; ``tinylm_top`` lists them
    all with their ids."""

    def top_dict(alternatives):
        d: dict[str, float] = {}
        for i, lp in alternatives:
            d.setdefault(tokenizer.decode([i]), lp)
        return d

    def top_list(alternatives):  # tinylm's: every alternative, also those whose texts are equal
        return [{"id": i, "token": tokenizer.decode([i]), "logprob": lp} for i, lp in alternatives]

    tokens, logprobs, tops, offsets, ids_top = [], [], [], [], []
    if prompt_part is not None:
        ids, lps, alts = prompt_part
        tokens += [tokenizer.decode([i]) for i in ids]
        offsets += [offset + k for k in prompt_offsets(ids, tokenizer, tokens)]
        logprobs += lps
        tops += [top_dict(a) if a is not None else None for a in alts]
        ids_top += [top_list(a) if a is not None else None for a in alts]
        offset += len(tokenizer.decode(ids))
    for k in range(start, len(choice.tokens)):
        offsets.append(offset + len(tokenizer.decode_continuation(choice.prompt_ids, choice.tokens[:k])))
        tokens.append(tokenizer.decode([choice.tokens[k]]))
        logprobs.append(choice.logprobs[k])
        tops.append(top_dict(choice.top[k]))
        ids_top.append(top_list(choice.top[k]))
    if choice.stop is not None:  # the stop token, after the text
        stop, lp, alternatives = choice.stop
        offsets.append(offset + len(tokenizer.decode_continuation(choice.prompt_ids, choice.tokens)))
        tokens.append(tokenizer.decode([stop]))
        logprobs.append(lp)
        tops.append(top_dict(alternatives))
        ids_top.append(top_list(alternatives))
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
        "tinylm_top": ids_top,
    }


def tinylm_part(choice: Choice) -> dict:
    """tinylm's extension of a choice: the token ids (what `tinylm generate --json` prints) and speed."""
    return {
        "token_ids": choice.tokens,
        "finish": choice.finish_reason,
        "seconds": round(choice.seconds, 4),
        "tokens_per_s": round(len(choice.tokens) / choice.seconds, 1) if choice.seconds > 0 else None,
    }


def usage(plan: Plan) -> dict:
    prompt = sum(len(ids) for ids in {c.index // plan.request.n: c.prompt_ids for c in plan.choices}.values())
    completion = sum(len(c.tokens) for c in plan.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_json(plan: Plan, tokenizer, model: str, prompt_parts: dict | None = None) -> dict:
    r = plan.request
    out = []
    for c in plan.choices:
        text = visible_text(tokenizer.decode_continuation(c.prompt_ids, c.tokens), plan.stops, final=True)
        item = {
            "index": c.index,
            "text": (c.prompt if r.echo else "") + text,
            "logprobs": None,
            "finish_reason": finish_reason(c.finish_reason),
            "tinylm": tinylm_part(c),
        }
        if r.logprobs is not None:
            part = prompt_parts.get(c.index) if (r.echo and prompt_parts) else None
            item["logprobs"] = logprobs_json(c, tokenizer, prompt_part=part)
        out.append(item)
    body = {
        "id": plan.id,
        "object": "text_completion",
        "created": plan.created,
        "model": model,
        "choices": out,
        "usage": usage(plan),
        "seed": plan.seed,
    }
    if plan.warnings:
        body["warnings"] = plan.warnings
    return body


def chunk_json(plan: Plan, model: str, index: int, text: str, logprobs=None, finish=None, extra=None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if extra:
        choice.update(extra)
    return {"id": plan.id, "object": "text_completion", "created": plan.created, "model": model, "choices": [choice]}
