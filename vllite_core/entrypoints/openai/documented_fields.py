"""OpenAI-documented request fields that clients send and this server has no use for.

SDKs, LangChain and agent frameworks send fields from OpenAI's reference (``metadata``, ``store``,
``service_tier``, ``prompt_cache_key``...). Refusing them breaks those clients; acting as if they
did something would be a lie. So, as vLLM does: each is accepted, ignored, and named once in the
server log (once per field per process, so the log does not grow per request). A value that asks
for something this server does not serve (an audio output, a stored prompt, a server-side
conversation) is a 400 that says so. Names OpenAI does not document stay a 400 naming the field
(the request models forbid extra keys).

The lists follow the ``openai`` package's ``completion_create_params`` / ``response_create_params``
types. The mixins below hold the fields the core request models lack; ``accept_*`` run per request.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from vllite_core.entrypoints.openai.errors import bad_request

logger = logging.getLogger("vllite.server")

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ChatDocumentedFields(_Fields):
    """Chat completions fields beyond those vllite acts on (``reasoning_effort`` is acted on: it goes
    to the chat template as vLLM passes it, for templates such as gpt-oss's that read it)."""

    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # deprecated by OpenAI for tools: translated (legacy_functions)
    function_call: str | dict[str, Any] | None = None


class ResponsesStreamOptions(_Fields):
    include_obfuscation: bool | None = None


class ResponsesDocumentedFields(_Fields):
    """Responses API fields beyond those vllite acts on."""

    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    conversation: str | dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    moderation: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: ResponsesStreamOptions | None = None
    top_logprobs: int | None = None


# Fields read by nothing here: accepted and logged once. (Fields acted on, or refused for some
# values, are not listed.)
IGNORED = {
    "completions": ("user",),
    "chat": ("metadata", "store", "user", "service_tier", "prediction", "web_search_options", "verbosity",
             "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
             "moderation"),
    "responses": ("metadata", "user", "access_programs", "background_options", "context_management", "image",
                  "max_tool_calls", "moderation", "prompt_cache_key", "prompt_cache_options",
                  "prompt_cache_retention", "safety_identifier", "service_tier", "top_logprobs"),
}
_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def log_ignored(endpoint: str, req: BaseModel) -> list[str]:
    """The ignored fields this request set; those not named in the log yet are named now."""
    names = [f for f in IGNORED[endpoint] if f in req.model_fields_set and getattr(req, f) is not None]
    opts = getattr(req, "stream_options", None)
    if opts is not None and "include_obfuscation" in opts.model_fields_set:
        names.append("stream_options.include_obfuscation")
    with _lock:
        new = [n for n in names if (endpoint, n) not in _logged]
        _logged.update((endpoint, n) for n in new)
    if new:
        logger.warning("/v1/%s: ignoring request field(s) %s: OpenAI documents them, nothing on this server acts "
                       "on them (named once per server)", endpoint.replace("chat", "chat/completions"),
                       ", ".join(new))
    return names


def accept_completion(req: Any) -> None:
    log_ignored("completions", req)


def accept_chat(req: Any) -> Any:
    """The request with its documented fields checked: refusals for what is not served, the
    ignored ones logged, ``reasoning_effort`` moved into the chat template's arguments
    (``functions`` / ``function_call``: legacy_functions.translate)."""
    if req.modalities is not None and "audio" in req.modalities:
        raise bad_request("modalities: audio output is not served by this server (only 'text')", "modalities",
                          "unsupported_value")
    if req.audio is not None:
        raise bad_request("audio output is not served by this server: leave audio unset", "audio",
                          "unsupported_value")
    log_ignored("chat", req)
    if req.reasoning_effort is None:
        return req
    kwargs = {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}
    return req.model_copy(update={"chat_template_kwargs": kwargs})


def accept_responses(req: Any) -> dict[str, Any] | None:
    """Checks as ``accept_chat``; returns the chat template arguments the request implies
    (``reasoning.effort`` as ``reasoning_effort``, as for chat), or None."""
    if req.conversation is not None:
        raise bad_request("server-side conversations are not served here: send the earlier turns in input or use "
                          "previous_response_id", "conversation", "unsupported_parameter")
    if req.prompt is not None:
        raise bad_request("stored prompt templates are not served here: send the prompt's text in input",
                          "prompt", "unsupported_parameter")
    log_ignored("responses", req)
    reasoning = req.reasoning or {}
    extra = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if extra:
        raise bad_request(f"reasoning.{extra[0]} is not a reasoning option", f"reasoning.{extra[0]}",
                          "unknown_parameter")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in ReasoningEffort.__args__:
        raise bad_request(f"reasoning.effort must be one of {', '.join(ReasoningEffort.__args__)}, got {effort!r}",
                          "reasoning")
    return {"reasoning_effort": effort}
