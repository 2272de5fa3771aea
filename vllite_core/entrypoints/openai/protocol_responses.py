"""The request body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it), and its
input items turned into chat messages.

Strict like the other bodies: an unknown field is a 400 naming it. ``input`` items are checked
here, by hand, so the 400 names the exact item and part (``input[2].content[0]``) that this
server cannot take (files, audio...). ``input_image`` parts become chat's ``image_url`` parts, so
images take the path chat's take (a multimodal model's processor)."""
from __future__ import annotations

from typing import Any

from vllite_core.entrypoints.openai.documented_fields import ResponsesDocumentedFields
from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol import ChatMessage, ImageURL, ImageURLPart, Int, TextPart, _Strict
from vllite_core.entrypoints.openai.responses_tools import call_message, merge_calls, output_message

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
IMAGE_DETAILS = ("auto", "low", "high", "original")
_ITEM_KEYS = {"type", "role", "content", "id", "status"}


class ResponsesRequest(_Strict, ResponsesDocumentedFields):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None


def check_unsupported(req: ResponsesRequest) -> None:
    """400 naming the field for what this server cannot do (never silently ignored)."""
    if req.truncation not in (None, "disabled"):
        raise bad_request("only truncation 'disabled' is supported", "truncation", "unsupported_parameter")
    if req.include:
        raise bad_request(f"include {req.include[0]!r} is not supported", "include", "unsupported_parameter")
    if req.background:
        raise bad_request("background responses are not supported", "background", "unsupported_parameter")
    check_text_format(req.text)


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` in chat's ``response_format`` shape (the Responses API puts the schema's
    fields at the top of ``format``; chat nests them under ``json_schema``), for structured output."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt.get("type", "text")}


def check_text_format(text: dict[str, Any] | None) -> None:
    if not text:
        return
    extra = sorted(set(text) - {"format"})
    if extra:
        raise bad_request(f"text.{extra[0]} is not supported", f"text.{extra[0]}", "unsupported_parameter")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        return
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format")
        return
    raise bad_request(f"text.format type {kind!r} is not supported (use 'text')", "text.format")


def _part(part: Any, where: str, role: str) -> TextPart | ImageURLPart:
    """One content part as chat's: text, or (in a user's message) an ``input_image`` by URL."""
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object with a type", where)
    kind = part.get("type")
    if kind == "input_image" and role == "user":
        return _image_part(part, where)
    if kind not in TEXT_PARTS:
        raise bad_request(f"{where}: content part type {kind!r} is not supported (text: {', '.join(TEXT_PARTS)}; "
                          "input_image in user messages)", where, "unsupported_content")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return TextPart(type="text", text=text)


def _image_part(part: dict[str, Any], where: str) -> ImageURLPart:
    """``{"type": "input_image", "image_url": URL, "detail": ...}``; uploaded files (``file_id``) are not
    stored here. ``detail`` is accepted and, as in chat, left to the model's processor."""
    extra = sorted(set(part) - {"type", "image_url", "detail", "file_id"})
    if extra:
        raise bad_request(f"{where}: unrecognized field {extra[0]!r}", f"{where}.{extra[0]}", "unknown_parameter")
    if part.get("file_id") is not None:
        raise bad_request(f"{where}.file_id: uploaded files are not served here (send image_url: a data: URL or "
                          "an http(s) URL)", f"{where}.file_id", "unsupported_content")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.image_url must be a URL string", f"{where}.image_url")
    detail = part.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise bad_request(f"{where}.detail must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}",
                          f"{where}.detail")
    return ImageURLPart(type="image_url", image_url=ImageURL(url=url, detail=detail))


def item_message(item: Any, i: int) -> ChatMessage:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "function_call":  # a call the model made earlier, and below its result (responses_tools)
        return call_message(item, where)
    if kind == "function_call_output":
        return output_message(item, where)
    if kind != "message":
        raise bad_request(f"{where}: input item type {kind!r} is not supported (only messages)", f"{where}.type",
                          "unsupported_input_item")
    extra = sorted(set(item) - _ITEM_KEYS)
    if extra:
        raise bad_request(f"{where}: unrecognized field {extra[0]!r}", f"{where}.{extra[0]}", "unknown_parameter")
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    parts = [_part(p, f"{where}.content[{j}]", role) for j, p in enumerate(content)]
    if all(isinstance(p, TextPart) for p in parts):  # text alone: one string, as before
        return ChatMessage(role=role, content="\n".join(p.text for p in parts))
    return ChatMessage(role=role, content=parts)


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The request's own messages (``instructions`` not included: they are not carried to a follow-up)."""
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)]
    if not req.input:
        raise bad_request("input must not be empty", "input")
    return merge_calls([item_message(item, i) for i, item in enumerate(req.input)])
