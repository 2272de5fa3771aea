"""What the plugin's models share beyond vllite's public layers (``model_registry.layers``): the projections'
plain torch numerics, DaViT's sinusoid table, and the weight loader."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from model_registry.layers import TORCH_OPS, ReplicatedLinear, copy_checked


def linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> ReplicatedLinear:
    """The plugin's projections: plain ``F.linear`` (transformers' numerics, which the tests match token for token)."""
    return ReplicatedLinear(in_features, out_features, bias, dtype, ops=TORCH_OPS)


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
            copy_checked(named_buffers[name], tensor, hf_name)
            continue
        fused = next(((name.replace(frag, fused_frag), idx, n) for frag, fused_frag, idx, n in stacked
                      if frag in name), None)
        target = fused[0] if fused else name
        if target not in params:
            unexpected.append(hf_name)
            continue
        param = params[target]
        if fused is None:
            copy_checked(param.data, tensor, hf_name)
            loaded.update(aliases[id(param)])
            continue
        _, idx, n = fused
        rows = param.shape[0] // n
        copy_checked(param.data[idx * rows:(idx + 1) * rows], tensor, hf_name)
        seen = shards_seen.setdefault(target, set())
        seen.add(idx)
        if len(seen) == n:
            loaded.update(aliases[id(param)])
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ValueError(f"checkpoint has weights this model does not know: {shown}")
    return loaded


def model_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def cfg(config: Any, name: str, default: Any) -> Any:
    """``config.name``, or ``default`` when absent or None."""
    value = getattr(config, name, None)
    return default if value is None else value
