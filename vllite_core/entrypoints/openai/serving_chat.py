"""POST /v1/chat/completions: messages -> the model's chat template -> chat.completion."""
from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.entrypoints.openai import legacy_functions
from vllite_core.entrypoints.openai.chat_reasoning import DeltaSplitter, message_fields
from vllite_core.entrypoints.openai.documented_fields import accept_chat
from vllite_core.entrypoints.openai.errors import bad_request, from_exception
from vllite_core.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from vllite_core.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, TextPart
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
from vllite_core.entrypoints.openai.structured import apply_structured_outputs, plan_tools
from vllite_core.entrypoints.openai.template_sandbox import TemplateSandbox, render_job
from vllite_core.entrypoints.openai.tool_output import ToolOutput
from vllite_core.outputs import RequestOutput


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Text parts are joined with newlines: templates of text models expect a string."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "\n".join(getattr(p, "text", "") for p in m.content)
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


def _mark_special_contents(tokenizer: Any, dicts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``dicts`` with a random placeholder for each content that holds special-token text, and
    placeholder -> content (empty when no content does)."""
    specials = _special_tokens(tokenizer)
    marked = [i for i, d in enumerate(dicts) if isinstance(d.get("content"), str)
              and any(tok in d["content"] for tok in specials)]
    if not marked:
        return dicts, {}
    nonce = secrets.token_hex(8)
    holders = {f"\u27e6{nonce}:{i}\u27e7": dicts[i]["content"] for i in marked}
    dicts = list(dicts)
    for holder, i in zip(holders, marked):
        dicts[i] = {**dicts[i], "content": holder}
    return dicts, holders


def _ids_from_shaped(tokenizer: Any, text: str, shaped: str | None, holders: dict[str, str],
                     image_marker: Any = None) -> list[int]:
    """The token ids of ``text`` given ``shaped`` (the same render with ``holders`` for the contents
    holding special-token text): only the template's own special tokens are control tokens."""
    def encode_plain(t: str) -> list[int]:
        return image_marker.encode(t, lambda p: _encode_plain(tokenizer, p)) if image_marker else \
            _encode_plain(tokenizer, t)

    if not holders:  # the template has the special tokens
        if image_marker is not None:
            return image_marker.encode(text, lambda t: list(tokenizer.encode(t, add_special_tokens=False)))
        return list(tokenizer.encode(text, add_special_tokens=False))
    assert shaped is not None
    specials = _special_tokens(tokenizer)
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
                ids += encode_plain(plain)
                plain = ""
                ids.append(specials[part])
            else:
                plain += part
    return ids + encode_plain(plain)


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], text: str, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None, image_marker: Any = None) -> list[int]:
    """The token ids of ``text`` (``render_chat`` of these messages), where only the template's own
    special tokens are control tokens: special-token text inside message content is tokenized as
    plain text, so a user cannot forge a turn. When no content holds special-token text this is the
    ordinary tokenization. Otherwise the messages are rendered again with a random placeholder per
    such content; the template's text around the placeholders has its special tokens parsed, the
    contents do not. A template that changes content (so the placeholders cannot be mapped back onto
    ``text``) makes such a request a 400 rather than a guess. ``image_marker`` (multimodal.chat.MediaMarker):
    its texts in a content become the model's placeholder tokens. In-process rendering: the
    server renders in its sandbox instead (``render_chat_prompt``)."""
    dicts, holders = _mark_special_contents(tokenizer, messages_to_dicts(messages))
    shaped = None
    if holders:
        try:
            shaped = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                   continue_final_message=continue_final_message,
                                                   chat_template=chat_template, **(template_kwargs or {}))
        except Exception as e:
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    return _ids_from_shaped(tokenizer, text, shaped, holders, image_marker)


UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")


@dataclass(frozen=True)
class RenderedChat:
    """A chat request's prompt text as its template rendered it (in the sandbox), and what its
    tokenization needs: ``shaped``, the render with ``holders`` standing for the contents that hold
    special-token text (None when none do, or when such text is to be parsed: ``parse_specials``)."""
    text: str
    shaped: str | None = None
    holders: dict[str, str] = field(default_factory=dict)
    parse_specials: bool = False


