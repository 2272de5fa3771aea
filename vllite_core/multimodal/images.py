"""Images in prompts: taking them out of ``multi_modal_data``, checking them, decoding bytes, hashing content."""
from __future__ import annotations

import hashlib
import io
from typing import Any

from vllite_core.multimodal.config import MultiModalConfig
from vllite_core.multimodal.errors import MediaError


def _is_image(x: Any) -> bool:
    from PIL import Image

    return isinstance(x, Image.Image)


def prompt_images(prompt: Any, supported: tuple[str, ...] = ("image",)) -> list:
    """The prompt's images as a list (``{"image": img}`` or ``{"image": [imgs]}``); [] without media."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return []
    mm = prompt["multi_modal_data"]
    if not isinstance(mm, dict):
        raise MediaError("multi_modal_data", f"must be a dict such as {{'image': PIL.Image}}, got {type(mm).__name__}")
    unsupported = [k for k in mm if k not in supported]
    if unsupported:
        raise MediaError("multi_modal_data", f"modality {unsupported[0]!r} is not supported by this model "
                         f"(supported: {', '.join(supported)})")
    items = mm.get("image")
    if items is None:
        return []
    items = list(items) if isinstance(items, (list, tuple)) else [items]
    for i, img in enumerate(items):
        if not _is_image(img):
            raise MediaError("multi_modal_data", f"image {i} must be a PIL.Image, got {type(img).__name__}")
    return items


def check_mm_prompt(prompt: Any, supported: tuple[str, ...], config: MultiModalConfig) -> None:
    """Refuse a prompt's media before the model sees them: unsupported modalities, more items than
    ``limit_mm_per_prompt``, images over ``max_image_pixels``."""
    images = prompt_images(prompt, supported)
    limit = config.limit("image")
    if len(images) > limit:
        raise MediaError("multi_modal_data", f"{len(images)} images in one prompt, more than "
                         f"limit_mm_per_prompt allows (image: {limit})")
    for i, img in enumerate(images):
        check_pixels(img.width, img.height, config, f"image {i}")


def check_pixels(width: int, height: int, config: MultiModalConfig, what: str,
                 param: str = "multi_modal_data") -> None:
    if width <= 0 or height <= 0:
        raise MediaError(param, f"{what} is empty ({width}x{height})")
    if width * height > config.max_image_pixels:
        raise MediaError(param, f"{what} has {width}x{height} pixels, more than max_image_pixels="
                         f"{config.max_image_pixels}")


def decode_image(data: bytes, config: MultiModalConfig, param: str = "image_url"):
    """Bytes -> an RGB PIL image, checking the pixel cap on the header before decoding the pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        check_pixels(img.width, img.height, config, "the image", param)
        img.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise MediaError(param, f"cannot decode the image: {e}") from None
    return img.convert("RGB")


def hash_image(img: Any) -> str:
    """Content hash of a PIL image (mode, size and pixels): equal pictures share cache entries however they came."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()
