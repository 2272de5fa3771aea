"""Small building blocks with uninitialised storage (every weight comes from the checkpoint),
and the weight loader shared by the plugin's models."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm's computation (eps 1e-5 like transformers' BART and DaViT), without its init."""

    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.bias = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(num, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Conv2d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, padding: int, groups: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_ch, in_ch // groups, kernel, kernel, dtype=dtype)
        self.bias = _param(out_ch, dtype=dtype)
        self.stride, self.padding, self.groups = stride, padding, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, 1, self.groups)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "quick_gelu": _quick_gelu,
    "tanh": torch.tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise NotImplementedError(f"activation_function {name!r} is not supported "
                                  f"(supported: {', '.join(sorted(_ACTIVATIONS))})") from None


def sinusoid_table(num_positions: int, dim: int) -> torch.Tensor:
    """Interleaved sine/cosine table (even columns sine, odd columns cosine), as DaViT's temporal embedding."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / half))
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.empty(num_positions, dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table


# ---- weights -------------------------------------------------------------------------------------

# (checkpoint name fragment, fused parameter fragment, shard index, number of shards): the shards of a
# fused projection are equal row blocks of its weight (and bias).
Stacked = tuple[str, str, int, int]


@torch.no_grad()
def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                    rename: Callable[[str], str | None] = lambda n: n, stacked: Sequence[Stacked] = (),
                    buffers: Sequence[str] = ()) -> set[str]:
    """Copy checkpoint tensors into ``model``'s parameters; return the parameter names fully loaded.

    ``rename`` maps a checkpoint name to a parameter name (None: skip the tensor). Names in ``buffers``
    are copied into the module buffer of that name when the checkpoint has them (optional). A parameter
    shared under several names (tied embeddings) counts as loaded under all of them. A tensor the
    model does not know is an error, never silently dropped.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers())
    aliases: dict[int, list[str]] = {}
    for name, p in params.items():
        aliases.setdefault(id(p), []).append(name)
    loaded: set[str] = set()
    shards_seen: dict[str, set[int]] = {}
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        if name in buffers:
            _copy(named_buffers[name], tensor, hf_name)
            continue
        fused = next(((name.replace(frag, fused_frag), idx, n) for frag, fused_frag, idx, n in stacked
                      if frag in name), None)
        target = fused[0] if fused else name
        if target not in params:
            unexpected.append(hf_name)
            continue
        param = params[target]
        if fused is None:
            _copy(param.data, tensor, hf_name)
            loaded.update(aliases[id(param)])
            continue
        _, idx, n = fused
        rows = param.shape[0] // n
        _copy(param.data[idx * rows:(idx + 1) * rows], tensor, hf_name)
        seen = shards_seen.setdefault(target, set())
        seen.add(idx)
        if len(seen) == n:
            loaded.update(aliases[id(param)])
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ValueError(f"checkpoint has weights this model does not know: {shown}")
    return loaded


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the model's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def model_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def cfg(config: Any, name: str, default: Any) -> Any:
    """``config.name``, or ``default`` when absent or None."""
    value = getattr(config, name, None)
    return default if value is None else value
