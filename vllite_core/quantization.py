"""On-the-fly weight quantization of a loaded model (``quantization=``).

``int8``: W8A8 with dynamic activations. Each linear layer's weight becomes int8 with one float32 scale
per output row (symmetric, ``scale = max|w_row| / 127``, round half to even); at run time every input row
gets its own scale the same way, the int8 x int8 products are summed exactly in int32 and the sum is
scaled back (``ModelOps.int8_linear``). Integer dot products are the fast path of CPUs with VNNI (about
twice bf16's rate on the hosts measured) and halve the weight bytes a decode step streams. The LM head
and embeddings stay in the model dtype (logits are where rounding shows most).

A model takes part by listing the method in ``supported_quantization`` and giving its linear layers a
``quantize_int8()`` method (the built-in Llama family's parallel linears); any other model is a
ConfigError at start.
"""
from __future__ import annotations

import logging

import torch

from vllite_core.config import QUANTIZATION_METHODS, ConfigError

logger = logging.getLogger("vllite.quantization")

INT8_MAX = 127.0


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) with ``w[i] ~= q[i] * scale[i]``; an all-zero row gets scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_model(model: torch.nn.Module, method: str) -> int:
    """Quantize every layer of ``model`` that supports ``method``; returns how many were."""
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    layers = [m for m in model.modules() if callable(getattr(m, "quantize_int8", None))]
    if method not in getattr(model, "supported_quantization", ()) or not layers:
        raise ConfigError(f"quantization: {type(model).__name__} does not support {method!r}")
    before = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    for m in layers:
        m.quantize_int8()
    after = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4 for m in layers)
    logger.info("quantization %s: %d linear layers, weights %.1f -> %.1f MiB", method, len(layers),
                before / 2**20, after / 2**20)
    return len(layers)
