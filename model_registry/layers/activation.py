"""Activations by their Hugging Face names (``hidden_act``), and the gated form of a fused gate/up projection."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "tanh": torch.tanh,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers names ``name``; NotImplementedError names the supported ones."""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise NotImplementedError(f"activation {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return fn


def gated(name: str, x: torch.Tensor) -> torch.Tensor:
    """``act(x[..., :n]) * x[..., n:]`` for ``x`` of last dimension ``2n`` (the fused gate/up product)."""
    gate, up = x.chunk(2, dim=-1)
    return get_act_fn(name)(gate) * up
