"""The HTTP side: FastAPI routes, OpenAI's error shape, the body-size limit and the API key.

Routes: ``GET /`` (the page), ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}`` (with
tinylm's model card), ``POST /v1/completions`` (OpenAI's legacy completions, streamed as
server-sent events when asked), ``POST /v1/chat/completions`` (refused: these are base models),
``POST /v1/tokenize``, ``/v1/detokenize``, ``/v1/attention`` and ``/v1/score``.

Every error, whatever raised it, is answered as {"error": {"message", "type", "param", "code"}}:
400 for a bad value or invalid JSON, 401 for a missing or wrong API key, 404 for an unknown model
or route, 413 for a body over the limit, 422 for a field of the wrong type, 500 for a failure of
the server itself (which keeps serving). The routes reach the models through ``app.state.server``.
"""

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from tinylm.errors import TinyLMError
from tinylm.generation.generate import generate_many
from tinylm.serving.completions import (
    APIError,
    Limits,
    Plan,
    bad,
    chunk_json,
    completion_json,
    finish_reason,
    logprobs_json,
    new_text,
    plan_completion,
    tinylm_part,
    usage,
)
from tinylm.serving.compare import router as compare_router
from tinylm.serving.lens import router as lens_router
from tinylm.serving.models import ServedModel
from tinylm.serving.runs import RunsRoot, router as runs_router
from tinylm.serving.scheduler import DoneEvent, ErrorEvent, Row, TokenEvent
from tinylm.serving.schemas import CompletionRequest, DetokenizeRequest, TextRequest

