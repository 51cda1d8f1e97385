"""Request bodies. Pydantic checks the types (a wrong type is a 422 naming the field); the values'
ranges are checked in app.py against the served model (a bad value is a 400 naming the field).

Unknown fields are refused (OpenAI answers "Unrecognized request argument"), so a misspelt knob
is never silently ignored. OpenAI fields tinylm cannot honour are accepted only at their neutral
value (``presence_penalty=0``, ``best_of=n``, ...).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class CompletionRequest(Strict):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    echo: bool = False
    logprobs: int | None = None
    # OpenAI fields accepted at their neutral value only
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None
    # tinylm's other decoding knobs (the options of `tinylm generate`)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    beam_width: int = 1
    length_penalty: float = 1.0


class TextRequest(Strict):
    """tokenize, attention and score: one text; ``model`` may be left out when one model is served."""
    model: str | None = None
    text: str = Field(description="the text to look at")


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
