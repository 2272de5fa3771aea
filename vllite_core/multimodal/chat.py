"""Media in chat messages: ``image_url`` / ``image_pil`` parts (images), ``input_audio`` / ``audio_url`` parts
(audio clips).

Each media part becomes a marker in the message text (joined to the text parts with newlines, as text
templates expect a string); the rendered prompt is tokenized piece by piece around the markers and each
marker becomes the model's placeholder tokens for its modality, which the model's prompt processor expands.
A marker is a per-request nonce, so text typed by a user is never taken for media.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from vllite_core.multimodal.audio import AudioClip, load_audio_url, load_input_audio
from vllite_core.multimodal.config import MultiModalConfig
from vllite_core.multimodal.errors import MediaError
from vllite_core.multimodal.media import load_image_url

PARAM = "messages.content"
# Chat content part type -> the modality it carries.
PART_MODALITY = {"image_url": "image", "image_pil": "image", "input_audio": "audio", "audio_url": "audio"}
NOUNS = {"image": "images", "audio": "audio"}


@dataclass
class MediaMarker:
    """What stands for each modality's parts in the rendered prompt, and the model's tokens that replace it."""

    texts: dict[str, str]  # modality -> its marker text
    token_ids: dict[str, list[int]]  # modality -> its tokens: the placeholder, maybe wrapped (Qwen2-VL, audio)

    @classmethod
    def new(cls, token_ids: dict[str, list[int]]) -> "MediaMarker":
        nonce = secrets.token_hex(6)
        return cls({m: f"\u27e6{m}:{nonce}\u27e7" for m in token_ids}, {m: list(t) for m, t in token_ids.items()})

    @classmethod
    def for_engine(cls, engine: Any, modalities: set[str] | tuple[str, ...]) -> "MediaMarker":
        model_cls, hf_config = engine.model_cls, engine.model_info.hf_config
        return cls.new({m: model_cls.chat_audio_token_ids(hf_config, engine.tokenizer) if m == "audio"
                        else model_cls.chat_image_token_ids(hf_config) for m in modalities})

    def _split(self, text: str) -> list[str]:
        return re.split("(" + "|".join(re.escape(t) for t in self.texts.values()) + ")", text)

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """``encode`` of each piece of ``text`` between markers, the modality's tokens for each marker."""
        by_text = {t: self.token_ids[m] for m, t in self.texts.items()}
        ids: list[int] = []
        for k, piece in enumerate(self._split(text)):
            ids += by_text[piece] if k % 2 else encode(piece) if piece else []
        return ids

    def show(self, text: str, tokenizer: Any) -> str:
        """The rendered prompt with each marker written as its tokens."""
        for m, t in self.texts.items():
            text = text.replace(t, "".join(tokenizer.convert_ids_to_tokens(self.token_ids[m])))
        return text


