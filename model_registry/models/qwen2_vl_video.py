"""Qwen2-VL's pixel inputs: an image's patches from the folder's image processor, and a video's built from its
frames the same way. The image processor resizes, rescales and normalises one picture and writes each patch
with its pixels copied along the temporal axis (``temporal_patch_size`` copies); a video's patch instead holds
``temporal_patch_size`` consecutive frames there (the last frame repeated to fill the last group), in the same
row order (merge windows, then their patches), so a video's grid is (frames / temporal_patch_size, h, w).
Frames are taken as given (sampled at ``VIDEO_FPS``, Qwen's processors' default, for Qwen2.5-VL's time axis).
"""
from __future__ import annotations

from typing import Any

import torch

from vllite_core.errors import InvalidRequestError

VIDEO_FPS = 2.0


def image_patches(proc: Any, img: Any, vc: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(patches [t*h*w, C*tp*p*p], grid (t, h, w)) of one picture, checked against the vision tower's shape."""
    out = proc([img], return_tensors="pt")
    pixels, grid = out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])
    merge = int(vc.spatial_merge_size)
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    if pixels.shape[-1] != patch_dim or grid[1] % merge or grid[2] % merge:
        raise InvalidRequestError("multi_modal_data", f"the image processor gives patches of {pixels.shape[-1]} "
                                  f"values on a {grid} grid; the vision tower takes {patch_dim} on grids "
                                  f"divisible by {merge}")
    return pixels, grid  # type: ignore[return-value]


def video_patches(proc: Any, frames: list, vc: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(patches [t*h*w, C*tp*p*p], grid (t, h, w)) of a video's frames (all of one size)."""
    tp, p, c = int(vc.temporal_patch_size), int(vc.patch_size), int(vc.in_channels)
    per_frame, grid = [], None
    for frame in frames:
        pixels, grid = image_patches(proc, frame, vc)
        per_frame.append(pixels.view(pixels.shape[0], c, tp, p, p)[:, :, 0])  # one copy: [rows, C, p, p]
    per_frame += [per_frame[-1]] * (-len(per_frame) % tp)
    t, rows = len(per_frame) // tp, per_frame[0].shape[0]
    stacked = torch.stack(per_frame).view(t, tp, rows, c, p, p)
    assert grid is not None
    return stacked.permute(0, 2, 3, 1, 4, 5).reshape(t * rows, c * tp * p * p), (t, grid[1], grid[2])
