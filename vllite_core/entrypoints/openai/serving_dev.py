"""Development routes (vLLM's, behind ``VLLM_SERVER_DEV_MODE``): sleep mode and the workers' RPCs over HTTP,
for a trainer driving a served engine between rollouts.

``POST /sleep?level=1|2&mode=abort|wait`` (vLLM's modes: requests in flight aborted, the default, or let
finish first), ``POST /wake_up`` (``?tags=weights&tags=kv_cache``; none: both),
``GET /is_sleeping`` -> ``{"is_sleeping": bool}``, ``POST /reset_prefix_cache``, and ``POST /collective_rpc``
with ``{"method": name, "args": [...], "kwargs": {...}}`` (a worker method by name, JSON arguments; the
results as JSON). They exist only with ``VLLITE_SERVER_DEV_MODE=1`` (or ``VLLM_SERVER_DEV_MODE=1``): they
let a caller release the model's memory and run worker methods, so a production server never has them.
Requests while the engine sleeps get 503 (``engine_sleeping``).
"""
from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from vllite_core.entrypoints.openai.errors import APIError, bad_request

DEV_MODE_ENV = ("VLLITE_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")


def dev_mode_enabled(environ: Any = os.environ) -> bool:
    return any(environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in DEV_MODE_ENV)


class CollectiveRpcRequest(BaseModel):
    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    model_config = {"extra": "forbid"}


def _as_error(exc: Exception, field: str) -> APIError:
    """A refused call (bad level or tag, requests in flight, no sleep mode) names what was wrong."""
    from vllite_core.entrypoints.openai.errors import from_exception

    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, APIError):
        return bad_request(str(exc), field)
    return from_exception(exc)


def add_dev_routes(app: FastAPI, engine: Any) -> None:
    @app.post("/sleep")
    async def sleep(level: int = Query(1), mode: str = Query("abort")) -> Response:
        from vllite_core.worker.sleep import check_mode

        try:
            check_mode(mode)
        except ValueError as e:
            return bad_request(str(e), "mode").response()
        try:
            await engine.sleep(level, mode)
        except Exception as e:  # noqa: BLE001 - answered, the engine goes on
            return _as_error(e, "level").response()
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        try:
            await engine.wake_up(tags)
        except Exception as e:  # noqa: BLE001
            return _as_error(e, "tags").response()
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(req: CollectiveRpcRequest) -> Response:
        try:
            results = await engine.collective_rpc(req.method, tuple(req.args), req.kwargs)
        except Exception as e:  # noqa: BLE001
            return _as_error(e, "method").response()
        return JSONResponse({"results": [_jsonable(r) for r in results]})


def _jsonable(value: Any) -> Any:
    """A worker's result as JSON: plain values as they are, records and tensors as their text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
