"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on the chat path.

The input items become chat messages (protocol_responses), rendered by the same chat template
code as /v1/chat/completions, so a response's text is what chat gives for the same messages.
The output is a ``message`` item with one ``output_text`` part, after a ``reasoning`` item when a
reasoning parser is on. Streamed, it is OpenAI's typed event sequence, every event numbered.
Stored responses (``store``, the default) live in memory, oldest dropped past a size bound,
for ``previous_response_id`` and GET."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.entrypoints.openai import responses_tools
from vllite_core.entrypoints.openai.documented_fields import accept_responses
from vllite_core.entrypoints.openai.errors import APIError, bad_request, from_exception
from vllite_core.entrypoints.openai.protocol import ChatMessage
from vllite_core.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    check_unsupported,
    input_messages,
    response_format_of,
)
from vllite_core.entrypoints.openai.serving_chat import engine_chat_prompt
from vllite_core.entrypoints.openai.serving_common import (
    SSE_HEADERS,
    ServerState,
    add_streams,
    final_outputs,
    merged,
    until_disconnect,
)
from vllite_core.entrypoints.openai.structured import apply_structured_outputs
from vllite_core.entrypoints.openai.tool_output import ToolOutput
from vllite_core.errors import InvalidRequestError
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import SamplingParams

DEFAULT_STORE_CHARS = 32 << 20  # text kept for previous_response_id / GET, all responses together


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Stored responses by id, with the conversation that led to them; the oldest go first once
    their text is over ``max_chars`` (memory stays bounded however many are stored)."""

    def __init__(self, max_chars: int = DEFAULT_STORE_CHARS) -> None:
        self.max_chars = max_chars
        self.items: OrderedDict[str, tuple[list[ChatMessage], dict[str, Any], int]] = OrderedDict()
        self.chars = 0

    def put(self, response: dict[str, Any], conversation: list[ChatMessage]) -> None:
        size = len(json.dumps(response)) + sum(_chars(m) for m in conversation)
        self.items[response["id"]] = (conversation, response, size)
        self.chars += size
        while self.chars > self.max_chars and self.items:
            _, (_, _, old) = self.items.popitem(last=False)
            self.chars -= old

    def get(self, rid: str) -> tuple[list[ChatMessage], dict[str, Any]] | None:
        got = self.items.get(rid)
        return None if got is None else (got[0], got[1])


def _input_param(param: str | None) -> str | None:
    """Chat's ``messages.content...`` field name as the Responses request's (``input.content...``)."""
    return "input" + param.removeprefix("messages") if param and param.startswith("messages") else param


def _chars(m: ChatMessage) -> int:
    """A stored message's size: its text, and its images' URLs (data: URLs hold the whole picture)."""
    if isinstance(m.content, list):
        return sum(len(getattr(p, "text", "")) + len(p.image_url.url if hasattr(p, "image_url") else "")
                   for p in m.content)
    return len(m.content or "")


def _sampling_params(req: ResponsesRequest) -> SamplingParams:
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", "max_output_tokens")
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, max_tokens=req.max_output_tokens)


class ResponsesServer:
    def __init__(self, state: ServerState, store: ResponseStore | None = None) -> None:
        self.state = state
        self.store = store or ResponseStore()

    def _conversation(self, req: ResponsesRequest) -> tuple[list[ChatMessage], list[ChatMessage]]:
        """(the conversation to store: earlier turns + this input; the messages to render: with instructions)."""
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            got = self.store.get(req.previous_response_id)
            if got is None:
                raise bad_request(f"previous response {req.previous_response_id!r} is not stored here (it was "
                                  "made with store: false, on another server, or dropped from the bounded store)",
                                  "previous_response_id", "previous_response_not_found")
            history = got[0]
        conversation = history + input_messages(req)
        rendered = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + conversation
        return conversation, rendered

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        st = self.state
        st.check_model(req.model)
        check_unsupported(req)
        template_kwargs = accept_responses(req)
        plan = responses_tools.plan(req)
        if plan.mode == "auto" and not (st.enable_auto_tool_choice and st.tool_parser is not None):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                              "tool_choice")
        conversation, rendered = self._conversation(req)
        params = _sampling_params(req)
        try:
            await asyncio.to_thread(apply_structured_outputs, st.engine,
                                    SimpleNamespace(response_format=response_format_of(req.text)), params, plan)
        except APIError as e:  # named after chat's field: here it is text.format (or tools)
            raise bad_request(e.message, e.param if e.param in ("tools", "tool_choice") else "text.format") from None
        chat = SimpleNamespace(messages=rendered, add_generation_prompt=True, continue_final_message=False,
                               chat_template=None, chat_template_kwargs=template_kwargs,
                               allow_special_tokens_in_content=False)
        try:  # images (input_image parts) go through chat's multimodal path
            prompt, ids = await engine_chat_prompt(st, chat, plan.template_tools)
        except (APIError, InvalidRequestError) as e:  # a media error names chat's field: here it is under input
            err = from_exception(e)  # its status and code kept (a timeout stays a timeout)
            err.param = _input_param(err.param)
            raise err from None
        rid = _id("resp")
        streams = await add_streams(st.engine, [prompt], params, rid, 0, requested_max_tokens=req.max_output_tokens)
        build = _Builder(self, req, rid, len(ids), conversation, ToolOutput(plan, st.tool_parser))
        if req.stream:
            return StreamingResponse(build.events(merged(st.engine, streams, delta=True)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        out = (await until_disconnect(raw, final_outputs(st.engine, streams)))[0]
        c = out.outputs[0]
        reasoning, content = self._split(c.text)
        msg, finish = build.tools.message(content or "", c.finish_reason)
        calls = [responses_tools.function_call_item(call) for call in msg.get("tool_calls") or []]
        if calls:
            content = msg["content"]
        return JSONResponse(build.finish(reasoning, content, finish, len(c.token_ids), out.num_cached_tokens, calls))

    def _split(self, text: str) -> tuple[str | None, str | None]:
        parser = self.state.reasoning_parser
        return (None, text) if parser is None else parser.extract(text)

    def retrieve(self, rid: str) -> Response:
        got = self.store.get(rid)
        if got is None:
            raise APIError(404, f"response {rid!r} not found", "response_id", "not_found")
        return JSONResponse(got[1])


class _Builder:
    """The response object of one request, whole or as events."""

    def __init__(self, server: ResponsesServer, req: ResponsesRequest, rid: str, prompt_len: int,
                 conversation: list[ChatMessage], tools: ToolOutput) -> None:
        self.server, self.req, self.rid, self.prompt_len = server, req, rid, prompt_len
        self.tools = tools
        self.conversation = conversation
        self.created = int(time.time())
        self.msg_id, self.rs_id = _id("msg"), _id("rs")
        self.seq = 0

    def response(self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        r = self.req
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.server.state.model_name, "output": output, "usage": use, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
                "temperature": 1.0 if r.temperature is None else r.temperature,
                "top_p": 1.0 if r.top_p is None else r.top_p,
                "parallel_tool_calls": r.parallel_tool_calls is not False, "tool_choice": r.tool_choice or "auto",
                "tools": r.tools or [], "text": {"format": {"type": "text"}},
                "previous_response_id": r.previous_response_id,
                "reasoning": None, "store": r.store, "truncation": "disabled", "user": r.user}

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"id": self.rs_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": status,
                "content": [self.text_part(text)]}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _usage(self, output_tokens: int, cached: int, reasoning: str | None) -> dict[str, Any]:
        tok = self.server.state.engine.tokenizer
        # reasoning tokens: the reasoning text tokenized again (the tag tokens themselves not counted)
        n_reasoning = len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": self.prompt_len, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": n_reasoning},
                "total_tokens": self.prompt_len + output_tokens}

    def finish(self, reasoning: str | None, content: str | None, finish_reason: str | None, output_tokens: int,
               cached: int, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The final response object (stored when the request asks). ``calls``: function_call items."""
        output = []
        if reasoning is not None:
            output.append(self.reasoning_item(reasoning))
        if content is not None or (reasoning is None and not calls):
            output.append(self.message_item(content or ""))
        output += calls or []
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        resp = self.response(status, output, self._usage(output_tokens, cached, reasoning), incomplete)
        if self.req.store:
            answer = ChatMessage(role="assistant", content=content or "") if not calls else ChatMessage(
                role="assistant", content=content or None, tool_calls=[
                    {"id": c["call_id"], "type": "function", "function": {"name": c["name"],
                                                                          "arguments": c["arguments"]}}
                    for c in calls])
            self.server.store.put(resp, self.conversation + [answer])
        return resp

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        """created, in_progress, then per output item: added, (part added), deltas, done events;
        then completed."""
        ev = self._event
        parser = self.server.state.reasoning_parser
        split = parser.stream() if parser is not None else None
        reasoning, content = "", ""
        open_item: str | None = None  # "reasoning" | "message" | "call"
        calls: list[dict[str, Any]] = []  # function_call items, the open one last
        opened: set[str] = set()
        index = -1
        n_tokens, cached, finish_reason = 0, 0, None

        def close() -> list[str]:
            if open_item == "reasoning":
                return [ev("response.reasoning_text.done", item_id=self.rs_id, output_index=index, content_index=0,
                           text=reasoning),
                        ev("response.output_item.done", output_index=index, item=self.reasoning_item(reasoning))]
            if open_item == "message":
                return [ev("response.output_text.done", item_id=self.msg_id, output_index=index, content_index=0,
                           text=content, logprobs=[]),
                        ev("response.content_part.done", item_id=self.msg_id, output_index=index, content_index=0,
                           part=self.text_part(content)),
                        ev("response.output_item.done", output_index=index, item=self.message_item(content))]
            if open_item == "call":
                call = calls[-1]
                call["status"] = "completed"
                return [ev("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                           name=call["name"], arguments=call["arguments"]),
                        ev("response.output_item.done", output_index=index, item=call)]
            return []

        def tool_pieces(piece: str, finish: str | None) -> list[str]:
            """Content through the tool plan: text, or function_call items with their argument deltas."""
            nonlocal open_item, index
            delta, _ = self.tools.delta(0, piece, finish)
            out = pieces(None, delta["content"]) if delta.get("content") else []
            for d in delta.get("tool_calls") or []:
                fn = d.get("function") or {}
                if d.get("id") is not None:  # a new call
                    out += close()
                    open_item, index = "call", index + 1
                    opened.add("call")
                    item = responses_tools.function_call_item(
                        {"id": d["id"], "function": {"name": fn.get("name"), "arguments": ""}}, "in_progress")
                    calls.append(item)
                    out.append(ev("response.output_item.added", output_index=index, item=dict(item)))
                if fn.get("arguments"):
                    calls[-1]["arguments"] += fn["arguments"]
                    out.append(ev("response.function_call_arguments.delta", item_id=calls[-1]["id"],
                                  output_index=index, delta=fn["arguments"]))
            return out

        def pieces(r: str | None, c: str | None) -> list[str]:
            nonlocal open_item, index, reasoning, content
            out: list[str] = []
            if r:
                if open_item != "reasoning":
                    out += close()
                    open_item, index = "reasoning", index + 1
                    opened.add(open_item)
                    out.append(ev("response.output_item.added", output_index=index,
                                  item=self.reasoning_item("", "in_progress")))
                reasoning += r
                out.append(ev("response.reasoning_text.delta", item_id=self.rs_id, output_index=index,
                              content_index=0, delta=r))
            if c is not None and (c or open_item is None):
                if open_item != "message":
                    out += close()
                    open_item, index = "message", index + 1
                    opened.add(open_item)
                    out.append(ev("response.output_item.added", output_index=index,
                                  item={**self.message_item("", "in_progress"), "content": []}))
                    out.append(ev("response.content_part.added", item_id=self.msg_id, output_index=index,
                                  content_index=0, part=self.text_part("")))
                if c:
                    content += c
                    out.append(ev("response.output_text.delta", item_id=self.msg_id, output_index=index,
                                  content_index=0, delta=c, logprobs=[]))
            return out

        try:
            yield ev("response.created", response=self.response("in_progress", []))
            yield ev("response.in_progress", response=self.response("in_progress", []))
            async for _, out in outputs:
                c = out.outputs[0]
                n_tokens += len(c.token_ids)
                cached = out.num_cached_tokens
                finish_reason = c.finish_reason or finish_reason
                r_delta, c_delta = split.feed(c.text, list(c.token_ids)) if split else (None, c.text)
                for e in pieces(r_delta, None) + tool_pieces(c_delta or "", None):
                    yield e
            r_rest, c_rest = split.finish() if split is not None else (None, "")
            for e in pieces(r_rest, None) + tool_pieces(c_rest or "", finish_reason or "stop"):
                yield e
            if not opened:
                for e in pieces(None, ""):  # an empty answer is still a message item
                    yield e
            for e in close():
                yield e
            final = self.finish(reasoning if "reasoning" in opened else None,
                                content if "message" in opened else None, finish_reason, n_tokens, cached, calls)
            # response.completed also when max_output_tokens cut the answer (its status then says
            # "incomplete"): the openai client's stream helpers wait for this event to end a stream.
            yield ev("response.completed", response=final)
        except Exception as e:  # after the headers went out, an error can only be an event
            err = from_exception(e)
            yield ev("error", code=err.code or err.type, message=err.message, param=err.param)
