"""On-the-fly weight quantization of a loaded model (``quantization=``).

``int8``: W8A8 with dynamic activations. Each linear layer's weight becomes int8 with one float32 scale
per output row (symmetric, ``scale = max|w_row| / 127``, round half to even); at run time every input row
gets its own scale the same way, the int8 x int8 products are summed exactly in int32 and the sum is
scaled back (``ModelOps.int8_linear``). Integer dot products are the fast path of CPUs with VNNI (about
twice bf16's rate on the hosts measured) and halve the weight bytes a decode step streams. The LM head
and embeddings stay in the model dtype, as vLLM keeps its LM heads in online quantization; with
``VLLITE_INT8_LM_HEAD=1`` the LM head is quantized the same way too (as llama.cpp's quantized files do; a model
takes part with a ``quantize_lm_head_int8()`` method): a batch-64 SmolLM2 decode step on a VNNI CPU spends
about a sixth of its time in the bf16 head (docs/benchmarks.md has the measured speed and accuracy cost).

``gguf``: vLLM's name for running a GGUF checkpoint's quantized weights as they are. The linear layers whose
tensors are Q8_0, Q4_0 or Q4_1 keep their 32-weight blocks (``GGUFWeight``: the packed values plus an fp16
scale, and minimum for Q4_1, per block; 8 output rows interleaved) instead of the dequantised float copy:
0.56-1.06 bytes per weight instead of 4. ``ModelOps.gguf_linear`` computes from them (the reference
dequantises; the CPU platform's kernel quantizes the activations per block to int8 and sums integer
products, as llama.cpp does). Other layers and tensor types stay as loaded. Only a GGUF checkpoint can use it.

A model takes part by listing the method in ``supported_quantization`` and giving its linear layers a
``quantize_int8()`` method (int8) or ``checkpoint_names`` and ``use_gguf_weight()`` (gguf; the built-in Llama
family's parallel linears); any other model is a ConfigError at start.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from vllite_core.config import QUANTIZATION_METHODS, ConfigError

logger = logging.getLogger("vllite.quantization")

INT8_MAX = 127.0
INT8_LM_HEAD_ENV = "VLLITE_INT8_LM_HEAD"  # "1": quantization="int8" quantizes the LM head too


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) with ``w[i] ~= q[i] * scale[i]``; an all-zero row gets scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


GGUF_BLOCK = 32  # weights per block in Q8_0, Q4_0 and Q4_1
GGUF_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # ggml's ids, what the kernels take


GGUF_GROUP = 8  # output rows whose blocks are interleaved in a GGUFWeight
_QBYTES = {"Q8_0": 256, "Q4_0": 128, "Q4_1": 128}  # packed values of one block of GGUF_GROUP rows
GGUF_RECORD = {"Q8_0": 256 + 16, "Q4_0": 128 + 16, "Q4_1": 128 + 32}  # + fp16 scales (and Q4_1 minimums)


@dataclass(frozen=True)
class GGUFWeight:
    """A linear weight [N, K] as GGUF blocks of 32 along K, repacked once for computing: ``blocks`` uint8
    [ceil(N / 8), K / 32 * record], one record per (group of 8 output rows, block), so a kernel reads a group's
    8 rows as one sequential stream and gets 8 outputs per block without a horizontal sum (rows past N in the
    last group are zeros). A record is the packed values, then the 8 rows' fp16 scales ``d``, then (Q4_1)
    their fp16 minimums ``m``, each an 8-vector; the values are chunks of 32 bytes, byte 4 * r + i of chunk t
    holding, for row r of the group: Q8_0 (8 chunks) weight 4t + i as int8; Q4_0/Q4_1 (4 chunks) weight
    4t + i in its low nibble and 16 + 4t + i in its high one. Record bytes: 272 (Q8_0), 144 (Q4_0), 160
    (Q4_1), GGUF's own sizes (34, 18, 20 per row) times 8. Weight values: Q8_0 ``d * q``, Q4_0
    ``d * (q - 8)``, Q4_1 ``d * q + m`` in float32, as ``gguf.quants`` computes them."""

    qtype: str
    blocks: torch.Tensor
    rows: int

    @property
    def type_id(self) -> int:
        return GGUF_TYPE_IDS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.blocks.shape[1] // GGUF_RECORD[self.qtype] * GGUF_BLOCK

    def nbytes(self) -> int:
        return self.blocks.numel()


def pack_gguf(qtype: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> GGUFWeight:
    """A ``GGUFWeight`` from GGUF's per-row fields: ``qs`` int8 [N, K] (Q8_0) or uint8 [N, K / 2] (Q4_0,
    Q4_1: in each block's 16 bytes, byte j holds weight j in its low nibble and j + 16 in its high one, as GGUF
    stores them); ``d`` (and ``m`` for Q4_1) [N, K / 32] the fp16 block scales (minimums), any float dtype
    holding fp16 values."""
    n, nb = d.shape
    g = -(-n // GGUF_GROUP)
    pad = g * GGUF_GROUP - n

    def grouped(t: torch.Tensor, per: int) -> torch.Tensor:  # [N, nb, per] uint8 -> [G, 8, nb, per], zero rows
        t = t.contiguous().view(torch.uint8).reshape(n, nb, per)
        return torch.cat((t, t.new_zeros(pad, nb, per))).view(g, GGUF_GROUP, nb, per)

    chunks = 8 if qtype == "Q8_0" else 4
    q = grouped(qs, _QBYTES[qtype] // GGUF_GROUP).view(g, GGUF_GROUP, nb, chunks, 4).permute(0, 2, 3, 1, 4)
    parts = [q.reshape(g, nb, _QBYTES[qtype])]
    for s in (d, m) if qtype == "Q4_1" else (d,):
        parts.append(grouped(s.to(torch.float16), 2).permute(0, 2, 1, 3).reshape(g, nb, 2 * GGUF_GROUP))
    return GGUFWeight(qtype, torch.cat(parts, dim=2).reshape(g, -1).contiguous(), n)


def unpack_gguf(w: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_gguf``'s inverse: (qs, d, m) with ``d``/``m`` float32 (None for m but Q4_1)."""
    n, k = w.shape
    nb, g, qb = k // GGUF_BLOCK, w.blocks.shape[0], _QBYTES[w.qtype]
    rec = w.blocks.view(g, nb, GGUF_RECORD[w.qtype])
    chunks = 8 if w.qtype == "Q8_0" else 4
    qs = rec[:, :, :qb].reshape(g, nb, chunks, GGUF_GROUP, 4).permute(0, 3, 1, 2, 4).reshape(g * GGUF_GROUP, -1)[:n]

    def scales(lo: int) -> torch.Tensor:
        s = rec[:, :, lo:lo + 2 * GGUF_GROUP].reshape(g, nb, GGUF_GROUP, 2).permute(0, 2, 1, 3).contiguous()
        return s.view(torch.float16).reshape(g * GGUF_GROUP, nb)[:n].float()

    qs = qs.contiguous().view(torch.int8) if w.qtype == "Q8_0" else qs.contiguous()
    return qs, scales(qb), scales(qb + 2 * GGUF_GROUP) if w.qtype == "Q4_1" else None


def dequantize_gguf(w: GGUFWeight) -> torch.Tensor:
    """The float32 weight [N, K] the blocks stand for (bit-identical to the dequantised load)."""
    n, k = w.shape
    qs, d, m = unpack_gguf(w)
    d = d[:, :, None]
    if w.qtype == "Q8_0":
        return (d * qs.view(n, -1, GGUF_BLOCK).float()).reshape(n, k)
    b = qs.view(n, -1, GGUF_BLOCK // 2)
    q = torch.cat((b & 0x0F, b >> 4), dim=2).float()
    out = d * (q - 8.0) if w.qtype == "Q4_0" else d * q + m[:, :, None]
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
    if os.environ.get(INT8_LM_HEAD_ENV) == "1":
        head = getattr(model, "quantize_lm_head_int8", None)
        if head is None:
            raise ConfigError(f"{INT8_LM_HEAD_ENV}=1: {type(model).__name__} cannot quantize its LM head")
        head()
        logger.info("quantization %s: the LM head too (%s=1)", method, INT8_LM_HEAD_ENV)
    after = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4 for m in layers)
    logger.info("quantization %s: %d linear layers, weights %.1f -> %.1f MiB", method, len(layers),
                before / 2**20, after / 2**20)
    return len(layers)
