"""The HTTP side: FastAPI routes, OpenAI's error shape, the body-size limit and the API key.

Routes: ``GET /`` (the page), ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}`` (with
tinylm's model card), ``POST /v1/completions`` (OpenAI's legacy completions, streamed as
server-sent events when asked), ``POST /v1/chat/completions`` (refused: these are base models),
``POST /v1/tokenize``, ``/v1/detokenize``, ``/v1/attention`` and ``/v1/score``.

Every error, whatever raised it, is answered as {"error": {"message", "type", "param", "code"}}:
400 for a bad value or invalid JSON, 401 for a missing or wrong API key, 404 for an unknown model
or route, 413 for a body over the limit, 422 for a field of the wrong type, 500 for a failure of
the server itself (which keeps serving).

A completion goes one way: the route looks the model up and checks the request
(``completions.plan_completion``), then ``completions.complete`` or ``completions.sse_stream`` does
the rest. Every route, here and in the other routers, reaches the models through ``state.StateDep``.
"""

import dataclasses
import errno
import gc
import logging
import secrets
import socket
import threading
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from tinylm.errors import TinyLMError
from tinylm.serving.compare import router as compare_router
from tinylm.serving.completions import (
    RETRY_AFTER,
    APIError,
    Limits,
    bad,
    complete,
    plan_completion,
    sse_stream,
)
from tinylm.serving.engine import LocalEngine, ModelSpecs, ProcessEngine, start_engine
from tinylm.serving.lens import router as lens_router
from tinylm.serving.models import ServedModel
from tinylm.serving.runs import router as runs_router
from tinylm.serving.schemas import CompletionRequest, DetokenizeRequest, TextRequest
from tinylm.serving.state import RunsRoot, ServerState, StateDep, large_json

log = logging.getLogger("tinylm")
STATIC = Path(__file__).parent / "static"
CHAT_REFUSAL = (
    "tinylm serves base language models (no instruction tuning, no chat template), so there is "
    "no honest way to answer chat messages; use /v1/completions with a prompt to continue"
)


def error_response(exc: APIError) -> JSONResponse:
    headers = {}
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if exc.status == 503:  # the openai client and most others wait this long before trying again
        headers["Retry-After"] = str(exc.retry_after or RETRY_AFTER)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


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


router = APIRouter()


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = next(iter(exc.errors()), {})
    if first.get("type") == "json_invalid":
        return error_response(
            APIError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', '')})", None, "invalid_json")
        )
    if first.get("type") == "lone_surrogate":
        field = first["ctx"]["field"]
        return error_response(APIError(400, first["msg"], field.split("[")[0], "invalid_text"))
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
    """200 while every model decodes; 503 with the reason (and Retry-After) the moment the engine
    or a model's decoding thread is gone."""
    engine = state.engine
    stopped = {
        name: s.scheduler.failure or "its decoder has stopped"
        for name, s in state.models.items()
        if not s.scheduler.alive
    }
    body = {
        "status": "ok" if not stopped and engine.down is None else "unhealthy",
        "models": list(state.models),
        "active_rows": {name: s.scheduler.active if name not in stopped else 0 for name, s in state.models.items()},
    }
    if engine.down is not None or stopped:
        body["error"] = engine.down or "; ".join(f"{name}: {why}" for name, why in stopped.items())
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(engine.retry_after)})
    return JSONResponse(body)


@router.get("/v1/models")
async def list_models(state: StateDep):
    """OpenAI's list, and this server's limits (what a request over them is refused for)."""
    return {
        "object": "list",
        "data": [model_object(s) for s in state.models.values()],
        "tinylm_limits": dataclasses.asdict(state.limits),
    }


@router.get("/v1/models/{name}")
async def get_model_card(name: str, state: StateDep):
    served = state.model(name)
    return {**model_object(served), "card": served.card()}


@router.get("/v1/models/{name}/curves.png")
async def curves(name: str, state: StateDep):
    png = state.model(name).curves_png()
    if png is not None:
        return FileResponse(png, media_type="image/png")
    raise APIError(404, f"the model '{name}' has no training curves (not a tinylm run directory)", None, "not_found")


