"""Images in chat messages: ``{"type": "image_url", "image_url": {"url": ...}}`` content parts.

Each image part becomes a marker in the message text (joined to the text parts with newlines, as text
templates expect a string); the rendered prompt is tokenized piece by piece around the markers and each
marker becomes the model's image placeholder token, which the model's prompt processor expands. A marker is
a per-request nonce, so text typed by a user is never taken for an image.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable

from vllite_core.multimodal.config import MultiModalConfig
from vllite_core.multimodal.errors import MediaError
from vllite_core.multimodal.media import load_image_url

PARAM = "messages.content"


@dataclass
class ImageMarker:
    text: str  # what stands for an image in the rendered prompt
    token_ids: list[int]  # what replaces it: the model's placeholder token, maybe wrapped (Qwen2-VL)

    @classmethod
    def new(cls, token_ids: list[int]) -> "ImageMarker":
        return cls(f"\u27e6image:{secrets.token_hex(6)}\u27e7", list(token_ids))

    @classmethod
    def for_engine(cls, engine: Any) -> "ImageMarker":
        return cls.new(engine.model_cls.chat_image_token_ids(engine.model_info.hf_config))

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """``encode`` of each piece of ``text`` between markers, the image's tokens for each marker."""
        if self.text not in text:
            return encode(text)
        ids: list[int] = []
        for k, piece in enumerate(text.split(self.text)):
            if k:
                ids += self.token_ids
            ids += encode(piece) if piece else []
        return ids

    def show(self, text: str, tokenizer: Any) -> str:
        """The rendered prompt with each marker written as its tokens."""
        return text.replace(self.text, "".join(tokenizer.convert_ids_to_tokens(self.token_ids)))


def part_image_url(part: dict) -> str:
    """The URL of an ``image_url`` part (``{"url": ...}`` or, as OpenAI also accepts, a bare string)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise MediaError(PARAM + ".image_url", "an image_url part needs image_url.url")
    return url


def flatten_messages(messages: list[dict], marker: str | None) -> tuple[list[dict], list[Any]]:
    """Message dicts with list contents joined into strings (image parts as ``marker``), and the image
    sources in order: a URL string per ``image_url`` part, a PIL image per ``image_pil`` part (vLLM's)."""
    out: list[dict] = []
    sources: list[Any] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(part.get("text", ""))
            elif kind in ("image_url", "image_pil"):
                if marker is None:
                    raise MediaError(PARAM, "this model is text-only: it does not take images")
                sources.append(part_image_url(part) if kind == "image_url" else part.get("image_pil"))
                texts.append(marker)
            else:
                raise MediaError(PARAM + ".type", f"unsupported content part type {kind!r} (text, image_url)")
        out.append({**m, "content": "\n".join(texts)})
    return out, sources


def load_images(sources: list[Any], config: MultiModalConfig) -> list[Any]:
    """URLs fetched or decoded, PIL images passed through; the count checked against limit_mm_per_prompt."""
    limit = config.limit("image")
    if len(sources) > limit:
        raise MediaError(PARAM, f"{len(sources)} images in one request, more than limit_mm_per_prompt allows "
                         f"(image: {limit})")
    return [load_image_url(s, config) if isinstance(s, str) else s for s in sources]


def has_media(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") != "text"
                                                          for p in m["content"]) for m in messages)


def chat_engine_prompt(engine: Any, messages: list[dict], render: Callable[[list[dict]], str]) -> dict[str, Any]:
    """An engine prompt for a conversation rendered by ``render`` (messages -> text): ``{"prompt": text}`` when
    it has no media, else token ids with one placeholder token per image and the images in
    ``multi_modal_data``. Offline use (LLM.chat, ``vllite chat``): special-token text in content is parsed."""
    if not has_media(messages):
        return {"prompt": render(messages)}
    marker = None
    if engine.config.model_config.capabilities.is_multimodal_decoder:
        marker = ImageMarker.for_engine(engine)
    flat, sources = flatten_messages(messages, marker.text if marker else None)
    text = render(flat)
    if not sources or marker is None:
        return {"prompt": text}
    images = load_images(sources, engine.config.multimodal_config)
    tok = engine.tokenizer
    ids = marker.encode(text, lambda t: list(tok.encode(t, add_special_tokens=False)))
    shown = marker.show(text, tok)
    return {"prompt_token_ids": ids, "prompt": shown, "multi_modal_data": {"image": images}}
