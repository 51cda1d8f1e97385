"""``POST /v1/tinylm/lens``: the logit lens of a served GPT over a text (``evaluation.lens``), as
JSON for the playground's "Logit lens" view: per layer and position, the most likely next tokens
and the probability of the token that actually follows.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from tinylm.errors import TinyLMError
from tinylm.evaluation.lens import check_layered, logit_lens
from tinylm.serving.completions import bad
from tinylm.serving.schemas import Strict
from tinylm.serving.state import StateDep

router = APIRouter()


class LensRequest(Strict):
    model: str | None = None
    text: str = Field(description="the text to read the model's layers on")
    top: int = Field(5, ge=1, le=20, description="tokens kept per cell, most likely first")


def lens_json(served, text: str, top: int) -> dict:
    """The lens of ``served`` over its start token and ``text`` (``ServedModel.fit_text``), on the
    model's thread; a model without layers is refused by name."""
    try:
        check_layered(served.model)
    except TinyLMError as exc:
        raise bad("model", f"{served.name}: {exc}", "model_has_no_layers") from exc
    ids, notes = served.fit_text(text)
    grid = logit_lens(served.model, ids, top)
    shown = sorted({i for row in grid.top_ids for cell in row for i in cell})
    labels = {piece["id"]: piece["text"] for piece in served.pieces(shown)}
    return {
        "tokens": served.pieces(grid.ids),
        "layers": grid.layers,
        "top": [
            [
                [{"id": i, "text": labels[i], "p": round(p, 6)} for i, p in zip(ids_, probs)]
                for ids_, probs in zip(row_ids, row_probs)
            ]
            for row_ids, row_probs in zip(grid.top_ids, grid.top_probs)
        ],
        "next_p": [[None if p is None else round(p, 6) for p in row] for row in grid.next_probs],
        "warnings": notes,
    }


@router.post("/v1/tinylm/lens")
async def lens(body: LensRequest, state: StateDep):
    served = state.model(body.model)
    if not body.text:
        raise bad("text", "must not be empty", "empty_text")
    return {"model": served.name, **await served.on_model_thread(lens_json, body.text, body.top)}
