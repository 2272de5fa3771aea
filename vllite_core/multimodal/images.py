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


def prompt_videos(prompt: Any, supported: tuple[str, ...]) -> list[list]:
    """The prompt's videos (``{"video": frames}`` or ``{"video": [frames, ...]}``), each as its list of RGB PIL
    frames; a video may be given as a list of PIL images or a uint8 array [frames, height, width, 3]."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("multi_modal_data"), dict):
        return []
    prompt_images(prompt, supported)  # the modality checks
    items = prompt["multi_modal_data"].get("video")
    if items is None:
        return []
    single = _is_frames(items)
    videos = [items] if single else list(items) if isinstance(items, (list, tuple)) else [items]
    return [_frames(v, i) for i, v in enumerate(videos)]


def _is_frames(x: Any) -> bool:
    return (isinstance(x, (list, tuple)) and bool(x) and _is_image(x[0])) or getattr(x, "ndim", 0) == 4


def _frames(video: Any, i: int) -> list:
    from PIL import Image

    if getattr(video, "ndim", 0) == 4:
        import numpy as np

        arr = np.asarray(video)
        if arr.dtype != np.uint8 or arr.shape[-1] != 3:
            raise MediaError("multi_modal_data", f"video {i} as an array must be uint8 [frames, height, width, 3], "
                             f"got {arr.dtype} {list(arr.shape)}")
        return [Image.fromarray(f) for f in arr]
    if not isinstance(video, (list, tuple)) or not video or not all(_is_image(f) for f in video):
        raise MediaError("multi_modal_data", f"video {i} must be a non-empty list of PIL images or a uint8 array")
    sizes = {f.size for f in video}
    if len(sizes) != 1:
        raise MediaError("multi_modal_data", f"video {i}: its frames differ in size ({sorted(sizes)})")
    return [f.convert("RGB") for f in video]


def check_mm_prompt(prompt: Any, supported: tuple[str, ...], config: MultiModalConfig) -> None:
    """Refuse a prompt's media before the model sees them: unsupported modalities, more items than
    ``limit_mm_per_prompt``, images (and video frames) over ``max_image_pixels``, audio that is not a clip."""
    from vllite_core.multimodal.audio import prompt_audios

    images = prompt_images(prompt, supported)
    videos = prompt_videos(prompt, supported)
    audios = prompt_audios(prompt, 16000)  # the rate of bare arrays matters only to the model
    for modality, items in (("image", images), ("video", videos), ("audio", audios)):
        limit = config.limit(modality)
        if len(items) > limit:
            raise MediaError("multi_modal_data", f"{len(items)} {modality}s in one prompt, more than "
                             f"limit_mm_per_prompt allows ({modality}: {limit})")
    for i, img in enumerate(images):
        check_pixels(img.width, img.height, config, f"image {i}")
    for i, frames in enumerate(videos):
        check_pixels(frames[0].width, frames[0].height, config, f"video {i}'s frames")


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


def hash_video(frames: list) -> str:
    """Content hash of a video: its frames' hashes in order."""
    return hashlib.sha256("".join(hash_image(f) for f in frames).encode()).hexdigest()


def hash_image(img: Any) -> str:
    """Content hash of a PIL image (mode, size and pixels): equal pictures share cache entries however they came."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()
