"""``POST /v1/tinylm/score``: several served models on the same text, byte by byte (the page's
"Compare models" view, and a notebook's numbers).

Each model scores the text as ``tinylm evaluate`` scores a document (tinylm.evaluation.byte_bits):
per token its bits, its byte and character span and the model's top predictions there; per byte
and per character the bits spent on it. A model's ``byte_bits`` sum, over the text's bytes, is its
``tinylm evaluate`` bits per byte on a file holding the text. Models with different tokenizers
line up on the characters: a token's bits are spread over its bytes.
"""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter
from pydantic import Field

from tinylm.errors import TinyLMError
from tinylm.evaluation.byte_bits import char_bits, char_offsets, char_span, score_bytes
from tinylm.serving.completions import bad, check_scored
from tinylm.serving.models import ServedModel, score_batch
from tinylm.serving.schemas import Strict
from tinylm.serving.state import ServerState, StateDep, large_json

router = APIRouter()
MAX_TOP = 20


class CompareRequest(Strict):
    models: list[str] | None = Field(None, description="the served models to score with (default: all)")
    text: str = Field(description="the text (one document) every model scores")
    top: int = Field(
        5, description=f"how many of each model's most likely tokens to return per position (0..{MAX_TOP})"
    )


def _rounded(values, digits: int = 6) -> list[float]:
    return [round(float(v), digits) for v in values]


def model_scores(served: ServedModel, text: str, top: int, max_tokens: int | None = None) -> dict:
    """One model's per-token, per-byte and per-character bits of ``text`` (on the model's thread);
    more than ``max_tokens`` tokens is a 413 (a text has at most a token per byte, and one start
    token: only a longer text is counted)."""
    tok = served.tokenizer
    if max_tokens is not None and len(text.encode("utf-8")) + 1 > max_tokens:
        check_scored(len(tok.encode(text)), max_tokens, "text")
    batch = score_batch(served.context_length, served.vocab_size)
    scored = score_bytes(served.model, tok, text, top, batch)
    offsets = char_offsets(text)
    for i, lp, (start, _) in zip(scored.ids, scored.token_logprobs, scored.spans):
        if lp is not None and not math.isfinite(lp):  # JSON has no infinity, and no sum would mean anything
            raise TinyLMError(
                f"{served.name} gives the token {tok.decode([i])!r} at byte {start} probability 0 "
                "(infinitely many bits); compare on a text without it"
            )
    tokens = []
    for piece, (start, end), lp, alternatives in zip(
        served.pieces(scored.ids), scored.spans, scored.token_logprobs, scored.top
    ):
        c0, c1 = char_span((start, end), offsets)
        tokens.append(
            {
                **piece,
                "start": start,
                "end": end,
                "char_start": c0,
                "char_end": c1,
                "bits": None if lp is None else round(-lp / math.log(2), 6),
                "top": [{"id": i, "text": tok.decode([i]), "prob": round(math.exp(v), 6)} for i, v in alternatives],
            }
        )
    return {
        "model": served.name,
        "tokenizer": getattr(tok, "type_name", type(tok).__name__),
        "tokens": tokens,
        "bits": scored.bits,
        "bpb": scored.bpb,
        "byte_bits": _rounded(scored.byte_bits),
        "char_bits": _rounded(char_bits(scored.byte_bits, offsets)),
    }


def _served(state: ServerState, names: list[str] | None) -> list[ServedModel]:
    if names is None:
        return list(state.models.values())
    if not names:
        raise bad("models", "name at least one model (or leave the field out for all)")
    return [state.model(n) for n in dict.fromkeys(names)]


@router.post("/v1/tinylm/score")
async def compare_scores(body: CompareRequest, state: StateDep):
    if not body.text:
        raise bad("text", "must not be empty", "empty_text")
    if not 0 <= body.top <= MAX_TOP:
        raise bad("top", f"must be between 0 and {MAX_TOP} (got {body.top})")
    limit = state.limits.max_score_tokens
    results = await asyncio.gather(
        *(s.on_model_thread(model_scores, body.text, body.top, limit) for s in _served(state, body.models))
    )
    offsets = char_offsets(body.text)
    result = {
        "object": "tinylm.score",
        "text": body.text,
        "bytes": int(offsets[-1]),
        "chars": len(body.text),
        "char_bytes": [int(b) for b in offsets[1:] - offsets[:-1]],
        "models": list(results),
    }
    return large_json(result)
