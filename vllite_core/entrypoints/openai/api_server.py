"""The app factory (``build_app``: shared state on ``app.state``, the routers of ``routes/`` and the
other route modules, one error translation, the middleware) and running it under uvicorn (``serve``).

When the server has a key, every route except ``middleware.OPEN_PATHS`` (health, version, metrics, the
OpenAPI schema and docs) needs ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``). CORS is
off unless origins are given; a server bound to loopback refuses other Host headers (DNS rebinding).
Every error leaves in its API's shape (error_handlers.py) and the server keeps serving. SIGTERM /
Ctrl-C drain the in-flight requests (``serve``).
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI

import vllite_core
from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.entrypoints.anthropic import serving as anthropic_serving
from vllite_core.entrypoints.openai import (
    error_handlers,
    serving_lora,
    serving_pooling,
    serving_transcription,
)
from vllite_core.entrypoints.openai.admission import DEFAULT_MAX_LOGPROB_ENTRIES, LogprobBudget
from vllite_core.entrypoints.openai.health import DEFAULT_STALL_S, HealthMonitor
from vllite_core.entrypoints.openai.http_protocol import DEFAULT_HEADER_READ_TIMEOUT_S, header_timeout_protocol
from vllite_core.entrypoints.openai.metrics import ServerMetrics
from vllite_core.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    HostCheckMiddleware,
    LoadTrackingMiddleware,
    NoQueryString,
    OriginCheckMiddleware,
)
from vllite_core.entrypoints.openai.request_logger import RequestLogger
from vllite_core.entrypoints.openai.routes import admin, generate, models, sagemaker, tokenize
from vllite_core.entrypoints.openai.serving_common import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RESTART_QUEUE_SIZE,
    DEFAULT_RESTART_QUEUE_TIMEOUT_S,
    ServerState,
)
from vllite_core.entrypoints.openai.serving_lora import ServedLoRAs
from vllite_core.entrypoints.openai.template_sandbox import TemplateLimits, TemplateSandbox
from vllite_core.entrypoints.openai.tracing import RequestTracer

if TYPE_CHECKING:
    from vllite_core.tool_parsers import ToolParser

logger = logging.getLogger("vllite.server")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.vllite
    state.metrics.set_api_thread(threading.get_native_id())
    state.templates.start()
    yield
    state.templates.close()
    state.body_parser.close()
    state.engine.close()
    if state.tracer is not None:
        state.tracer.close()  # exports the spans still batched


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies the routes read by hand (``ServerState.read_body``)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=app.servers)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for m in (*generate.OPENAPI_MODELS, *tokenize.OPENAPI_MODELS, *serving_pooling.OPENAPI_MODELS):
            js = m.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps[m.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


def _tool_parser(name: str) -> type[ToolParser]:
    from vllite_core.plugins.manager import get_plugin_manager
    from vllite_core.tool_parsers import load_tool_parsers

    parsers = load_tool_parsers(get_plugin_manager())
    if name not in parsers:
        raise SystemExit(f"vllite serve: --tool-call-parser {name!r} is unknown (known: {', '.join(sorted(parsers))})")
    return parsers[name]


def build_app(engine: AsyncLLM, model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, *, allowed_origins: list[str] | None = None,
              allowed_methods: list[str] | None = None, allowed_headers: list[str] | None = None,
              allow_credentials: bool = False, allowed_hosts: list[str] | None = None,
              max_waiting_requests: int | None = None, request_timeout: float | None = None,
              body_read_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT_S, enable_docs: bool = True,
              chat_template: str | None = None, reasoning_parser: str | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              loras: ServedLoRAs | None = None, trust_request_chat_template: bool = False,
              template_limits: TemplateLimits | None = None, health_stall_s: float = DEFAULT_STALL_S,
              root_path: str = "", enable_log_requests: bool = False, max_log_len: int | None = None,
              otlp_traces_endpoint: str | None = None, enable_server_load_tracking: bool = False,
              max_logprob_entries_in_flight: int | None = DEFAULT_MAX_LOGPROB_ENTRIES,
              restart_queue_size: int = DEFAULT_RESTART_QUEUE_SIZE,
              restart_queue_timeout: float = DEFAULT_RESTART_QUEUE_TIMEOUT_S) -> FastAPI:
    """The app: the shared state on ``app.state``, the routers, one error translation, the middleware.
    ``allowed_origins``: CORS on for these (off when None); ``allowed_hosts``: the Host header must
    name one of these (no check when None; ``serve`` passes LOOPBACK_HOSTS on a loopback bind).
    ``chat_template``: the template text (chat_template.load_chat_template); ``reasoning_parser``: a
    name from the vllite_register_reasoning_parsers hook. ``root_path``: the prefix a proxy serves the
    app under (--root-path); ``otlp_traces_endpoint``: an OTLP/HTTP receiver for a span per request.
    ``max_logprob_entries_in_flight``: the logprob entries requests in flight may hold (admission.py;
    None or 0: no limit). ``restart_queue_size`` / ``restart_queue_timeout``: requests that wait for a
    restarting engine core, and how long (ServerState.wait_for_restart)."""
    from vllite_core.reasoning import get_reasoning_parser

    state = ServerState(engine, model_names, max_body_bytes, api_key, max_waiting_requests=max_waiting_requests,
                        request_timeout=request_timeout, body_read_timeout=body_read_timeout,
                        chat_template=chat_template, loras=loras, templates=TemplateSandbox(template_limits),
                        reasoning_parser=get_reasoning_parser(reasoning_parser, engine.tokenizer)
                        if reasoning_parser else None,
                        trust_request_chat_template=trust_request_chat_template,
                        enable_auto_tool_choice=enable_auto_tool_choice,
                        tool_parser=_tool_parser(tool_call_parser) if tool_call_parser is not None else None,
                        request_logger=RequestLogger(max_log_len) if enable_log_requests else None,
                        logprob_budget=LogprobBudget(max_logprob_entries_in_flight)
                        if max_logprob_entries_in_flight else None,
                        restart_queue_size=restart_queue_size, restart_queue_timeout=restart_queue_timeout)
    state.metrics = ServerMetrics(engine, state.model_name)
    if otlp_traces_endpoint is not None:
        state.tracer = RequestTracer(otlp_traces_endpoint)
        engine.observers.append(state.tracer.observe)
    app = FastAPI(title="vllite", version=vllite_core.__version__, lifespan=_lifespan, root_path=root_path,
                  docs_url="/docs" if enable_docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if enable_docs else None)
    app.state.vllite = state
    app.state.generation = generate.GenerationServers.over(state)
    app.state.health = HealthMonitor(engine, health_stall_s)
    error_handlers.install(app)
    for router in (admin.router, models.router, generate.router, tokenize.router, anthropic_serving.router,
                   serving_transcription.router, serving_pooling.router, sagemaker.router):
        app.include_router(router)
    if loras is not None and loras.runtime_updates:  # only when the operator allowed runtime adapter updates
        loras.served_names |= set(model_names)
        app.include_router(serving_lora.runtime_router)
    from vllite_core.entrypoints.openai.serving_dev import add_dev_routes, dev_mode_enabled

    if dev_mode_enabled():  # /sleep /wake_up /is_sleeping /reset_prefix_cache /collective_rpc (vLLM's dev routes)
        add_dev_routes(app, engine)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    # Added innermost first: the host check runs before CORS, CORS (preflights) before the
    # origin check and the key.
    if enable_server_load_tracking:
        app.add_middleware(LoadTrackingMiddleware, state=state)
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


def bind_unix_socket(path: str) -> socket.socket:
    """--uds: listen on a unix socket at ``path`` (a stale socket file left by a dead server is replaced;
    one a live server answers on is not)."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise SystemExit(f"vllite serve: --uds {path}: the path exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise SystemExit(f"vllite serve: --uds {path}: a server is already listening there")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise SystemExit(f"vllite serve: cannot listen on unix socket {path}: {e.strerror or e}")
    sock.listen(2048)
    return sock


