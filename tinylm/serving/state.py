"""What every route of the server shares, and the one dependency that hands it to them.

``ServerState`` holds the served models by name, the engine they run in (``engine.py``), the
limits, the runs directory (``--runs``) and an Outbox per event loop. ``create_app`` puts it on
``app.state.server``; a route asks for it with a ``state: StateDep`` parameter. This module
imports no router, so every router can import it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse

from tinylm.serving.completions import APIError, Limits, Outbox, bad, dumps, has_long_list, json_body, unavailable
from tinylm.serving.engine import LocalEngine, ProcessEngine
from tinylm.serving.models import ServedModel


@dataclass
class RunsRoot:
    """The directory of runs a server shows, and the checkpoints it loaded from them (path -> name)."""

    root: Path
    max_batch: int = 32
    loaded: dict[str, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ServerState:
    """The served models (by name; a checkpoint loaded from a run joins them while the server runs),
    their engine (default: this process), the limits, the runs directory if any, and an Outbox per
    event loop (by id)."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        limits: Limits,
        runs: RunsRoot | None = None,
        engine: ProcessEngine | LocalEngine | None = None,
    ):
        self.models, self.limits, self.runs = models, limits, runs
        self.engine = engine or LocalEngine()
        self.outboxes: dict[int, Outbox] = {}

    def model(self, name: str | None) -> ServedModel:
        """The served model called ``name``; ``None`` names the only one. 404 for an unknown name,
        503 while the engine is down."""
        if self.engine.down is not None:
            raise unavailable(self.engine.down, self.engine.retry_after)
        models = self.models
        if not models:  # `tinylm serve --runs DIR` alone, before a checkpoint was loaded
            raise APIError(
                404,
                "no model is served yet: load a run's checkpoint (the Runs view, or POST /v1/tinylm/runs/load)",
                "model",
                "model_not_found",
            )
        if name is None and len(models) == 1:
            return next(iter(models.values()))
        if name is None:
            raise bad("model", f"several models are served ({', '.join(models)}); name one", "model_required")
        if name in models:
            return models[name]
        raise APIError(
            404, f"the model '{name}' does not exist; served: {', '.join(models)}", "model", "model_not_found"
        )

    def outbox(self) -> Outbox:
        """The running event loop's Outbox (a test client and uvicorn each run their own loop)."""
        loop = asyncio.get_running_loop()
        return self.outboxes.setdefault(id(loop), Outbox(loop))


async def server_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain `def` dependency on its thread pool, a hop on every request
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(server_state)]


def large_json(body: dict) -> Response:
    """A body that may be large (scores, a scored prompt's log probabilities): JSON written a slice
    at a time (``completions.json_body``) when it holds a long list, else at once (by ``dumps``,
    which reads the lazy lists a response built for slices holds when each of them is short)."""
    if has_long_list(body):
        return StreamingResponse(json_body(body), media_type="application/json")
    return Response(dumps(body), media_type="application/json")