@router.post("/v1/chat/completions")
async def chat():
    raise APIError(404, CHAT_REFUSAL, "messages", "chat_not_supported")


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: StateDep):
    served = state.model(body.model)
    if not getattr(served.model, "generates", True):  # an n-gram or bigram, served for scoring
        raise bad(
            "model",
            f"'{served.name}' ({served.model.config.described}) is served for scoring only",
            "model_cannot_generate",
        )
    plan = plan_completion(served, body, state.limits)
    if body.stream:  # plan_completion refused a stream with beam search or max_tokens 0
        return StreamingResponse(
            await sse_stream(served, plan, state.outbox()),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    # a Response as it is: FastAPI's jsonable_encoder would walk every log probability of a scored prompt
    body = await complete(served, plan, state.outbox(), request.is_disconnected)
    return large_json(body) if body["choices"] and body["choices"][0]["logprobs"] is not None else JSONResponse(body)


@router.post("/v1/tokenize")
async def tokenize(body: TextRequest, state: StateDep):
    served = state.model(body.model)
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
    served = state.model(body.model)
    served.check_ids(body.tokens, "tokens")
    return {"model": served.name, "text": served.tokenizer.decode(body.tokens)}


async def on_text(state: ServerState, body: TextRequest, method: str, *args) -> Response:
    """``served.<method>(text, *args)`` on the model's thread, for a non-empty text; the response
    rendered off the event loop (scores of a long text are megabytes)."""
    served = state.model(body.model)
    if not body.text:
        raise bad("text", "must not be empty", "empty_text")
    return large_json({"model": served.name, **await served.on_model_thread(method, body.text, *args)})


@router.post("/v1/attention")
async def attention(body: TextRequest, state: StateDep):
    return await on_text(state, body, "attention")


@router.post("/v1/score")
async def score(body: TextRequest, state: StateDep):
    return await on_text(state, body, "score", state.limits.max_score_tokens)


def create_app(
    models: dict[str, ServedModel],
    limits: Limits | None = None,
    api_key: str | None = None,
    runs: RunsRoot | None = None,
    engine: ProcessEngine | LocalEngine | None = None,
) -> FastAPI:
    """The FastAPI application serving ``models`` (name -> ServedModel) and, with ``runs``, the runs
    under it; ``engine``: where the models run (default: in this process, as handed over)."""
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
    app.state.server = ServerState(models, limits, runs, engine)
    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """``host:port`` bound and listening, before any model loads: a busy port fails in a moment,
    and ``--port 0`` learns its port here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart finds the port free
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        busy = exc.errno == errno.EADDRINUSE
        raise TinyLMError(
            f"cannot listen on {host}:{port}: "
            + ("the port is in use (another tinylm serve?); choose another --port" if busy else exc.strerror)
        ) from exc
    sock.set_inheritable(True)
    return sock


def serve(
    specs: ModelSpecs,
    host: str,
    port: int,
    limits: Limits,
    api_key: str | None,
    runs: RunsRoot | None = None,
) -> None:
    """Bind the port, load the models in their engine, serve until interrupted, stop the engine.
    An engine that keeps crashing ends the server with a TinyLMError (a non-zero exit)."""
    import uvicorn  # deferred: only `tinylm serve` needs it

    class Server(uvicorn.Server):
        """uvicorn's server that, at the first Ctrl-C or SIGTERM, closes the engine at once: every
        request in flight is answered (a stream: an error event, then [DONE]) before uvicorn waits
        for the connections to close, so none is cut."""

        gave_up: str | None = None

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                threading.Thread(target=engine.close, name="tinylm-close-engine", daemon=True).start()
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has stopped (for an embedding program): here
            # the signal was the order to stop, and it was obeyed, so `tinylm serve` exits 0
            self._captured_signals.clear()

        def give_up(self, reason: str) -> None:  # the engine's reader thread, after too many crashes
            self.gave_up = reason
            self.should_exit = True

    sock = listening_socket(host, port)
    try:
        engine, models = start_engine(specs)
    except BaseException:
        sock.close()
        raise
    app = create_app(models, limits, api_key, runs, engine)
    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    engine.on_give_up = server.give_up
    # the modules, models and tokenizers loaded so far live as long as the server: frozen, a full
    # collection (set off by a scored prompt's hundreds of thousands of small objects) skips them
    gc.freeze()
    log.info(
        "serving %s on http://%s:%d  (open it in a browser for the playground)",
        ", ".join(models) + (f" and the runs under {runs.root}" if runs else ""),
        host,
        sock.getsockname()[1],
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()  # every model it loaded, those loaded from runs too
    if server.gave_up is not None:
        raise TinyLMError(server.gave_up)