async def render_chat_prompt(sandbox: TemplateSandbox, tokenizer: Any, req: Any,
                             allow_special_tokens_in_content: bool | None = None, default_template: str | None = None,
                             tools: list[dict[str, Any]] | None = None, trust_request_template: bool = False
                             ) -> RenderedChat:
    """Render a chat request's messages in the template sandbox (off the event loop and the prep
    thread, under its budget). A request's own ``chat_template`` (or one in ``chat_template_kwargs``)
    is refused unless the server trusts them (--trust-request-chat-template)."""
    kwargs = getattr(req, "chat_template_kwargs", None)
    own = getattr(req, "chat_template", None)
    if (own is not None or (kwargs and "chat_template" in kwargs)) and not trust_request_template:
        raise bad_request(UNTRUSTED_TEMPLATE, "chat_template", "untrusted_chat_template")
    messages = req.messages
    add, cont = req.add_generation_prompt, getattr(req, "continue_final_message", False)
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    if add and cont:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                          "continue_final_message")
    template = own or default_template
    if tools:  # templates that know tools describe them to the model
        kwargs = {"tools": tools, **(kwargs or {})}
    dicts = messages_to_dicts(messages)
    text = await sandbox.render(render_job(tokenizer, dicts, add, cont, template, kwargs, own is not None))
    if allow_special_tokens_in_content is None:
        allow_special_tokens_in_content = bool(getattr(req, "allow_special_tokens_in_content", False))
    if allow_special_tokens_in_content:
        return RenderedChat(text, parse_specials=True)
    marked, holders = _mark_special_contents(tokenizer, dicts)
    if not holders:
        return RenderedChat(text)
    shaped = await sandbox.render(render_job(tokenizer, marked, add, cont, template, kwargs, own is not None))
    return RenderedChat(text, shaped, holders)


def rendered_chat_ids(tokenizer: Any, rendered: RenderedChat, image_marker: Any = None) -> list[int]:
    """The token ids of a rendered chat (CPU work: on the engine's prep thread, with its tokenizer)."""
    if rendered.parse_specials:  # opt-out: special-token text in content is parsed
        encode = lambda t: list(tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
        return image_marker.encode(rendered.text, encode) if image_marker else encode(rendered.text)
    return _ids_from_shaped(tokenizer, rendered.text, rendered.shaped, rendered.holders, image_marker)


def echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's ``echo``: the last message's content when it is the assistant's (the one being
    continued), else nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    return messages_to_dicts(req.messages[-1:])[0].get("content") or ""


async def load_chat_media(state: ServerState, messages: list[ChatMessage]
                           ) -> tuple[list[ChatMessage], Any, dict[str, list[Any]]]:
    """Media parts (``image_url``, ``input_audio``, ``audio_url``) replaced by a marker the tokenization turns
    into the model's placeholder tokens, and the media loaded per modality (data URLs and base64 decoded,
    allowed http(s) URLs fetched off the event loop). Shared by every route that takes chat-shaped messages
    (chat, Responses, Anthropic Messages and count_tokens)."""
    from vllite_core.multimodal import chat as mm_chat

    parts = [p for m in messages if isinstance(m.content, list) for p in m.content if p.type in mm_chat.PART_MODALITY]
    if not parts:
        return messages, None, {}
    engine = state.engine.engine
    modalities = {mm_chat.PART_MODALITY[p.type] for p in parts}
    if not engine.config.model_config.capabilities.is_multimodal_decoder:
        kind = "audio" if "audio" in modalities else "images"
        raise bad_request(f"{engine.model_info.architecture} is a text-only model: it does not take "
                          f"{kind}", "messages.content." + ("input_audio" if kind == "audio" else "image_url"))
    mm_chat.check_modalities(modalities, engine.model_cls.supported_modalities, engine.model_info.architecture)
    marker = mm_chat.MediaMarker.for_engine(engine, modalities)
    sources: dict[str, list[Any]] = {}
    for p in parts:
        sources.setdefault(mm_chat.PART_MODALITY[p.type], []).append(mm_chat.part_source(p.model_dump()))
    media = await asyncio.to_thread(mm_chat.load_media, sources, engine.config.multimodal_config)
    out = []
    for m in messages:
        if isinstance(m.content, list) and any(p.type in mm_chat.PART_MODALITY for p in m.content):
            content = [TextPart(type="text", text=marker.texts[mm_chat.PART_MODALITY[p.type]])
                       if p.type in mm_chat.PART_MODALITY else p for p in m.content]
            m = m.model_copy(update={"content": content})
        out.append(m)
    return out, marker, media


async def engine_chat_prompt(state: ServerState, req: Any, template_tools: list[dict[str, Any]] | None
                             ) -> tuple[Any, list[int]]:
    """(the engine prompt, its token ids) for a chat-shaped request (``messages``, ``add_generation_prompt``,
    ...): media loaded, the template rendered in the sandbox, tokenized on the engine's prep thread, and
    with media the model's processor expanding their placeholders, so the ids are what the model reads."""
    messages, marker, media = await load_chat_media(state, req.messages)
    if media:
        req = SimpleNamespace(**{**vars(req), "messages": messages}) if isinstance(req, SimpleNamespace) \
            else req.model_copy(update={"messages": messages})
    tokenizer = state.engine.tokenizer
    rendered = await state.within_timeout(render_chat_prompt(
        state.templates, tokenizer, req, None, state.chat_template, template_tools,
        state.trust_request_chat_template))
    text = rendered.text
    ids = await state.within_timeout(state.engine.run_prep(rendered_chat_ids, state.engine.prep_tokenizer,
                                                           rendered, marker))
    prompt: Any = {"prompt_token_ids": ids, "prompt": text}
    if media:
        prompt["multi_modal_data"] = media
        prompt["prompt"] = marker.show(text, tokenizer)
        # The model's processor expands the placeholders (off the event loop): usage counts the expanded prompt.
        prompt = await state.engine.run_prep(state.engine.engine.process_prompt, prompt, state.engine._prep_ctx)
        ids = prompt.prompt_token_ids
    return prompt, ids


