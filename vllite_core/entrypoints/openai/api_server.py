"""The FastAPI app and its routes, the API-key gate, and running it under uvicorn.

Routes: GET /health /version /metrics /v1/models; POST /v1/completions
/v1/chat/completions /tokenize /detokenize. Every /v1 route needs
``Authorization: Bearer KEY`` when the server has a key. Every error leaves in
OpenAI's shape (errors.py) and the server keeps serving.
"""
from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

import vllite_core
from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.entrypoints.openai.errors import APIError, bad_request, from_exception
from vllite_core.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vllite_core.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vllite_core.entrypoints.openai.serving_chat import ChatServer, render_chat
from vllite_core.entrypoints.openai.serving_common import DEFAULT_MAX_BODY_BYTES, ServerState, read_body
from vllite_core.entrypoints.openai.serving_completions import CompletionServer

logger = logging.getLogger("vllite.server")


class APIKeyMiddleware:
    """Pure ASGI (no response buffering, so streaming and disconnects pass straight through)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                msg = "missing API key" if not got else "incorrect API key"
                await APIError(401, f"{msg}: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                               ).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    state = ServerState(engine, model_names, max_body_bytes, api_key)
    metrics = state.metrics = ServerMetrics(engine, state.model_name)
    completions, chat = CompletionServer(state), ChatServer(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.set_api_thread(threading.get_native_id())
        yield
        engine.close()

    app = FastAPI(title="vllite", version=vllite_core.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.vllite = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> Response:
        err = from_exception(exc)
        if err.status >= 500:
            logger.exception("request failed", exc_info=exc)
        return err.response()

    async def guarded(coro: Any) -> Response:
        try:
            return await coro
        except APIError as e:
            return e.response()
        except Exception as e:  # typed engine errors -> 400; anything else -> 500, logged
            err = from_exception(e)
            if err.status >= 500:
                logger.exception("request failed")
            return err.response()

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return APIError(503, f"engine loop stopped: {engine.dead!r}", code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": vllite_core.__version__}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "vllite",
                 "root": state.model_name, "parent": None, "max_model_len": engine.max_model_len}
                for name in model_names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        async def run() -> Response:
            req = await read_body(request, CompletionRequest, state.max_body_bytes)
            return await completions.create(req, request)
        return await guarded(run())

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        async def run() -> Response:
            req = await read_body(request, ChatCompletionRequest, state.max_body_bytes)
            return await chat.create(req, request)
        return await guarded(run())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def run() -> Response:
            req = await read_body(request, TokenizeRequest, state.max_body_bytes)
            state.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise bad_request("give exactly one of prompt or messages", "prompt")
            if req.messages is not None:
                text = render_chat(engine.tokenizer, req.messages, req.add_generation_prompt)
                ids = engine.tokenize(text, add_special_tokens=bool(req.add_special_tokens))
            else:
                add = True if req.add_special_tokens is None else req.add_special_tokens
                ids = engine.tokenize(req.prompt or "", add_special_tokens=add)
            return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})
        return await guarded(run())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def run() -> Response:
            req = await read_body(request, DetokenizeRequest, state.max_body_bytes)
            state.check_model(req.model)
            vocab = engine.engine.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})", "tokens")
            return JSONResponse({"prompt": engine.detokenize(req.tokens)})
        return await guarded(run())

    from vllite_core.entrypoints.openai.serving_transcription import router as transcription_router

    app.include_router(transcription_router)  # POST /v1/audio/transcriptions (speech models)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def default_model_name(model: str | None) -> str:
    return model if model else "SmolLM2-135M-Instruct"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model (a busy port fails at once) and before uvicorn starts (so
    the printed URL has the real port: ``--port 0`` picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"vllite serve: cannot listen on {host}:{port}: {e.strerror or e}; choose another --port")
    sock.listen(2048)
    return sock


def how_to_query(host: str, port: int, model: str, api_key: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    auth = " -H 'Authorization: Bearer $VLLITE_API_KEY'" if api_key else ""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 32}' % model)
    return (f"vllite: serving {model!r} at {url}/v1 (OpenAI API). Try:\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
            f"or: python examples/openai_client.py --base-url {url}/v1   (Ctrl-C stops the server)")


def serve(engine: AsyncLLM, model_names: list[str], sock: socket.socket, api_key: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info", access_log: bool = True) -> None:
    """Serve on an already bound socket until Ctrl-C / SIGTERM, then stop the engine loop. When the
    engine dies (a fault of no single request), the server stops within seconds and this raises
    SystemExit naming the cause (exit status 1)."""
    import uvicorn

    app = build_app(engine, model_names, api_key, max_body_bytes)
    host, port = sock.getsockname()[:2]
    if host not in ("127.0.0.1", "::1") and not api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach this address can use it", host)
    print(how_to_query(host, port, model_names[0], api_key), flush=True)
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5,
                            lifespan="on")
    t0 = time.monotonic()
    server = uvicorn.Server(config)

    def _engine_died(exc: BaseException) -> None:  # every stream has failed already; a supervisor restarts us
        logger.error("the engine died (%r): the server stops", exc)
        server.should_exit = True

    engine.on_dead.append(_engine_died)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
        logger.info("server stopped after %.0f s", time.monotonic() - t0)
    if engine.dead is not None:  # exit status 1, naming the cause
        raise SystemExit(f"vllite serve: the engine died: {engine.dead!r}")
