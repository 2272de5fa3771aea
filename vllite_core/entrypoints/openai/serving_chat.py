"""POST /v1/chat/completions: messages -> the model's chat template -> chat.completion."""
from __future__ import annotations

import re
import secrets
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.entrypoints.openai.errors import bad_request, from_exception
from vllite_core.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from vllite_core.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
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
from vllite_core.outputs import RequestOutput


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Text parts are joined with newlines: templates of text models expect a string."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "\n".join(p.text for p in m.content)
        out.append(d)
    return out


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                          "continue_final_message")
    try:
        return tokenizer.apply_chat_template(messages_to_dicts(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template=chat_template, **(template_kwargs or {}))
    except Exception as e:  # jinja errors, templates that raise on bad role orders, no template at all
        from jinja2.exceptions import SecurityError, TemplateSyntaxError

        # transformers renders every template in jinja2's ImmutableSandboxedEnvironment: a template
        # reaching for Python internals (``''.__class__.__mro__``) raises SecurityError.
        if isinstance(e, SecurityError):
            raise bad_request(f"the chat template is not allowed: {e}", "chat_template" if chat_template else None,
                              "unsafe_chat_template") from None
        if isinstance(e, TemplateSyntaxError) and chat_template:
            raise bad_request(f"the chat template does not compile: {e}", "chat_template") from None
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None


def _special_tokens(tokenizer: Any) -> dict[str, int]:
    """Special added tokens (the ones a tokenizer parses out of text) -> id."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: i for i, t in added.items() if getattr(t, "special", False) and t.content}


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """``text`` tokenized with no special-token parsing: ``<|im_start|>`` typed in it stays text."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], text: str, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids of ``text`` (``render_chat`` of these messages), where only the template's own
    special tokens are control tokens: special-token text inside message content is tokenized as
    plain text, so a user cannot forge a turn. When no content holds special-token text this is the
    ordinary tokenization. Otherwise the messages are rendered again with a random placeholder per
    such content; the template's text around the placeholders has its special tokens parsed, the
    contents do not. A template that changes content (so the placeholders cannot be mapped back onto
    ``text``) makes such a request a 400 rather than a guess."""
    specials = _special_tokens(tokenizer)
    dicts = messages_to_dicts(messages)
    marked = [i for i, d in enumerate(dicts) if isinstance(d.get("content"), str)
              and any(tok in d["content"] for tok in specials)]
    if not marked:
        return list(tokenizer.encode(text, add_special_tokens=False))  # the template has the special tokens
    nonce = secrets.token_hex(8)
    holders = {f"\u27e6{nonce}:{i}\u27e7": dicts[i]["content"] for i in marked}
    for holder, i in zip(holders, marked):
        dicts[i] = {**dicts[i], "content": holder}
    try:
        shaped = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               chat_template=chat_template, **(template_kwargs or {}))
    except Exception as e:
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    pieces = re.split("(" + "|".join(re.escape(h) for h in holders) + ")", shaped)
    if (sorted(p for p in pieces[1::2]) != sorted(holders)
            or "".join(holders.get(p, p) for p in pieces) != text):
        raise bad_request("a message's content holds special-token text and the chat template changes message "
                          "content, so the two cannot be told apart: remove the special-token text", "messages")
    special_re = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
    ids: list[int] = []
    plain = ""  # text since the last template special token (content included), tokenized in one piece
    for j, piece in enumerate(pieces):
        if j % 2:  # a content
            plain += holders[piece]
            continue
        for k, part in enumerate(special_re.split(piece)):
            if k % 2:  # one of the template's own special tokens
                ids += _encode_plain(tokenizer, plain)
                plain = ""
                ids.append(specials[part])
            else:
                plain += part
    return ids + _encode_plain(tokenizer, plain)


def chat_prompt(tokenizer: Any, req: Any, allow_special_tokens_in_content: bool | None = None) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a chat request's messages, as chat feeds them to the model
    (``chat_prompt_ids`` unless the request opts out with ``allow_special_tokens_in_content``).
    CPU-heavy: the server runs it on the engine's prep thread (AsyncLLM.run_prep)."""
    cont = getattr(req, "continue_final_message", False)
    template = getattr(req, "chat_template", None)
    kwargs = getattr(req, "chat_template_kwargs", None)
    text = render_chat(tokenizer, req.messages, req.add_generation_prompt, cont, template, kwargs)
    if allow_special_tokens_in_content is None:
        allow_special_tokens_in_content = bool(getattr(req, "allow_special_tokens_in_content", False))
    if allow_special_tokens_in_content:  # opt-out: special-token text in content is parsed
        return text, list(tokenizer.encode(text, add_special_tokens=False))  # the template has the special tokens
    return text, chat_prompt_ids(tokenizer, req.messages, text, req.add_generation_prompt, cont, template, kwargs)


class ChatServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tokenizer = state.engine.tokenizer

    def _check_unsupported(self, req: ChatCompletionRequest) -> None:
        if req.tools or (req.tool_choice not in (None, "none")):
            raise bad_request("tool calling is not supported by this server yet", "tools", "unsupported_parameter")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text (structured output) is not supported yet",
                              "response_format", "unsupported_parameter")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        st = self.state
        st.check_model(req.model)
        self._check_unsupported(req)
        # Template rendering and tokenizing are CPU work: on the engine's prep thread, with its tokenizer.
        text, ids = await st.engine.run_prep(chat_prompt, st.engine.prep_tokenizer, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        rid = new_id("chatcmpl")
        streams = await add_streams(st.engine, [{"prompt_token_ids": ids, "prompt": text}], params, rid, req.priority,
                              req.cache_salt, st.lora_request(req.model))
        ctx = _Ctx(self, req, rid, len(ids))
        if req.stream:
            return StreamingResponse(ctx.stream(merged(st.engine, streams, delta=True)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        outs = await until_disconnect(raw, final_outputs(st.engine, streams))
        return JSONResponse(ctx.full(outs[0]))


class _Ctx:
    def __init__(self, server: ChatServer, req: ChatCompletionRequest, rid: str, prompt_len: int) -> None:
        self.tok = server.tokenizer
        self.model = server.state.response_model(req.model)
        self.req = req
        self.rid = rid
        self.created = int(time.time())
        self.prompt_len = prompt_len
        self.top_k = req.top_logprobs or 0

    def _logprobs(self, token_ids: list[int], entries: Any) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return {"content": chat_logprobs(token_ids, entries, self.tok, self.top_k)}

    def full(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.prompt_len, completion_tokens),
                "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs, self.tok)}

    def _chunk(self, choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model, "choices": choices}
        if use is not None:
            chunk["usage"] = use
        return chunk

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        completion_tokens = 0
        try:
            for i in range(self.req.n):  # the role comes first, once per choice
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse(self._chunk([first], usage(self.prompt_len, 0) if continuous else None))
            async for _, out in outputs:
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    delta = {"content": c.text} if c.text else {}
                    choice = {"index": c.index, "delta": delta, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    chunk = self._chunk([choice], usage(self.prompt_len, completion_tokens) if continuous else None)
                    if out.prompt_logprobs is not None and c is out.outputs[0]:
                        chunk["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.tok)
                    yield sse(chunk)
            if include_usage:
                yield sse(self._chunk([], usage(self.prompt_len, completion_tokens)))
        except Exception as e:  # after the headers went out, an error can only be an event
            yield sse(from_exception(e).body())
        yield SSE_DONE
