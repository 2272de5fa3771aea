"""Convolutions of an encoder's input side (audio frames, image patches), as torch computes them (``F.conv1d``,
``F.conv2d``), without ``nn.Conv*``'s init: square kernels, zero padding, no dilation."""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.params import empty_param


class _Conv(nn.Module):
    dims: ClassVar[int]

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dtype: torch.dtype, stride: int = 1,
                 padding: int = 0, groups: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.weight = empty_param(out_channels, in_channels // groups, *(kernel_size,) * self.dims, dtype=dtype)
        self.bias = empty_param(out_channels, dtype=dtype) if bias else None
        self.stride, self.padding, self.groups = stride, padding, groups


class Conv1d(_Conv):
    """[B, C, L] -> [B, C', L']."""

    dims = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, self.stride, self.padding, 1, self.groups)


class Conv2d(_Conv):
    """[B, C, H, W] -> [B, C', H', W'] (``groups == in_channels``: depthwise)."""

    dims = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, 1, self.groups)
