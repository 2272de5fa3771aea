"""Request bodies of the OpenAI API (and vLLM's extensions), as strict pydantic models.

Strict, and unknown fields are refused: a typo like ``max_token`` is a 400 that
names the field, not a silently ignored option. Value ranges are checked once,
by SamplingParams and the engine (max_logprobs), so the limits live in one place; here
every integer is an int64 (``Int``) and every float finite (``allow_inf_nan=False``: the
``NaN`` / ``Infinity`` literals are refused), so nothing out of range reaches torch.
Responses are plain dicts built in the serving modules (cheaper per streamed
token than model serialization).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllite_core.entrypoints.openai.documented_fields import ChatDocumentedFields
from vllite_core.sampling_params import INT64_MAX, INT64_MIN

Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's; ignored (documented_fields)


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int] | None = None
    priority: Int = 0
    cache_salt: str | None = None  # a non-empty string: prefix-cache blocks are shared only with the same salt
    logits_processors: list[Any] | None = None  # refused: processors are global
    # Structured output (docs/structured_output.md): one of these per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"json" | "regex" | "choice" | "grammar" | ...: ...}
    guided_json: str | dict[str, Any] | None = None  # older vLLM names, aliases of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # refused: the backend is chosen at engine level
    best_of: Int | None = None  # refused unless equal to n: removed in V1


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None  # accepted, ignored (the model's processor decides the resolution)


class ImageURLPart(_Strict):
    """An image: a data: URL, or http(s) when the server allows its domain (--allowed-media-domains)."""

    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Strict):
    data: str  # base64
    format: str  # "wav" (other formats are refused naming input_audio.format)


class InputAudioPart(_Strict):
    """An audio clip, as OpenAI sends it: ``{"type": "input_audio", "input_audio": {"data", "format"}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(_Strict):
    url: str


class AudioURLPart(_Strict):
    """An audio clip by URL (vLLM's): a ``data:audio/wav;base64,`` URL, or http(s) from an allowed domain."""

    type: Literal["audio_url"]
    audio_url: AudioURL


ContentPart = Annotated[TextPart | ImageURLPart | InputAudioPart | AudioURLPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message; extra keys (tool_calls, ...) go to the chat template untouched."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: legacy_functions
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest, ChatDocumentedFields):
    messages: list[ChatMessage]
    max_tokens: Int | None = None  # deprecated by OpenAI, still accepted
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the last (assistant) message's content in front of the reply
    # vllite: special-token text typed in message content is plain text unless this is true
    allow_special_tokens_in_content: bool = False


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (serving_lora.py)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (serving_lora.py)."""

    lora_name: str
    lora_int_id: int | None = None