def how_to_query(host: str, port: int, model: str, api_key: str | None, *, tls: bool = False,
                 uds: str | None = None, root_path: str = "") -> str:
    """The start-up line: where the server answers and a curl command that asks it something."""
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if tls else "http"
    url = (f"{scheme}://localhost" if uds else f"{scheme}://{shown}:{port}") + root_path
    where = f"on unix socket {uds} ({url}/v1)" if uds else f"at {url}/v1"
    curl = "curl" + (f" --unix-socket {uds}" if uds else "") + (" --cacert CERT" if tls else "")
    auth = " -H 'Authorization: Bearer $VLLITE_API_KEY'" if api_key else ""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 32}' % model)
    return (f"vllite: serving {model!r} {where} (OpenAI API). Try:\n"
            f"  {curl} {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
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
          header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT_S, ssl_keyfile: str | None = None,
          ssl_certfile: str | None = None, **app_options: Any) -> None:
    """Serve on an already bound socket (TCP, or a unix socket for --uds) until Ctrl-C / SIGTERM, drain,
    then stop the engine loop. When the engine dies (a fault of no single request), the server stops
    within seconds and this raises SystemExit naming the cause (exit status 1). ``app_options`` go to
    ``build_app``; on a loopback bind ``allowed_hosts`` defaults to LOOPBACK_HOSTS. With
    ``ssl_certfile`` (and ``ssl_keyfile``) it serves HTTPS."""
    import uvicorn

    uds = sock.getsockname() if sock.family == socket.AF_UNIX else None
    host, port = ("localhost", 0) if uds else sock.getsockname()[:2]
    if app_options.get("allowed_hosts") is None and is_loopback(host) and not uds:
        app_options["allowed_hosts"] = list(LOOPBACK_HOSTS)
    app = build_app(engine, model_names, api_key, max_body_bytes, **app_options)
    state: ServerState = app.state.vllite
    if not is_loopback(host) and not api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach this address can use it", host)
    print(how_to_query(host, port, model_names[0], api_key, tls=ssl_certfile is not None, uds=uds,
                       root_path=app_options.get("root_path", "")), flush=True)
    # After the drain, one engine step's time for the ended requests to send their last event.
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=int(shutdown_timeout) + 10, timeout_keep_alive=timeout_keep_alive,
                            http=header_timeout_protocol(header_read_timeout), ssl_keyfile=ssl_keyfile,
                            ssl_certfile=ssl_certfile)
    logging.getLogger("uvicorn.access").addFilter(NoQueryString())
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
        if uds:
            with contextlib.suppress(OSError):
                os.unlink(uds)
        how = "because the engine died" if engine.dead is not None else how
        print(f"vllite: server stopped {how} after {time.monotonic() - t0:.0f} s", flush=True)
    if engine.dead is not None:  # exit status 1, naming the cause
        raise SystemExit(f"vllite serve: the engine died: {engine.dead!r}")
    if server.second_signal:  # not a clean stop: in-flight requests were ended without their drain
        raise SystemExit("vllite serve: stopped by a second signal; in-flight requests were ended")
