"""The server's ASGI middleware: the API-key gate, the Host check (DNS rebinding), the Origin check,
and the access-log filter. Pure ASGI (no response buffering: streams and disconnects pass through)."""
from __future__ import annotations

import logging
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from vllite_core.entrypoints.openai.error_handlers import error_response_for, route_path
from vllite_core.entrypoints.openai.errors import APIError
from vllite_core.entrypoints.openai.serving_common import ServerState

# The routes whose requests /load counts while they are answered (streams until their last event).
LOAD_AWARE_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings", "/pooling",
    "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v1/audio/transcriptions",
    "/invocations"})
# Routes that stay open when the server has an API key: they run no model and reveal no input.
OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/version", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})


class APIKeyMiddleware:
    """Pure ASGI (no response buffering, so streaming and disconnects pass straight through).
    The key is read from the Authorization header only (never a query parameter, which would
    land in access logs) and compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            headers = dict(scope["headers"])
            got = headers.get(b"authorization", b"")
            x_key = headers.get(b"x-api-key")  # Anthropic's clients send the key here
            if not secrets.compare_digest(got, self.expected) and not (
                    x_key is not None and secrets.compare_digest(b"Bearer " + x_key, self.expected)):
                msg = "missing API key" if not (got or x_key) else "incorrect API key"
                err = APIError(401, f"{msg}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                               code="invalid_api_key")
                await error_response_for(route_path(scope), err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


class NoQueryString(logging.Filter):
    """uvicorn's access log lines without query strings (where secrets get pasted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<query omitted>", *args[3:])
        return True


class LoadTrackingMiddleware:
    """--enable-server-load-tracking: ``state.server_load`` counts the requests on LOAD_AWARE_PATHS from
    arrival until their response is sent whole (GET /load reports it)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in LOAD_AWARE_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1
