"""The FastAPI app and its routes, the API-key gate, and running it under uvicorn.

Routes: GET /health /version /metrics /v1/models /v1/responses/{id}; POST /v1/completions
/v1/chat/completions /v1/responses /v1/messages /tokenize /detokenize. When the server has a key, every route
except ``OPEN_PATHS`` (health, version, metrics, the OpenAPI schema and docs) needs
``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``). CORS is off unless origins are given; a server bound
to loopback refuses other Host headers (DNS rebinding). Every error leaves in
OpenAI's shape (errors.py) and the server keeps serving. SIGTERM / Ctrl-C drain the
in-flight requests (``serve``).
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import signal
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
from vllite_core.entrypoints.openai.health import DEFAULT_STALL_S, HealthMonitor
from vllite_core.entrypoints.openai.http_protocol import DEFAULT_HEADER_READ_TIMEOUT_S, header_timeout_protocol
from vllite_core.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vllite_core.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vllite_core.entrypoints.openai.protocol_responses import ResponsesRequest
from vllite_core.entrypoints.openai.serving_chat import ChatServer, RenderedChat, render_chat_prompt, rendered_chat_ids
from vllite_core.entrypoints.openai.serving_common import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ServerState,
    read_body,
)
from vllite_core.entrypoints.openai.serving_completions import CompletionServer
from vllite_core.entrypoints.openai.serving_responses import ResponsesServer
from vllite_core.entrypoints.openai.template_sandbox import TemplateLimits, TemplateSandbox

logger = logging.getLogger("vllite.server")

# Routes that stay open when the server has an API key: they run no model and reveal no input.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5


class APIKeyMiddleware:
    """Pure ASGI (no response buffering, so streaming and disconnects pass straight through).
    The key is read from the Authorization header only (never a query parameter, which would
    land in access logs) and compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            headers = dict(scope["headers"])
            got = headers.get(b"authorization", b"")
            x_key = headers.get(b"x-api-key")  # Anthropic's clients send the key here
            if not secrets.compare_digest(got, self.expected) and not (
                    x_key is not None and secrets.compare_digest(b"Bearer " + x_key, self.expected)):
                msg = "missing API key" if not (got or x_key) else "incorrect API key"
                err = APIError(401, f"{msg}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                               code="invalid_api_key")
                await error_response_for(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response_for(path: str, err: APIError) -> Response:
    """``err`` in the shape of the API ``path`` belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    if path.startswith("/v1/messages"):
        from vllite_core.entrypoints.anthropic.protocol import error_response

        return error_response(err)
    return err.response()


def host_name(host_header: str) -> str:
    """The name in a Host header, without the port: ``[::1]:8000`` -> ``::1``."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class HostCheckMiddleware:
    """Refuse requests whose Host is not one of ``hosts`` (any port): a page on a rebound DNS
    name that resolves to 127.0.0.1 sends its own name, so it cannot reach a loopback server."""

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app = app
        self.hosts = {h.lower().strip("[]") for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            got = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(got) not in self.hosts:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                err = APIError(400, f"Host header {got!r} is not allowed on this server (it accepts "
                               f"{', '.join(sorted(self.hosts))})", code="invalid_host")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OriginCheckMiddleware:
    """Refuse a browser's cross-origin POST (it carries an ``Origin`` header; API clients send
    none) unless CORS allows that origin or it is this server's own (its /docs page): a page
    elsewhere cannot drive the model even through the "simple" requests CORS does not stop
    (a multipart upload to /v1/audio/transcriptions)."""

    def __init__(self, app: ASGIApp, allowed_origins: list[str] | None) -> None:
        self.app = app
        self.allowed = {o.rstrip("/").lower() for o in allowed_origins or []}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        safe = scope.get("method") in ("GET", "HEAD", "OPTIONS")
        if scope["type"] == "http" and not safe and "*" not in self.allowed:
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/").lower()
            own = headers.get(b"host", b"").decode("latin-1").lower()
            if origin and origin not in self.allowed and origin.split("://", 1)[-1] != own:
                err = APIError(403, f"cross-origin request from {origin!r} refused (see --allowed-origins)",
                               code="origin_not_allowed")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _NoQueryString(logging.Filter):
    """uvicorn's access log lines without query strings (where secrets get pasted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<query omitted>", *args[3:])
        return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _openapi_body(model: Any) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _tokenize(tokenizer: Any, req: TokenizeRequest, rendered: RenderedChat | None = None) -> list[int]:
    """/tokenize's token ids, on the engine's prep thread. ``messages`` (``rendered`` in the template
    sandbox) are tokenized as chat feeds them to the model (special-token text in content stays
    text), plus the tokenizer's own special tokens (BOS...) only when ``add_special_tokens`` is true."""
    if rendered is not None:
        ids = rendered_chat_ids(tokenizer, rendered)
        if req.add_special_tokens:
            ids = list(tokenizer.build_inputs_with_special_tokens(ids))
        return ids
    add = True if req.add_special_tokens is None else req.add_special_tokens
    return list(tokenizer.encode(req.prompt or "", add_special_tokens=add))


def _detokenize(tokenizer: Any, tokens: list[int], vocab: int) -> str:
    """/detokenize's text, on the engine's prep thread."""
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {vocab})", "tokens")
    return tokenizer.decode(tokens)


async def _async(fn: Any, *args: Any) -> Any:
    return fn(*args)


def build_app(engine: AsyncLLM, model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, *, allowed_origins: list[str] | None = None,
              allowed_methods: list[str] | None = None, allowed_headers: list[str] | None = None,
              allow_credentials: bool = False, allowed_hosts: list[str] | None = None,
              max_waiting_requests: int | None = None, request_timeout: float | None = None,
              body_read_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT_S, enable_docs: bool = True,
              chat_template: str | None = None, reasoning_parser: str | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              loras: Any = None, trust_request_chat_template: bool = False,
              template_limits: TemplateLimits | None = None, health_stall_s: float = DEFAULT_STALL_S) -> FastAPI:
    """``allowed_origins``: CORS on for these (off when None); ``allowed_hosts``: the Host
    header must name one of these (no check when None; ``serve`` passes LOOPBACK_HOSTS on a
    loopback bind). ``chat_template``: the template text (chat_template.load_chat_template);
    ``reasoning_parser``: a name from the vllite_register_reasoning_parsers hook."""
    from vllite_core.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(reasoning_parser, engine.tokenizer) if reasoning_parser else None
    state = ServerState(engine, model_names, max_body_bytes, api_key, max_waiting_requests=max_waiting_requests,
                        request_timeout=request_timeout, body_read_timeout=body_read_timeout,
                        chat_template=chat_template, reasoning_parser=parser, loras=loras,
                        templates=TemplateSandbox(template_limits),
                        trust_request_chat_template=trust_request_chat_template)
    state.enable_auto_tool_choice = enable_auto_tool_choice
    if tool_call_parser is not None:
        from vllite_core.plugins.manager import get_plugin_manager
        from vllite_core.tool_parsers import load_tool_parsers

        parsers = load_tool_parsers(get_plugin_manager())
        if tool_call_parser not in parsers:
            raise SystemExit(f"vllite serve: --tool-call-parser {tool_call_parser!r} is unknown "
                             f"(known: {', '.join(sorted(parsers))})")
        state.tool_parser = parsers[tool_call_parser]
    metrics = state.metrics = ServerMetrics(engine, state.model_name)
    completions, chat, responses = CompletionServer(state), ChatServer(state), ResponsesServer(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.set_api_thread(threading.get_native_id())
        state.templates.start()
        yield
        state.templates.close()
        engine.close()

    app = FastAPI(title="vllite", version=vllite_core.__version__, lifespan=lifespan,
                  docs_url="/docs" if enable_docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if enable_docs else None)
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
            if err.code == "request_failed":  # the engine logged the cause already; no traceback here
                logger.error("%s", err.message)
            elif err.status >= 500:
                logger.exception("request failed")
            return err.response()

    monitor = HealthMonitor(engine, health_stall_s)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return APIError(503, f"engine loop stopped: {engine.dead!r}", code="engine_dead").response()
        if engine.restarting is not None:
            return APIError(503, f"the engine core is restarting after it died: {engine.restarting}",
                            code="engine_restarting").response()
        problem = monitor.problem()
        if problem is not None:
            return APIError(503, problem, code="engine_stalled").response()
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
        if loras is not None:  # adapters, each with its parent (the base model)
            data += loras.models(state.created, engine.max_model_len)
        return {"object": "list", "data": data}

    async def body(request: Request, model: Any) -> Any:
        return await read_body(request, model, state.max_body_bytes, state.body_read_timeout)

    @app.post("/v1/completions", openapi_extra=_openapi_body(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        async def run() -> Response:
            state.admit()
            req = await body(request, CompletionRequest)
            return await completions.create(req, request)
        return await guarded(run())

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatCompletionRequest))
    async def create_chat_completion(request: Request) -> Response:
        async def run() -> Response:
            state.admit()
            req = await body(request, ChatCompletionRequest)
            return await chat.create(req, request)
        return await guarded(run())

    @app.post("/v1/responses", openapi_extra=_openapi_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        async def run() -> Response:
            state.admit()
            req = await body(request, ResponsesRequest)
            return await responses.create(req, request)
        return await guarded(run())

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return await guarded(_async(responses.retrieve, response_id))

    @app.post("/tokenize", openapi_extra=_openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        async def run() -> Response:
            req = await body(request, TokenizeRequest)
            state.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise bad_request("give exactly one of prompt or messages", "prompt")
            rendered = None
            if req.messages is not None:  # the template renders in its sandbox
                rendered = await state.within_timeout(render_chat_prompt(
                    state.templates, engine.tokenizer, req, False, state.chat_template,
                    trust_request_template=state.trust_request_chat_template))
            # CPU work: off the event loop
            ids = await state.within_timeout(engine.run_prep(_tokenize, engine.prep_tokenizer, req, rendered))
            return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})
        return await guarded(run())

    @app.post("/detokenize", openapi_extra=_openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        async def run() -> Response:
            req = await body(request, DetokenizeRequest)
            state.check_model(req.model)
            # Decoding holds the GIL (1.3 s for 800k ids here, stalling every thread): at most what one
            # sequence can hold, decoded on the prep thread.
            if len(req.tokens) > engine.max_model_len:
                raise bad_request(f"at most {engine.max_model_len} token ids (the model's context), got "
                                  f"{len(req.tokens)}", "tokens")
            text = await engine.run_prep(_detokenize, engine.prep_tokenizer, req.tokens, engine.engine.vocab_size)
            return JSONResponse({"prompt": text})
        return await guarded(run())

    if loras is not None and loras.runtime_updates:
        from vllite_core.entrypoints.openai.serving_lora import add_runtime_routes

        loras.served_names |= set(model_names)
        add_runtime_routes(app, loras, body)  # only when the operator allowed runtime adapter updates

    from vllite_core.entrypoints.openai.serving_dev import add_dev_routes, dev_mode_enabled

    if dev_mode_enabled():  # /sleep /wake_up /is_sleeping /reset_prefix_cache /collective_rpc (vLLM's dev routes)
        add_dev_routes(app, engine)
    from vllite_core.entrypoints.anthropic.serving import add_routes as add_anthropic_routes

    add_anthropic_routes(app, state, chat, body)  # POST /v1/messages, /v1/messages/count_tokens (Anthropic's API)
    from vllite_core.entrypoints.openai.serving_transcription import router as transcription_router

    app.include_router(transcription_router)  # POST /v1/audio/transcriptions (speech models)
    from vllite_core.entrypoints.openai.serving_pooling import OPENAPI_MODELS as pooling_models
    from vllite_core.entrypoints.openai.serving_pooling import router as pooling_router

    app.include_router(pooling_router)  # /v1/embeddings /pooling /classify /score /rerank (pooling models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest,
                      *pooling_models):
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # Added innermost first: the host check runs before CORS, CORS (preflights) before the
    # origin check and the key.
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(OriginCheckMiddleware, allowed_origins=allowed_origins)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=allowed_methods or ["*"],
                           allow_headers=allowed_headers or ["*"], allow_credentials=allow_credentials)
    if allowed_hosts:
        app.add_middleware(HostCheckMiddleware, hosts=allowed_hosts)
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


def _make_server(config: Any, state: ServerState, drain_s: float) -> Any:
    """uvicorn's Server, with a drain: on SIGTERM / Ctrl-C it stops accepting, lets in-flight
    requests finish for ``drain_s`` seconds, then ends the rest (streams get an error event and
    ``[DONE]``, plain requests a 503) so no connection is cut; and it does not re-raise the
    signal afterwards (uvicorn does, which killed the process with -15 / a traceback)."""
    import uvicorn

    class Server(uvicorn.Server):
        signals: list[int] = []

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            n = state.engine.num_in_flight
            if n:
                logger.warning("stopping: waiting up to %g s for %d request(s) in flight", drain_s, n)
            handle = asyncio.get_running_loop().call_later(max(drain_s, 0.0), state.stopping.set)
            try:
                await super().shutdown(sockets)
            finally:
                handle.cancel()
                state.stopping.set()

        second_signal = False  # a second Ctrl-C / SIGTERM ended the in-flight requests (exit status 1)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                super().handle_exit(sig, frame)
                return
            # A second signal: end every in-flight request now (streams get an error event and [DONE]),
            # give them a moment to send it, then stop waiting for connections.
            self._captured_signals.append(sig)
            self.second_signal = True
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.force_exit = True
                return
            loop.call_soon_threadsafe(state.stopping.set)
            loop.call_later(SECOND_SIGNAL_GRACE_S, setattr, self, "force_exit", True)

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self.signals = list(self._captured_signals)
                    self._captured_signals.clear()

    return Server(config)


SECOND_SIGNAL_GRACE_S = 1.0  # after a second signal, for the ended streams to send their error event

KEEP_ALIVE_ENV = ("VLLITE_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH")
ENGINE_DEATH_GRACE_S = 2.0  # /health answers 503 this long after the engine died, then the server exits 1


def keep_alive_on_engine_death() -> bool:
    """vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: after the engine died, keep answering (503) until stopped."""
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in KEEP_ALIVE_ENV)


def serve(engine: AsyncLLM, model_names: list[str], sock: socket.socket, api_key: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info", access_log: bool = True, *,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
          timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
          header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT_S, **app_options: Any) -> None:
    """Serve on an already bound socket until Ctrl-C / SIGTERM, drain, then stop the engine loop.
    When the engine dies (a fault of no single request), the server stops within seconds and this
    raises SystemExit naming the cause (exit status 1). ``app_options`` go to ``build_app``; on a
    loopback bind ``allowed_hosts`` defaults to LOOPBACK_HOSTS."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    if app_options.get("allowed_hosts") is None and is_loopback(host):
        app_options["allowed_hosts"] = list(LOOPBACK_HOSTS)
    app = build_app(engine, model_names, api_key, max_body_bytes, **app_options)
    state: ServerState = app.state.vllite
    if not is_loopback(host) and not api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach this address can use it", host)
    print(how_to_query(host, port, model_names[0], api_key), flush=True)
    # After the drain, one engine step's time for the ended requests to send their last event.
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=int(shutdown_timeout) + 10, timeout_keep_alive=timeout_keep_alive,
                            http=header_timeout_protocol(header_read_timeout))
    logging.getLogger("uvicorn.access").addFilter(_NoQueryString())
    server = _make_server(config, state, shutdown_timeout)

    def _engine_died(exc: BaseException) -> None:  # every stream has failed already; a supervisor restarts us
        if keep_alive_on_engine_death():
            logger.error("the engine died (%r): the server stays up (%s), answering 503", exc, KEEP_ALIVE_ENV[0])
            return
        # /health answers 503 for a moment first, so that a probe (or a test) sees why, then the server stops
        logger.error("the engine died (%r): the server stops in %g s", exc, ENGINE_DEATH_GRACE_S)
        asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, setattr, server, "should_exit", True)

    engine.on_dead.append(_engine_died)
    t0 = time.monotonic()
    how = "normally"
    try:
        server.run(sockets=[sock])
        if server.signals:
            how = "on " + ("Ctrl-C" if server.signals[-1] == signal.SIGINT else signal.Signals(server.signals[-1]).name)
    except KeyboardInterrupt:  # a Ctrl-C outside uvicorn's handlers (start-up)
        how = "on Ctrl-C"
    finally:
        engine.close()
        sock.close()
        how = "because the engine died" if engine.dead is not None else how
        print(f"vllite: server stopped {how} after {time.monotonic() - t0:.0f} s", flush=True)
    if engine.dead is not None:  # exit status 1, naming the cause
        raise SystemExit(f"vllite serve: the engine died: {engine.dead!r}")
    if server.second_signal:  # not a clean stop: in-flight requests were ended without their drain
        raise SystemExit("vllite serve: stopped by a second signal; in-flight requests were ended")
