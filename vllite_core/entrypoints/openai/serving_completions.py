"""POST /v1/completions: prompts (text or token ids, one or many) -> text_completion."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.engine.llm_engine import PromptType
from vllite_core.entrypoints.openai.documented_fields import accept_completion
from vllite_core.entrypoints.openai.errors import bad_request, from_exception
from vllite_core.entrypoints.openai.logprobs import CompletionLogprobs, prompt_logprobs_json
from vllite_core.entrypoints.openai.protocol import CompletionRequest
from vllite_core.entrypoints.openai.sampling import to_sampling_params
from vllite_core.entrypoints.openai.serving_common import (
    SSE_DONE,
    SSE_HEADERS,
    ServerState,
    add_streams,
    final_outputs,
    merged,
    new_id,
    sse,
    until_disconnect,
    usage,
)
from vllite_core.entrypoints.openai.structured import apply_structured_outputs
from vllite_core.outputs import RequestOutput

# Completions one request may ask for: len(prompt list) x n (each is an engine request).
MAX_COMPLETIONS_PER_REQUEST = 1024


def _prompts(req: CompletionRequest) -> list[PromptType]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [{"prompt_token_ids": list(p)}]  # type: ignore[arg-type]
    if len(p) * max(req.n, 1) > MAX_COMPLETIONS_PER_REQUEST:
        raise bad_request(f"{len(p)} prompts x n={req.n} is more than the {MAX_COMPLETIONS_PER_REQUEST} completions "
                          "one request may ask for", "prompt")
    if isinstance(p[0], str):
        return list(p)  # type: ignore[arg-type]
    return [{"prompt_token_ids": list(ids)} for ids in p]  # type: ignore[union-attr]


class CompletionServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tokenizer = state.engine.tokenizer

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        st = self.state
        st.check_model(req.model)
        accept_completion(req)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        prompts = _prompts(req)
        params = to_sampling_params(req, req.max_tokens, req.logprobs, st.engine.engine.default_sampling_params)
        await asyncio.to_thread(apply_structured_outputs, st.engine, req, params)  # backend checks: CPU
        plp_field = "prompt_logprobs"
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = req.logprobs  # echoed prompt tokens get their logprobs too
            plp_field = "echo"
        rid = new_id("cmpl")
        streams = await add_streams(st.engine, prompts, params, rid, req.priority, req.cache_salt,
                                    st.lora_request(req.model), req.max_tokens, plp_field)
        ctx = _Ctx(self, req, rid, [s.num_prompt_tokens for s in streams])
        if req.stream:
            return StreamingResponse(ctx.stream(merged(st.engine, streams, delta=True)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        outs = await until_disconnect(raw, final_outputs(st.engine, streams))
        return JSONResponse(ctx.full(outs))


class _Ctx:
    """One request's response building (shared by the streamed and the whole form)."""

    def __init__(self, server: CompletionServer, req: CompletionRequest, rid: str, prompt_lens: list[int]) -> None:
        self.tok = server.tokenizer
        self.model = server.state.response_model(req.model)
        self.req = req
        self.rid = rid
        self.created = int(time.time())
        self.prompt_lens = prompt_lens
        self.top_k = req.logprobs or 0

    def _echo(self, out: RequestOutput, lp: CompletionLogprobs | None) -> str:
        """The prompt text (and its logprobs) in front of the completion, for ``echo``."""
        text = out.prompt if out.prompt is not None else self.tok.decode(out.prompt_token_ids)
        if lp is not None:
            plp = out.prompt_logprobs
            lp.add(out.prompt_token_ids, plp if plp is not None else None, self.tok, self.top_k)
            if plp is None or plp[:1] == [None]:
                lp.token_logprobs[0] = None
                lp.top_logprobs[0] = None  # type: ignore[call-overload]
            lp.offset = len(text)
        return text

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        n = self.req.n
        choices = []
        completion_tokens = 0
        for i, out in enumerate(outs):
            for c in out.outputs:
                lp = CompletionLogprobs() if self.req.logprobs is not None else None
                prefix = self._echo(out, lp) if self.req.echo else ""
                if lp is not None:
                    lp.add(c.token_ids, c.logprobs, self.tok, self.top_k)
                completion_tokens += len(c.token_ids)
                choices.append({"index": i * n + c.index, "text": prefix + c.text,
                                "logprobs": lp.as_dict() if lp is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs, self.tok)})
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(sum(self.prompt_lens), completion_tokens)}

    def _chunk(self, choices: list[dict[str, Any]], use: dict[str, int] | None) -> dict[str, Any]:
        chunk = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if use is not None:
            chunk["usage"] = use
        return chunk

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        req, n = self.req, self.req.n
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        lps: dict[int, CompletionLogprobs] = {}
        started: set[int] = set()
        completion_tokens = 0
        try:
            async for i, out in outputs:
                for c in out.outputs:
                    index = i * n + c.index
                    text = c.text
                    lp = lps.setdefault(index, CompletionLogprobs()) if req.logprobs is not None else None
                    start = len(lp.tokens) if lp is not None else 0
                    if index not in started:
                        started.add(index)
                        if req.echo:
                            text = self._echo(out, lp) + text
                    piece_lp = None
                    if lp is not None:
                        lp.add(c.token_ids, c.logprobs, self.tok, self.top_k)
                        piece_lp = {k: v[start:] for k, v in lp.as_dict().items()}
                    completion_tokens += len(c.token_ids)
                    choice = {"index": index, "text": text, "logprobs": piece_lp, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if out.prompt_logprobs is not None and c is out.outputs[0]:
                        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.tok)
                    use = usage(sum(self.prompt_lens), completion_tokens) if continuous else None
                    yield sse(self._chunk([choice], use))
            if include_usage:
                yield sse(self._chunk([], usage(sum(self.prompt_lens), completion_tokens)))
        except Exception as e:  # after the headers went out, an error can only be an event
            yield sse(from_exception(e).body())
        yield SSE_DONE
