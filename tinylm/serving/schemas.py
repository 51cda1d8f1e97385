"""Request bodies. Pydantic checks the types (a wrong type is a 422 naming the field); the values'
ranges are checked in completions.py against the served model (a bad value is a 400 naming the field).

Unknown fields are refused (OpenAI answers "Unrecognized request argument"), so a misspelt knob
is never silently ignored. OpenAI fields tinylm cannot honour are accepted only at their neutral
value (``presence_penalty=0``, ``best_of=n``, ...).
"""

from __future__ import annotations

import re

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from tinylm.config import GenerationConfig, field_types, knob_names

SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value, where: str) -> tuple[str, int] | None:
    """(field, character index) of the first lone surrogate in a request's strings: JSON's \\ud800
    escape reads as one, and no UTF-8 text (a tokenizer's input, a response) can hold it."""
    if isinstance(value, str):
        found = SURROGATE.search(value)
        return (where, found.start()) if found else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((hit for k, v in items if (hit := lone_surrogate(v, f"{where}[{k}]")) is not None), None)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _unicode_text(self):
        for name, value in self:
            hit = lone_surrogate(value, name)
            if hit is not None:  # answered 400, invalid_text (app.on_validation_error)
                raise PydanticCustomError(
                    "lone_surrogate",
                    "{field}: a lone surrogate at character {index} is not Unicode text",
                    {"field": hit[0], "index": hit[1]},
                )
        return self


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAICompletion(Strict):
    """OpenAI's /v1/completions fields, with OpenAI's defaults."""

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
    # accepted at their neutral value only
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None


# vLLM's name for min_new_tokens, so that a client written for vLLM sets the same knob
ALIASES = {"min_new_tokens": "min_tokens"}


def _knob_fields() -> dict:
    """tinylm's other decoding knobs, one field per GenerationConfig field that the request offers
    under its own name (config.GENERATION_SURFACES gives OpenAI's names and what the server sets)."""
    hints, fields = field_types(GenerationConfig), GenerationConfig.__dataclass_fields__
    return {
        name: (
            hints[knob],
            Field(
                fields[knob].default,
                description=fields[knob].metadata["help"],
                validation_alias=AliasChoices(name, ALIASES[name]) if name in ALIASES else None,
            ),
        )
        for knob, name in knob_names("http").items()
        if name not in OpenAICompletion.model_fields
    }


CompletionRequest = create_model("CompletionRequest", __base__=OpenAICompletion, **_knob_fields())


class TextRequest(Strict):
    """tokenize, attention and score: one text; ``model`` may be left out when one model is served."""

    model: str | None = None
    text: str = Field(description="the text to look at")


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
