"""Loading a checkpoint whose names are the model's own parameter names (after optional renames)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from model_registry.layers.params import load_parameter


@torch.no_grad()
def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 rename: Callable[[str], str | None] = lambda n: n) -> set[str]:
    """Copy each HF tensor into the parameter of the same name through its loader (``rename`` maps a
    checkpoint name to a parameter name, or None to skip it); returns the parameter names loaded. Unknown
    names and shape mismatches are errors, never silently dropped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        load_parameter(param, tensor, None, hf_name)
        loaded.add(name)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ValueError(f"checkpoint has weights this model does not know: {shown}")
    return loaded
