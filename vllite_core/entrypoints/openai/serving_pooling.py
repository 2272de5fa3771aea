"""The pooling endpoints, with vLLM's request and response shapes: POST /v1/embeddings (OpenAI),
/pooling, /classify, /score and /v1/score, /rerank, /v1/rerank and /v2/rerank (Jina / Cohere shape).
Each is served only when the loaded model serves its task; otherwise 400 naming the model's task (a
generative model serves none of them)."""
from __future__ import annotations

import base64
import time
from typing import Any, Awaitable, Callable

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    PoolingRequestBase,
    RerankRequest,
    ScoreRequest,
)
from vllite_core.entrypoints.openai.routes.openapi import openapi_body
from vllite_core.entrypoints.openai.serving_common import (
    ServerState,
    add_streams,
    final_outputs,
    new_id,
    server_state,
    until_disconnect,
)
from vllite_core.pooling import scoring
from vllite_core.pooling.params import PoolingParams
from vllite_core.pooling.requests import check_task

router = APIRouter()
PoolingHandler = Callable[[ServerState, Request, Any], Awaitable[dict]]
# The request models the routes read (by hand, to answer 400s in the engine's words); named in the OpenAPI
# schema as request bodies so clients and fuzzers (schemathesis) see them.
OPENAPI_MODELS = (EmbeddingRequest, PoolingRequest, ClassificationRequest, ScoreRequest, RerankRequest)


def _prompts(value: Any, field: str = "input") -> list[Any]:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids -> engine prompts."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise bad_request(f"{field} must not be empty", field)
    if all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": list(value)}]
    prompts = []
    for v in value:
        if isinstance(v, str):
            if not v:
                raise bad_request(f"{field} must not contain an empty string", field)
            prompts.append(v)
        elif isinstance(v, list) and v and all(isinstance(t, int) for t in v):
            prompts.append({"prompt_token_ids": list(v)})
        else:
            raise bad_request(f"{field} must be a string, a list of strings, token ids or lists of token ids",
                              field)
    return prompts


async def _run(state: ServerState, request: Request, prompts: list[Any], params: PoolingParams,
               prefix: str) -> list[Any]:
    """The engine's finished outputs of one pooling request per prompt, all or nothing."""
    engine = state.engine
    check_task(engine.engine, params)
    streams = await add_streams(engine, prompts, params, new_id(prefix), 0)
    return await until_disconnect(request, final_outputs(engine, streams))


def _usage(outs: list[Any]) -> dict[str, int]:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def _encode(vec: Any, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec.numpy(), dtype=np.float32).tobytes()).decode()
    return vec.tolist()


def _envelope(state: ServerState, prefix: str, data: list[dict], outs: list[Any]) -> dict:
    return {"id": new_id(prefix), "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": data, "usage": _usage(outs)}


async def _pool(request: Request, handler: PoolingHandler, body_model: type[PoolingRequestBase]) -> Response:
    state = server_state(request)
    state.admit(request)
    return await respond(request, handler, await state.read_body(request, body_model))


async def respond(request: Request, handler: PoolingHandler, req: PoolingRequestBase) -> Response:
    """One pooling request, read and admitted, answered by ``handler``."""
    state = server_state(request)
    state.check_model(req.model)
    return JSONResponse(await handler(state, request, req))


async def _embeddings(state: ServerState, request: Request, req: EmbeddingRequest) -> dict:
    params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, dimensions=req.dimensions,
                           normalize=req.normalize, task="embed")
    outs = await _run(state, request, _prompts(req.input), params, "embd")
    data = [{"index": i, "object": "embedding", "embedding": _encode(o.pooling_output, req.encoding_format)}
            for i, o in enumerate(outs)]
    return _envelope(state, "embd", data, outs)


