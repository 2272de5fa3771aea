"""The part of a multimodal prompt processor every placeholder-expanding model shares: the prompt's token ids
(tokenized text, or ``prompt_token_ids``), its images, and the check that each image has one placeholder."""
from __future__ import annotations

from typing import Any

from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext
from vllite_core.multimodal.images import prompt_images


def placeholder_prompt(prompt: Any, ctx: InputContext, image_id: int, modalities: tuple[str, ...]
                       ) -> tuple[str | None, list[int], list]:
    """(text, token ids with one ``image_id`` per image, images) of a user prompt."""
    tok = ctx.tokenizer
    images = prompt_images(prompt, modalities)
    text, ids = prompt_text_ids(prompt, ctx)
    found = ids.count(image_id)
    if found != len(images):
        raise InvalidRequestError("multi_modal_data", f"the prompt has {found} image placeholder(s) "
                                  f"({tok.convert_ids_to_tokens(image_id)!r}) for {len(images)} image(s)")
    return text, ids, images


def prompt_text_ids(prompt: Any, ctx: InputContext) -> tuple[str | None, list[int]]:
    """(text, token ids) of a user prompt: its ``prompt_token_ids``, else its text tokenized."""
    tok = ctx.tokenizer
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
        text, ids = prompt.get("prompt"), list(ids)
    else:
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", f"must be a string, got {type(text).__name__}")
        ids = list(tok.encode(text, add_special_tokens=True))
    return text, ids


def image_processor(ctx: InputContext) -> Any:
    """The folder's image processor (transformers picks its PIL backend when torchvision is missing)."""
    return _folder_processor(ctx, "image_processor")


def feature_extractor(ctx: InputContext) -> Any:
    """The folder's audio feature extractor (WhisperFeatureExtractor for Qwen2-Audio)."""
    return _folder_processor(ctx, "feature_extractor")


def _folder_processor(ctx: InputContext, kind: str) -> Any:
    try:
        return ctx.processor(kind)
    except OSError as e:
        raise InvalidRequestError("multi_modal_data", f"cannot load the model's {kind.replace('_', ' ')} "
                                  f"(preprocessor_config.json): {e}") from e
