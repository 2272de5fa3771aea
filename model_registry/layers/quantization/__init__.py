"""Quantization methods of the linear layers, picked by name (``quantization=``; the core knows only the names,
``vllite_core.config.QUANTIZATION_METHODS``).

- ``int8`` (``int8.py``): W8A8, weights quantized per output row at load, activations per row at run time;
- ``gguf`` (``gguf.py``, ``kquants.py``): a GGUF checkpoint's Q8_0/Q4_0/Q4_1 blocks and Q4_K/Q5_K/Q6_K
  super-blocks kept and computed from.

A model takes part by listing the method in ``supported_quantization`` and building its projections from
``model_registry.layers.linear``; any other model is a ConfigError at start. This module imports no method at
import time (the methods import the layers, which import ``base``).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from vllite_core.config import QUANTIZATION_METHODS
from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.quantization")


def quantize_model(model: torch.nn.Module, method: str, source: Any = None) -> int:
    """Give every linear layer of ``model`` that ``method`` applies to its quantized layout; returns how many
    were. ``source``: the ``model_registry.source.ModelSource`` the weights came from (``gguf`` reads its blocks
    again)."""
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    if method not in getattr(model, "supported_quantization", ()):
        raise ConfigError(f"quantization: {type(model).__name__} does not support {method!r}")
    if method == "gguf":
        from model_registry.layers.quantization.gguf import use_gguf_blocks

        return use_gguf_blocks(model, source)
    from model_registry.layers.linear import LinearBase
    from model_registry.layers.quantization.int8 import INT8_LM_HEAD_ENV, Int8LinearMethod
    from model_registry.layers.vocab import ParallelLMHead

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    if not layers:
        raise ConfigError(f"quantization: {type(model).__name__} does not support {method!r}")
    before = sum(m.quant_method.weight_bytes(m) for m in layers)
    for m in layers:
        Int8LinearMethod.quantize(m)
    if os.environ.get(INT8_LM_HEAD_ENV) == "1":
        heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
        if len(heads) != 1:
            raise ConfigError(f"{INT8_LM_HEAD_ENV}=1: {type(model).__name__} cannot quantize its LM head")
        Int8LinearMethod.quantize_head(heads[0])
        logger.info("quantization %s: the LM head too (%s=1)", method, INT8_LM_HEAD_ENV)
    after = sum(m.quant_method.weight_bytes(m) for m in layers)
    logger.info("quantization %s: %d linear layers, weights %.1f -> %.1f MiB", method, len(layers),
                before / 2**20, after / 2**20)
    return len(layers)
