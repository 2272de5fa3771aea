"""Loading a checkpoint whose names are the model's own parameter names (after optional renames)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from model_registry.layers.params import load_parameter


@torch.no_grad()
def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 rename: Callable[[str], str | None] = lambda n: n,
                 stacked: Sequence[tuple[str, str, str]] = ()) -> set[str]:
    """Copy each HF tensor into the parameter of the same name through its loader (``rename`` maps a
    checkpoint name to a parameter name, or None to skip it); returns the parameter names loaded. A name
    that is no parameter goes to a fused one through ``stacked`` ((fragment, fused fragment, shard)), which
    counts as loaded once every shard ``stacked`` names for it arrived. Unknown names and shape mismatches
    are errors, never silently dropped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    shards_of: dict[str, set[str]] = {}
    for _, fused, shard in stacked:
        shards_of.setdefault(fused, set()).add(shard)
    arrived: dict[str, set[str]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        param = params.get(name)
        if param is not None:
            load_parameter(param, tensor, None, hf_name)
            loaded.add(name)
            continue
        target = next(((name.replace(part, fused), fused, shard) for part, fused, shard in stacked
                       if part in name and name.replace(part, fused) in params), None)
        if target is None:
            unexpected.append(hf_name)
            continue
        fused_name, fused, shard = target
        load_parameter(params[fused_name], tensor, shard, hf_name)
        arrived.setdefault(fused_name, set()).add(shard)
        if arrived[fused_name] == shards_of[fused]:
            loaded.add(fused_name)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ValueError(f"checkpoint has weights this model does not know: {shown}")
    return loaded
