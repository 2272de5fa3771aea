"""On-the-fly weight quantization of a loaded model (``quantization=``).

``int8``: W8A8 with dynamic activations. Each linear layer's weight becomes int8 with one float32 scale
per output row (symmetric, ``scale = max|w_row| / 127``, round half to even); at run time every input row
gets its own scale the same way, the int8 x int8 products are summed exactly in int32 and the sum is
scaled back (``ModelOps.int8_linear``). Integer dot products are the fast path of CPUs with VNNI (about
twice bf16's rate on the hosts measured) and halve the weight bytes a decode step streams. The LM head
and embeddings stay in the model dtype (logits are where rounding shows most).

``gguf``: vLLM's name for running a GGUF checkpoint's quantized weights as they are. The linear layers whose
tensors are Q8_0, Q4_0 or Q4_1 keep their 32-weight blocks (``GGUFWeight``: the packed values plus a float32
scale, and minimum for Q4_1, per block) instead of the dequantised float copy: 0.63-1.13 bytes per weight
instead of 4. ``ModelOps.gguf_linear`` computes from them (the reference dequantises; the CPU platform's
kernel quantizes the activations per block to int8 and sums integer products, as llama.cpp does). Other
layers and tensor types stay as loaded. Only a GGUF checkpoint can use it.

A model takes part by listing the method in ``supported_quantization`` and giving its linear layers a
``quantize_int8()`` method (int8) or ``checkpoint_names`` and ``use_gguf_weight()`` (gguf; the built-in Llama
family's parallel linears); any other model is a ConfigError at start.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

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


GGUF_BLOCK = 32  # weights per block in Q8_0, Q4_0 and Q4_1
GGUF_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # ggml's ids, what the kernels take


@dataclass(frozen=True)
class GGUFWeight:
    """A linear weight [N, K] as GGUF blocks of 32 along K, repacked for computing (not GGUF's byte layout):
    ``qs`` int8 [N, K] (Q8_0) or uint8 [N, K / 2] (Q4_0, Q4_1; in each block's 16 bytes, byte j holds weight
    j in its low nibble and weight j + 16 in its high one, as GGUF stores them), ``d`` float32 [N, K / 32]
    the block scales, ``m`` float32 [N, K / 32] the Q4_1 block minimums (else None). Weight values:
    Q8_0 ``d * q``, Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``, in float32 as ``gguf.quants`` computes them."""

    qtype: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def type_id(self) -> int:
        return GGUF_TYPE_IDS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * GGUF_BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def dequantize_gguf(w: GGUFWeight) -> torch.Tensor:
    """The float32 weight [N, K] the blocks stand for (bit-identical to the dequantised load)."""
    n, k = w.shape
    d = w.d[:, :, None]
    if w.qtype == "Q8_0":
        return (d * w.qs.view(n, -1, GGUF_BLOCK).float()).reshape(n, k)
    b = w.qs.view(n, -1, GGUF_BLOCK // 2)
    q = torch.cat((b & 0x0F, b >> 4), dim=2).float()
    out = d * (q - 8.0) if w.qtype == "Q4_0" else d * q + w.m[:, :, None]
    return out.reshape(n, k)


def quantize_model(model: torch.nn.Module, method: str, source: Any = None) -> int:
    """Quantize every layer of ``model`` that supports ``method``; returns how many were. ``source``: the
    ``model_registry.source.ModelSource`` the weights came from (``gguf`` reads its blocks again)."""
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    if method == "gguf":
        if method not in getattr(model, "supported_quantization", ()):
            raise ConfigError(f"quantization: {type(model).__name__} does not support {method!r}")
        from model_registry.gguf_blocks import use_gguf_blocks

        return use_gguf_blocks(model, source)
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
