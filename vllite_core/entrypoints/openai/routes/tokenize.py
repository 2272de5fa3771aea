"""POST /tokenize and /detokenize (vLLM's): the tokenizer's work on the engine's prep thread."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from vllite_core.entrypoints.openai.routes.openapi import openapi_body
from vllite_core.entrypoints.openai.serving_chat import RenderedChat, render_chat_prompt, rendered_chat_ids
from vllite_core.entrypoints.openai.serving_common import server_state

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

router = APIRouter()
OPENAPI_MODELS = (TokenizeRequest, DetokenizeRequest)


def _tokenize(tokenizer: "Tokenizer", req: TokenizeRequest, rendered: RenderedChat | None = None) -> list[int]:
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


def _detokenize(tokenizer: "Tokenizer", tokens: list[int], vocab: int) -> str:
    """/detokenize's text, on the engine's prep thread."""
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {vocab})", "tokens")
    return tokenizer.decode(tokens)


@router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    engine = state.engine
    req = await state.read_body(request, TokenizeRequest)
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


@router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    engine = state.engine
    req = await state.read_body(request, DetokenizeRequest)
    state.check_model(req.model)
    # Decoding holds the GIL (1.3 s for 800k ids here, stalling every thread): at most what one
    # sequence can hold, decoded on the prep thread.
    if len(req.tokens) > engine.max_model_len:
        raise bad_request(f"at most {engine.max_model_len} token ids (the model's context), got "
                          f"{len(req.tokens)}", "tokens")
    text = await engine.run_prep(_detokenize, engine.prep_tokenizer, req.tokens, engine.engine.vocab_size)
    return JSONResponse({"prompt": text})
