"""GET /health (503 naming why when the engine is dead, restarting or stalled), /version, /metrics (Prometheus) and
/load (vLLM's server load: HTTP requests in flight, counted with --enable-server-load-tracking)."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

import vllite_core
from vllite_core.entrypoints.openai.errors import APIError
from vllite_core.entrypoints.openai.health import HealthMonitor
from vllite_core.entrypoints.openai.metrics import CONTENT_TYPE
from vllite_core.entrypoints.openai.serving_common import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    engine = server_state(request).engine
    if engine.dead is not None:
        raise APIError(503, f"engine loop stopped: {engine.dead!r}", code="engine_dead")
    if engine.restarting is not None:
        raise APIError(503, f"the engine core is restarting after it died: {engine.restarting}",
                       code="engine_restarting")
    monitor: HealthMonitor = request.app.state.health
    problem = monitor.problem()
    if problem is not None:
        raise APIError(503, problem, code="engine_stalled")
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": vllite_core.__version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/load")
async def load(request: Request) -> dict[str, int]:
    return {"server_load": server_state(request).server_load}