log = logging.getLogger("tinylm")
STATIC = Path(__file__).parent / "static"
CHAT_REFUSAL = (
    "tinylm serves base language models (no instruction tuning, no chat template), so there is "
    "no honest way to answer chat messages; use /v1/completions with a prompt to continue"
)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        exc.body(), status_code=exc.status, headers={"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    )


class Outbox:
    """Events from the decoding thread to the requests' queues on the event loop: one wake-up of
    the loop carries every event of a step (a wake-up per token per row costs more than the
    event itself when 16 streams decode together)."""

    def __init__(self, loop):
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


class BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is a 413, whether Content-Length says so up
    front or the bytes keep coming (chunked)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await error_response(APIError(400, "invalid Content-Length header", None, "invalid_request"))(
                    scope, receive, send
                )
            if int(declared) > self.limit:
                return await error_response(self._too_large())(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than this server's limit of {self.limit} bytes", None, "request_too_large"
        )


class ApiKey:
    """ASGI middleware: every /v1 call needs `Authorization: Bearer KEY` (the page and /health do
    not). Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would copy every streamed
    chunk through an extra in-memory stream."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    401, "missing or wrong API key (send Authorization: Bearer KEY)", None, "invalid_api_key"
                )
                return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class ServerState:
    """What the routes share: the served models (by name), the limits, an Outbox per event loop (by id)."""

    def __init__(self, models: dict[str, ServedModel], limits: Limits):
        self.models, self.limits, self.outboxes = models, limits, {}

    # for the routers of other modules (lens, runs), which cannot import this one
    def model(self, name: str | None) -> ServedModel:
        return get_model(self, name)

    async def on_model_thread(self, served: ServedModel, fn, param: str = "text"):
        return await on_model_thread(served, fn, param)


async def server_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain `def` dependency on its thread pool, a hop on every request
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(server_state)]
router = APIRouter()


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = next(iter(exc.errors()), {})
    if first.get("type") == "json_invalid":
        return error_response(
            APIError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', '')})", None, "invalid_json")
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "the body"
    if first.get("type") == "extra_forbidden":
        return error_response(
            APIError(400, f"unrecognized request argument supplied: {where}", param, "unknown_parameter")
        )
    return error_response(APIError(422, f"{where}: {first.get('msg', 'invalid')}", param, first.get("type")))


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    """Ours as raised; Starlette's (404, 405, 413) by status; anything else a 500, logged."""
    if isinstance(exc, HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        exc = APIError(exc.status_code, str(exc.detail), None, code)
    elif not isinstance(exc, APIError):
        log.exception("request failed")
        exc = APIError(500, f"internal error: {type(exc).__name__}", None, "internal_error", "server_error")
    return error_response(exc)


def get_model(state: ServerState, name: str | None) -> ServedModel:
    models = state.models
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
    raise APIError(404, f"the model '{name}' does not exist; served: {', '.join(models)}", "model", "model_not_found")


async def on_model_thread(served: ServedModel, fn, param: str = "text"):
    try:
        return await asyncio.wrap_future(served.scheduler.submit(fn))
    except TinyLMError as exc:
        raise bad(param, str(exc)) from exc
    except ValueError as exc:  # knobs that leave no token allowed at some step name themselves
        raise APIError(400, str(exc), None, "invalid_value") from exc


def model_object(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "tinylm"}


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(STATIC / "index.html")


@router.get("/favicon.ico", include_in_schema=False)
async def favicon():
    return Response(status_code=204)


@router.get("/health")
async def health(state: StateDep):
    dead = [name for name, s in state.models.items() if not s.scheduler.alive]
    body = {
        "status": "ok" if not dead else "unhealthy",
        "models": list(state.models),
        "active_rows": {name: s.scheduler.active for name, s in state.models.items()},
    }
    return JSONResponse(body, status_code=503 if dead else 200)


@router.get("/v1/models")
async def list_models(state: StateDep):
    return {"object": "list", "data": [model_object(s) for s in state.models.values()]}


@router.get("/v1/models/{name}")
async def get_model_card(name: str, state: StateDep):
    served = get_model(state, name)
    return {**model_object(served), "card": served.card()}


@router.get("/v1/models/{name}/curves.png")
async def curves(name: str, state: StateDep):
    png = get_model(state, name).curves_png()
    if png is not None:
        return FileResponse(png, media_type="image/png")
    raise APIError(404, f"the model '{name}' has no training curves (not a tinylm run directory)", None, "not_found")


@router.post("/v1/chat/completions")
async def chat():
    raise APIError(404, CHAT_REFUSAL, "messages", "chat_not_supported")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: StateDep):
    served = get_model(state, body.model)
    if not getattr(served.model, "generates", True):  # an n-gram or bigram, served for scoring
        raise bad(
            "model",
            f"'{served.name}' ({served.model.config.described}) is served for scoring only",
            "model_cannot_generate",
        )
    plan = plan_completion(served, body, state.limits)
    prompt_parts = await echo_logprobs(served, plan) if body.echo and body.logprobs is not None else None
    if plan.scoring_only:  # max_tokens 0 with echo: the prompt and its log probabilities, nothing decoded
        return completion_json(plan, served.tokenizer, served.name, prompt_parts)
    if body.stream and not plan.beam:
        return StreamingResponse(
            stream(state, served, plan, prompt_parts),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    await (beam(served, plan) if plan.beam else decode(state, served, plan, request))
    ended = [c for c in plan.choices if c.finish_reason == "stop_token"]
    if prompt_parts is not None and ended:  # scoring: the stop token that ended a choice is listed too
        await on_model_thread(served, lambda: served.list_stop_tokens(ended, body.logprobs), "prompt")
    return completion_json(plan, served.tokenizer, served.name, prompt_parts)


async def echo_logprobs(served: ServedModel, plan: Plan) -> dict:
    """With echo and logprobs: every prompt token's log probability (the first has none), the
    distinct prompts of the request scored together."""
    rows = list(dict.fromkeys(tuple(c.echo_ids) for c in plan.choices))
    scored = await on_model_thread(
        served, lambda: served.rows_logprobs([list(r) for r in rows], plan.request.logprobs), "prompt"
    )
    parts = {r: (list(r), [None] + [lp for lp, _ in s], [None] + [a for _, a in s]) for r, s in zip(rows, scored)}
    return {c.index: parts[tuple(c.echo_ids)] for c in plan.choices}


async def beam(served: ServedModel, plan: Plan) -> None:
    """Beam search on the model's thread, one prompt at a time (as `tinylm generate` does)."""
    top, n = plan.request.logprobs or 0, plan.request.n

    def run(choices):
        t0 = time.perf_counter()
        results = generate_many(served.model, [choices[0].prompt_ids], choices[0].cfg, served.tokenizer.decode)
        seconds = time.perf_counter() - t0
        for c, g in zip(choices, results):
            c.tokens, c.finish_reason, c.seconds = g.tokens, g.finish_reason, seconds
            if plan.request.logprobs is not None and g.tokens:
                scored = served.sequence_logprobs(c.prompt_ids + g.tokens, top)[len(c.prompt_ids) - 1 :]
                c.logprobs, c.top = [lp for lp, _ in scored], [a for _, a in scored]

    for first in range(0, len(plan.choices), n):  # prompt i's n beams are choices i * n .. i * n + n - 1
        await on_model_thread(served, lambda choices=plan.choices[first : first + n]: run(choices), "prompt")


@contextlib.contextmanager
def start_rows(state: ServerState, served: ServedModel, plan: Plan):
    """A scheduler row per choice, its events on the yielded queue as (index, event), until the block is left."""
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    outbox = state.outboxes.setdefault(id(loop), Outbox(loop))
    rows = [
        Row(
            c.prompt_ids,
            c.cfg,
            lambda event, index=c.index: outbox.put(events, (index, event)),
            served.tokenizer.decode,
            plan.request.logprobs,
        )
        for c in plan.choices
    ]
    for row in rows:
        served.scheduler.add(row)
    try:
        yield events
    finally:
        for row in rows:
            row.cancel()


def record(plan: Plan, index: int, event) -> None:
    c = plan.choices[index]
    if isinstance(event, TokenEvent):
        c.tokens.append(event.token)
        c.logprobs.append(event.logprob)
        c.top.append(event.top or [])
    elif isinstance(event, DoneEvent):
        c.finish_reason, c.seconds, c.stop_id = event.finish_reason, event.seconds, event.stop_token
    elif isinstance(event, ErrorEvent):  # with a param: a knob the model could not honour; without: the server's fault
        raise (
            bad(event.param, event.message)
            if event.param is not None
            else APIError(500, event.message, None, "generation_failed", "server_error")
        )


async def decode(state: ServerState, served: ServedModel, plan: Plan, request: Request) -> None:
    left, checked = len(plan.choices), time.monotonic()
    with start_rows(state, served, plan) as events:
        while left:
            if time.monotonic() - checked > 0.25:  # tokens may keep the queue from ever timing out
                if await request.is_disconnected():
                    return
                checked = time.monotonic()
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                continue
            record(plan, index, event)
            left -= isinstance(event, DoneEvent)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream(state: ServerState, served: ServedModel, plan: Plan, prompt_parts):
    """Server-sent events: a chunk per token per choice, a last one with the finish reason, usage if asked, [DONE]."""
    r, tok, left = plan.request, served.tokenizer, len(plan.choices)
    pending: list[str] = []  # chunks of the events taken from the queue, not yet written
    with start_rows(state, served, plan) as events:  # left when the client disconnects too
        try:
            first = {"warnings": plan.warnings} if plan.warnings else None
            for c in plan.choices if r.echo or first else ():  # a chunk each for the echoed prompt or warnings
                part = prompt_parts.get(c.index) if r.echo and prompt_parts else None
                lp = logprobs_json(c, tok, prompt_part=part) if part is not None else None
                yield sse(chunk_json(plan, served.name, c.index, c.prompt if r.echo else "", lp, extra=first))
            while left:
                # every event already waiting goes out in one write: when the loop falls behind the
                # decoding thread (16 streams), a write per token would cost more than the token
                ready = [await events.get()]
                while not events.empty():
                    ready.append(events.get_nowait())
                for index, event in ready:
                    record(plan, index, event)
                    c = plan.choices[index]
                    if isinstance(event, TokenEvent):
                        lp = (
                            logprobs_json(c, tok, start=len(c.tokens) - 1, offset=len(c.prompt) if r.echo else 0)
                            if r.logprobs is not None
                            else None
                        )
                        text = new_text(c, tok, plan.stops, False)
                        pending.append(sse(chunk_json(plan, served.name, index, text, lp)))
                    else:
                        left -= 1
                        text = new_text(c, tok, plan.stops, True)
                        pending.append(
                            sse(
                                chunk_json(
                                    plan,
                                    served.name,
                                    index,
                                    text,
                                    None,
                                    finish_reason(c.finish_reason),
                                    {"tinylm": tinylm_part(c)},
                                )
                            )
                        )
                yield "".join(pending)
                pending.clear()
            if r.stream_options is not None and r.stream_options.include_usage:
                yield sse(
                    {
                        "id": plan.id,
                        "object": "text_completion",
                        "created": plan.created,
                        "model": served.name,
                        "choices": [],
                        "usage": usage(plan),
                    }
                )
            yield "data: [DONE]\n\n"
        except APIError as exc:  # the chunks before the failed event still go out, then the error
            yield "".join(pending) + sse(exc.body())


@router.post("/v1/tokenize")
async def tokenize(body: TextRequest, state: StateDep):
    served = get_model(state, body.model)
    ids = list(served.tokenizer.encode(body.text))
    return {
        "model": served.name,
        "count": len(ids),
        "ids": ids,
        "tokens": served.pieces(ids),
        "bos_id": served.tokenizer.bos_id,
        "context_length": served.context_length,
    }


@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep):
    served = get_model(state, body.model)
    served.check_ids(body.tokens, "tokens")
    return {"model": served.name, "text": served.tokenizer.decode(body.tokens)}


async def on_text(state: ServerState, body: TextRequest, method: str) -> dict:
    """``served.<method>(text)`` on the model's thread, for a non-empty text."""
    served = get_model(state, body.model)
    if not body.text:
        raise bad("text", "must not be empty", "empty_text")
    return {"model": served.name, **await on_model_thread(served, lambda: getattr(served, method)(body.text))}


@router.post("/v1/attention")
async def attention(body: TextRequest, state: StateDep):
    return await on_text(state, body, "attention")


@router.post("/v1/score")
async def score(body: TextRequest, state: StateDep):
    return await on_text(state, body, "score")


def create_app(
    models: dict[str, ServedModel],
    limits: Limits | None = None,
    api_key: str | None = None,
    runs: RunsRoot | None = None,
) -> FastAPI:
    """The FastAPI application serving ``models`` (name -> ServedModel) and, with ``runs``, the runs under it."""
    limits = limits or Limits()
    app = FastAPI(
        title="tinylm",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        exception_handlers={
            APIError: on_error,
            HTTPException: on_error,
            Exception: on_error,
            RequestValidationError: on_validation_error,
        },
    )
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(router)
    app.include_router(compare_router)
    app.include_router(lens_router)
    app.include_router(runs_router)
    app.state.server = ServerState(models, limits)
    app.state.runs = runs
    return app


def serve(
    models: dict[str, ServedModel],
    host: str,
    port: int,
    limits: Limits,
    api_key: str | None,
    runs: RunsRoot | None = None,
) -> None:
    """Run the app with uvicorn until interrupted."""
    import uvicorn  # deferred: only `tinylm serve` needs it

    app = create_app(models, limits, api_key, runs)
    log.info(
        "serving %s on http://%s:%d  (open it in a browser for the playground)",
        ", ".join(models) + (f" and the runs under {runs.root}" if runs else ""),
        host,
        port,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        for served in models.values():
            served.scheduler.close()
