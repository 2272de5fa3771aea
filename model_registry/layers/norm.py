"""Normalisation layers, in the order transformers computes them (the numerics models are tested against)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.params import check_full, copy_checked, empty_param
from vllite_core.distributed import get_tp
from vllite_core.model_ops import ModelOps, current_model_ops


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, in float32, cast back (FalconMamba's B, C and dt; Mamba2's gate)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (Llama's order), through the platform's ops (which
    may fuse the residual add: ``add_forward``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: ModelOps | None = None) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype)
        self.eps = eps
        self.ops = ops or current_model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; may reuse both inputs' storage."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a dimension of ``full`` values split over the tensor-parallel ranks (OLMoE's q/k norm over
    all heads, when the heads are split): this rank holds values ``[start, stop)`` and their weights; the sum of
    squares is summed over ranks (one all-reduce of [T] floats). ``replicas``: ranks holding each value (KV heads
    replicated over more ranks than there are heads), divided out of the sum."""

    def __init__(self, full: int, shard: tuple[int, int], eps: float, dtype: torch.dtype, replicas: int = 1) -> None:
        super().__init__()
        self.full, self.shard, self.eps, self.replicas = full, shard, eps, replicas
        self.weight = empty_param(shard[1] - shard[0], dtype=dtype)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.tp = get_tp()

    @torch.no_grad()
    def _load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        check_full(src, 0, self.full, name)
        copy_checked(param.data, src[self.shard[0]:self.shard[1]], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = self.tp.communicator.all_reduce(h.pow(2).sum(-1, keepdim=True))
        if self.replicas != 1:
            squares = squares / self.replicas
        return self.weight * (h * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """The ``(1 + w)`` form (Gemma): normalised and scaled in float32, then cast back, as transformers does; the
    checkpoint stores ``w`` (zero means the identity scale)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """torch's layer norm over the last dimension (transformers' ``nn.LayerNorm``), without its init."""

    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype)
        self.bias = empty_param(dim, dtype=dtype) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