def part_image_url(part: dict) -> str:
    """The URL of an ``image_url`` part (``{"url": ...}`` or, as OpenAI also accepts, a bare string)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise MediaError(PARAM + ".image_url", "an image_url part needs image_url.url")
    return url


def part_source(part: dict) -> Any:
    """What a media part's loader takes: an image URL or PIL image; for audio (part type, URL or
    ``input_audio`` dict)."""
    kind = part["type"]
    if kind == "image_url":
        return part_image_url(part)
    if kind == "audio_url":
        ref = part.get("audio_url")
        return kind, ref.get("url") if isinstance(ref, dict) else ref
    return (kind, part.get(kind)) if kind == "input_audio" else part.get(kind)


def part_modalities(messages: list[dict]) -> set[str]:
    """The modalities of the media parts in ``messages``."""
    return {PART_MODALITY[p["type"]] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") in PART_MODALITY}


def check_modalities(modalities: set[str], supported: tuple[str, ...], architecture: str) -> None:
    """A media part of a modality the model does not take: a MediaError naming a part of that kind."""
    for m in sorted(modalities - set(supported)):
        if not supported:
            raise MediaError(PARAM, f"{architecture} is a text-only model: it does not take {NOUNS[m]}")
        raise MediaError(PARAM + (".input_audio" if m == "audio" else ".image_url"),
                         f"{architecture} does not take {NOUNS[m]} (it takes: {', '.join(supported)})")


def flatten_messages(messages: list[dict], marker: MediaMarker | None) -> tuple[list[dict], dict[str, list[Any]]]:
    """Message dicts with list contents joined into strings (media parts as their modality's marker), and the
    media sources in order per modality (``part_source``)."""
    out: list[dict] = []
    sources: dict[str, list[Any]] = {}
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
            elif kind in PART_MODALITY:
                modality = PART_MODALITY[kind]
                if marker is None or modality not in marker.texts:
                    raise MediaError(PARAM, f"this model does not take {NOUNS[modality]}")
                sources.setdefault(modality, []).append(part_source(part))
                texts.append(marker.texts[modality])
            else:
                raise MediaError(PARAM + ".type", f"unsupported content part type {kind!r} "
                                 f"(text, {', '.join(PART_MODALITY)})")
        out.append({**m, "content": "\n".join(texts)})
    return out, sources


def _check_limit(modality: str, count: int, config: MultiModalConfig) -> None:
    limit = config.limit(modality)
    if count > limit:
        raise MediaError(PARAM, f"{count} {modality} parts in one request, more than limit_mm_per_prompt "
                         f"allows ({modality}: {limit})")


def load_images(sources: list[Any], config: MultiModalConfig) -> list[Any]:
    """URLs fetched or decoded, PIL images passed through; the count checked against limit_mm_per_prompt."""
    _check_limit("image", len(sources), config)
    return [load_image_url(s, config) if isinstance(s, str) else s for s in sources]


def load_audios(sources: list[Any], config: MultiModalConfig) -> list[AudioClip]:
    """``input_audio`` parts decoded, ``audio_url`` URLs decoded or fetched; the count checked first."""
    _check_limit("audio", len(sources), config)
    return [load_audio_url(s, config) if kind == "audio_url" else load_input_audio(s, config) for kind, s in sources]


def load_media(sources: dict[str, list[Any]], config: MultiModalConfig) -> dict[str, list[Any]]:
    """Each modality's sources loaded: the prompt's ``multi_modal_data``."""
    loaders = {"image": load_images, "audio": load_audios}
    return {m: loaders[m](items, config) for m, items in sources.items()}


def has_media(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") != "text"
                                                          for p in m["content"]) for m in messages)


def chat_engine_prompt(engine: Any, messages: list[dict], render: Callable[[list[dict]], str]) -> dict[str, Any]:
    """An engine prompt for a conversation rendered by ``render`` (messages -> text): ``{"prompt": text}`` when
    it has no media, else token ids with the model's placeholder tokens per media part and the media in
    ``multi_modal_data``. Offline use (LLM.chat, ``vllite chat``): special-token text in content is parsed."""
    if not has_media(messages):
        return {"prompt": render(messages)}
    modalities = part_modalities(messages)
    marker = None
    if engine.config.model_config.capabilities.is_multimodal_decoder:
        check_modalities(modalities, engine.model_cls.supported_modalities, engine.model_info.architecture)
        marker = MediaMarker.for_engine(engine, modalities)
    elif modalities:
        check_modalities(modalities, (), engine.model_info.architecture)
    flat, sources = flatten_messages(messages, marker)
    text = render(flat)
    if not sources or marker is None:
        return {"prompt": text}
    media = load_media(sources, engine.config.multimodal_config)
    tok = engine.tokenizer
    ids = marker.encode(text, lambda t: list(tok.encode(t, add_special_tokens=False)))
    shown = marker.show(text, tok)
    return {"prompt_token_ids": ids, "prompt": shown, "multi_modal_data": media}
