"""GET /v1/models: the served names, then the served LoRA adapters (each with its base model as parent)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from vllite_core.entrypoints.openai.serving_common import server_state

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    max_len = state.engine.max_model_len
    data = [{"id": name, "object": "model", "created": state.created, "owned_by": "vllite",
             "root": state.model_name, "parent": None, "max_model_len": max_len}
            for name in state.model_names]
    if state.loras is not None:
        data += state.loras.models(state.created, max_len)
    return {"object": "list", "data": data}