class ChatServer:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tokenizer = state.engine.tokenizer

    def _check_unsupported(self, req: ChatCompletionRequest) -> None:
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        st = self.state
        st.check_model(req.model)
        self._check_unsupported(req)
        req = legacy_functions.translate(accept_chat(req))  # functions / function_call: on the tools path
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if plan.mode == "auto" and not (st.enable_auto_tool_choice and st.tool_parser is not None):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                              "tool_choice")
        prompt, ids = await engine_chat_prompt(st, req, plan.template_tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                    st.engine.engine.default_sampling_params)
        await asyncio.to_thread(apply_structured_outputs, st.engine, req, params, plan)  # backend checks: CPU
        tools = ToolOutput(plan, st.tool_parser)
        if any(p is not None and p.keeps_special_tokens for p in (tools.parser, st.reasoning_parser)):
            params.skip_special_tokens = False  # the format's markers are control tokens (as vLLM's parsers ask)
        rid = new_id("chatcmpl")
        streams = await add_streams(st.engine, [prompt], params, rid, req.priority,
                                    req.cache_salt, st.lora_request(req.model), max_tokens)
        ctx = _Ctx(self, req, rid, len(ids), tools)
        if req.stream:
            return StreamingResponse(ctx.stream(merged(st.engine, streams, delta=True)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        outs = await until_disconnect(raw, final_outputs(st.engine, streams))
        return JSONResponse(ctx.full(outs[0]))


class _Ctx:
    def __init__(self, server: ChatServer, req: ChatCompletionRequest, rid: str, prompt_len: int,
                 tools: "ToolOutput") -> None:
        self.tools = tools
        self.tok = server.tokenizer
        self.model = server.state.response_model(req.model)
        self.req = req
        self.rid = rid
        self.created = int(time.time())
        self.prompt_len = prompt_len
        self.top_k = req.top_logprobs or 0
        self.parser = server.state.reasoning_parser
        self.echo = echo_text(req)
        self.legacy = req.functions is not None  # answered as function_call (legacy_functions)

    def _logprobs(self, token_ids: list[int], entries: Any) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return {"content": chat_logprobs(token_ids, entries, self.tok, self.top_k)}

    def full(self, out: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            message, finish = self._message(c.text, c.finish_reason)
            if self.legacy:
                message, finish = legacy_functions.message(message, finish)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.prompt_len, completion_tokens),
                "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs, self.tok)}

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """Reasoning split off first (--reasoning-parser), then tool calls parsed from the content."""
        fields = message_fields(self.parser, text)
        content = fields.pop("content")
        msg, finish = self.tools.message(content or "", finish)
        if content is None and not msg.get("tool_calls"):
            msg["content"] = None
        msg.update(fields)
        if self.echo:  # vLLM: the echoed final message goes in front of the content
            msg["content"] = self.echo + (msg["content"] or "")
        return msg, finish

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
                if self.echo:
                    echoed = {"index": i, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}
                    yield sse(self._chunk([echoed], usage(self.prompt_len, 0) if continuous else None))
            splitter = DeltaSplitter(self.parser)
            async for _, out in outputs:
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    delta = splitter.delta(c.index, c.text, c.token_ids, c.finish_reason is not None)
                    tool_delta, finish = self.tools.delta(c.index, delta.pop("content", None) or "", c.finish_reason)
                    delta.update(tool_delta)
                    if self.legacy:
                        delta, finish = legacy_functions.delta(delta, finish)
                    choice = {"index": c.index, "delta": delta, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                              "finish_reason": finish, "stop_reason": c.stop_reason}
                    chunk = self._chunk([choice], usage(self.prompt_len, completion_tokens) if continuous else None)
                    if out.prompt_logprobs is not None and c is out.outputs[0]:
                        chunk["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.tok)
                    yield sse(chunk)
            if include_usage:
                yield sse(self._chunk([], usage(self.prompt_len, completion_tokens)))
        except Exception as e:  # after the headers went out, an error can only be an event
            yield sse(from_exception(e).body())
        yield SSE_DONE