async def _pooling(state: ServerState, request: Request, req: PoolingRequest) -> dict:
    params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, dimensions=req.dimensions,
                           normalize=req.normalize, activation=req.activation, task=req.task or "encode")
    cfg = state.engine.engine.config.model_config.pooler_config
    if req.encoding_format == "base64" and cfg is not None and cfg.task != "embed":
        raise bad_request(f"encoding_format: base64 is for embeddings; this model's task is {cfg.task}",
                          "encoding_format")
    outs = await _run(state, request, _prompts(req.input), params, "pool")
    data = [{"index": i, "object": "pooling", "data": _encode(o.pooling_output, req.encoding_format)}
            for i, o in enumerate(outs)]
    return _envelope(state, "pool", data, outs)


async def _classify(state: ServerState, request: Request, req: ClassificationRequest) -> dict:
    params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, activation=req.activation,
                           task="classify")
    outs = await _run(state, request, _prompts(req.input), params, "classify")
    labels = getattr(state.engine.engine.model_info.hf_config, "id2label", None) or {}
    data = []
    for i, o in enumerate(outs):
        probs = o.pooling_output.tolist()
        best = int(np.argmax(probs))
        data.append({"index": i, "label": labels.get(best, str(best)), "probs": probs, "num_classes": len(probs)})
    return _envelope(state, "classify", data, outs)


async def _scores(state: ServerState, request: Request, text_1: Any, text_2: Any, req: Any
                  ) -> tuple[list[float], list[Any]]:
    """Scores of the pairs, and the outputs they came from (for usage)."""
    pairs = scoring.score_pairs(text_1, text_2)
    engine = state.engine
    cfg = engine.engine.config.model_config.pooler_config
    if cfg is not None and cfg.task == "embed":
        params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, task="embed")
        outs = await _run(state, request, [t for pair in pairs for t in pair], params, "score")
        return [scoring.cosine(a.pooling_output, b.pooling_output) for a, b in zip(outs[0::2], outs[1::2])], outs
    params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, activation=req.activation,
                           task="score")
    check_task(engine.engine, params)

    def build() -> list[dict]:
        return [scoring.pair_prompt(engine.prep_tokenizer, a, b) for a, b in pairs]

    prompts = await engine.run_prep(build)
    outs = await _run(state, request, prompts, params, "score")
    return [float(o.pooling_output[0]) for o in outs], outs


async def _score(state: ServerState, request: Request, req: ScoreRequest) -> dict:
    scores, outs = await _scores(state, request, req.text_1, req.text_2, req)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return _envelope(state, "score", data, outs)


async def _rerank(state: ServerState, request: Request, req: RerankRequest) -> dict:
    if not req.documents:
        raise bad_request("documents must not be empty", "documents")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request("top_n must be a positive integer", "top_n")
    scores, outs = await _scores(state, request, req.query, req.documents, req)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or len(scores)]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"id": new_id("rerank"), "model": state.model_name, "usage": {"total_tokens": n}, "results": results}


@router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest))
async def create_embedding(request: Request) -> Response:
    return await _pool(request, _embeddings, EmbeddingRequest)


@router.post("/pooling", openapi_extra=openapi_body(PoolingRequest))
async def create_pooling(request: Request) -> Response:
    return await _pool(request, _pooling, PoolingRequest)


@router.post("/classify", openapi_extra=openapi_body(ClassificationRequest))
async def create_classify(request: Request) -> Response:
    return await _pool(request, _classify, ClassificationRequest)


@router.post("/score", openapi_extra=openapi_body(ScoreRequest))
@router.post("/v1/score", openapi_extra=openapi_body(ScoreRequest))
async def create_score(request: Request) -> Response:
    return await _pool(request, _score, ScoreRequest)


@router.post("/rerank", openapi_extra=openapi_body(RerankRequest))
@router.post("/v1/rerank", openapi_extra=openapi_body(RerankRequest))
@router.post("/v2/rerank", openapi_extra=openapi_body(RerankRequest))
async def create_rerank(request: Request) -> Response:
    return await _pool(request, _rerank, RerankRequest)


# The pooling handlers by request shape, in the order /invocations tries them (vLLM's).
INVOCATIONS: tuple[tuple[type[PoolingRequestBase], PoolingHandler], ...] = (
    (EmbeddingRequest, _embeddings), (ClassificationRequest, _classify), (ScoreRequest, _score),
    (RerankRequest, _rerank), (PoolingRequest, _pooling))
