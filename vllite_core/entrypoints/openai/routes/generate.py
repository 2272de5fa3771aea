"""POST /v1/completions, /v1/chat/completions, /v1/responses and GET /v1/responses/{id}."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllite_core.entrypoints.openai.protocol_responses import ResponsesRequest
from vllite_core.entrypoints.openai.routes.openapi import openapi_body
from vllite_core.entrypoints.openai.serving_chat import ChatServer
from vllite_core.entrypoints.openai.serving_common import ServerState, server_state
from vllite_core.entrypoints.openai.serving_completions import CompletionServer
from vllite_core.entrypoints.openai.serving_responses import ResponsesServer

router = APIRouter()
OPENAPI_MODELS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest)


@dataclass
class GenerationServers:
    """The three generation endpoints' servers over one ServerState (``app.state.generation``)."""
    completions: CompletionServer
    chat: ChatServer
    responses: ResponsesServer

    @classmethod
    def over(cls, state: ServerState) -> GenerationServers:
        return cls(CompletionServer(state), ChatServer(state), ResponsesServer(state))


def generation_servers(request: Request) -> GenerationServers:
    return request.app.state.generation


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    state.admit(request)
    req = await state.read_body(request, CompletionRequest)
    return await generation_servers(request).completions.create(req, request)


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    state.admit(request)
    req = await state.read_body(request, ChatCompletionRequest)
    return await generation_servers(request).chat.create(req, request)


@router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    state = server_state(request)
    state.admit(request)
    req = await state.read_body(request, ResponsesRequest)
    return await generation_servers(request).responses.create(req, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return generation_servers(request).responses.retrieve(response_id)
