"""SageMaker's two routes, as vLLM serves them: GET/POST /ping (the health check) and POST /invocations,
which answers a body by its shape: the first of chat, completion, embedding, classification, score,
rerank and pooling requests the body is valid as (400 naming the shapes when none)."""
from __future__ import annotations

import json
from typing import Awaitable, Callable

from fastapi import APIRouter
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.entrypoints.openai import serving_pooling
from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllite_core.entrypoints.openai.routes.admin import health
from vllite_core.entrypoints.openai.routes.generate import generation_servers
from vllite_core.entrypoints.openai.serving_common import server_state

router = APIRouter()
Handler = Callable[[Request, BaseModel], Awaitable[Response]]


async def _chat(request: Request, req: ChatCompletionRequest) -> Response:
    return await generation_servers(request).chat.create(req, request)


async def _completion(request: Request, req: CompletionRequest) -> Response:
    return await generation_servers(request).completions.create(req, request)


def _pooling(handler: serving_pooling.PoolingHandler) -> Handler:
    async def answer(request: Request, req: BaseModel) -> Response:
        return await serving_pooling.respond(request, handler, req)
    return answer


INVOCATIONS: tuple[tuple[type[BaseModel], Handler], ...] = (
    (ChatCompletionRequest, _chat), (CompletionRequest, _completion),
    *((model, _pooling(handler)) for model, handler in serving_pooling.INVOCATIONS))


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> Response:
    return await health(request)


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    state = server_state(request)
    state.admit(request)
    raw = await state.read_raw(request)
    try:
        json.loads(raw)
    except ValueError as e:
        raise bad_request(f"malformed JSON body: {e}", None, "invalid_json") from None
    for model, handler in INVOCATIONS:
        try:
            req = model.model_validate_json(raw)
        except ValidationError:
            continue
        return await handler(request, req)
    raise bad_request("Cannot find suitable handler for request. Expected one of: "
                      f"{[model.__name__ for model, _ in INVOCATIONS]}")
