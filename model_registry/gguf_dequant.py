"""Whole-tensor dequantisation of the common llama.cpp block formats (Q4_0, Q4_1, Q8_0) in torch.

``gguf.quants`` dequantises in numpy, group of rows by group of rows, on one thread: 2.2-5.6 s of
start-up for the default model's 210 Q4_1 tensors. The same arithmetic over the whole tensor at once
(float32, ``d * q + m`` in that order, so every value is bit-identical to ``gguf.quants``) takes a small
fraction of that. Other types return None and go through ``gguf.quants``.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

BLOCK = 32  # weights per block in all three formats
# Bytes per block, and where the packed weights start after the fp16 scale (and fp16 minimum).
_LAYOUT = {Q.Q4_0: (18, 2), Q.Q4_1: (20, 4), Q.Q8_0: (34, 2)}


def fast_types() -> frozenset:
    return frozenset(_LAYOUT)


def dequantize_blocks(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``raw``: the tensor's bytes (any shape, row-major blocks); returns float32 of ``shape``, or None
    for a type this module does not handle."""
    layout = _LAYOUT.get(qtype)
    if layout is None:
        return None
    nbytes, qs_at = layout
    blocks = torch.from_numpy(np.array(raw, copy=True).reshape(-1, nbytes))  # a memmap is read-only
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    qs = blocks[:, qs_at:]
    if qtype == Q.Q8_0:
        w = d * qs.contiguous().view(torch.int8).float()
    else:
        # Low nibbles are weights 0..15 of the block, high nibbles 16..31.
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()
        if qtype == Q.Q4_0:
            w = d * (q - 8.0)
        else:
            m = blocks[:, 2:4].contiguous().view(torch.float16).float()
            w = d * q + m
    return w.reshape(shape)
