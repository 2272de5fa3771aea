"""Parameters with uninitialised storage (every weight comes from the checkpoint, so no init cost) and
the loaders that fill them from full checkpoint tensors."""
from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter of ``shape`` whose values the checkpoint provides."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@torch.no_grad()
def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """``dst.copy_(src)`` after checking the shapes agree (the error names the checkpoint tensor)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the model's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def check_full(src: torch.Tensor, dim: int, full: int, name: str) -> None:
    """A sharded parameter's checkpoint tensor must be whole along the split dimension."""
    if src.dim() <= dim or src.shape[dim] != full:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not have {full} rows/columns "
                         f"along dimension {dim} as the model expects")


def load_parameter(param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
    """Fill ``param`` from a full checkpoint tensor: its ``weight_loader`` slices this rank's part."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_checked(param.data, src, name)
    else:
        loader(param, src, shard, name)
