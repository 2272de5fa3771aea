"""``quantization="gguf"``: vLLM's name for running a GGUF checkpoint's quantized weights as they are.

The linear layers whose tensors are Q8_0, Q4_0 or Q4_1 keep their 32-weight blocks (``GGUFWeight``: the packed
values plus an fp16 scale, and minimum for Q4_1, per block; 8 output rows interleaved) instead of the
dequantised float copy: 0.56-1.06 bytes per weight instead of 4. Q4_K, Q5_K and Q6_K (a ``Q4_K_M`` file's types)
keep their 256-weight super-blocks the same way (``kquants.py``: 0.58-0.82 bytes per weight); other types
(Q2_K, Q3_K, IQ*) are dequantised at load, logged. ``ModelOps.gguf_linear`` computes from them (the
reference dequantises; the CPU platform's kernel quantizes the activations per block to int8 and sums integer
products, as llama.cpp does). Other layers and tensor types stay as loaded. Only a GGUF checkpoint can use it.

The model loads as always (every check of the loader applies), except that the projection weights of types with a
kernel are not dequantised (``deferrable``: stand-ins of their shape, nothing written); then each linear layer
whose checkpoint tensors (``checkpoint_names``, recorded by its weight loader) are all Q8_0, all Q4_0 or all Q4_1
gets the same rows from the file as blocks, in the layer's shard order and rotary row order, and drops its float
weight; a layer that stays dense reads its deferred tensors dequantised then (``dense_deferred``).
Rows are whole blocks, so any row split is exact; a row-parallel rank's column range must fall on block
boundaries, else that layer stays dense.

The LM head too, where one rank holds the whole vocabulary: its tensor (``output``, or ``token_embd`` when the
embeddings are tied; Q8_0 in the default model) as blocks beside the float table the embedding lookup keeps. At
one decode row the head is the largest weight (49152 x 576: 113 MB in float32, 30 MB as Q8_0), as llama.cpp
computes it too.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from model_registry.gguf_file import GGUFFile
from model_registry.gguf_weights import _PERMUTED_ARCHS, family, hf_name, unpermute_rotary
from model_registry.layers.linear import LinearBase, RowParallelLinear
from model_registry.layers.moe import FusedMoE
from model_registry.layers.quantization.base import LinearLike, LinearMethod
from model_registry.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from vllite_core.distributed.sharding import VocabShard
from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.quantization")

GGUF_BLOCK = 32  # weights per block in Q8_0, Q4_0 and Q4_1
KQ_BLOCK = 256  # weights per super-block in the K-quants
GGUF_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml's ids (the kernels')
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")


GGUF_GROUP = 8  # output rows whose blocks are interleaved in a GGUFWeight
_QBYTES = {"Q8_0": 256, "Q4_0": 128, "Q4_1": 128}  # packed values of one block of GGUF_GROUP rows
# Bytes of one record (8 rows): + fp16 scales (and Q4_1 minimums); K-quants: see kquants.py.
GGUF_RECORD = {"Q8_0": 256 + 16, "Q4_0": 128 + 16, "Q4_1": 128 + 32, "Q4_K": 1184, "Q5_K": 1440, "Q6_K": 1680}


def weights_per_record(qtype: str) -> int:
    return KQ_BLOCK if qtype in KQUANTS else GGUF_BLOCK


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
        return self.rows, self.blocks.shape[1] // GGUF_RECORD[self.qtype] * weights_per_record(self.qtype)

    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks stand for (``dequantize_gguf``)."""
        return dequantize_gguf(self)


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
    if w.qtype in KQUANTS:
        from model_registry.layers.quantization.kquants import dequantize_kquant

        return dequantize_kquant(w)
    n, k = w.shape
    qs, d, m = unpack_gguf(w)
    d = d[:, :, None]
    if w.qtype == "Q8_0":
        return (d * qs.view(n, -1, GGUF_BLOCK).float()).reshape(n, k)
    b = qs.view(n, -1, GGUF_BLOCK // 2)
    q = torch.cat((b & 0x0F, b >> 4), dim=2).float()
    out = d * (q - 8.0) if w.qtype == "Q4_0" else d * q + m[:, :, None]
    return out.reshape(n, k)


class GGUFLinearMethod(LinearMethod):
    """The layer's weight as GGUF blocks (``layer.weight`` is ``GGUFWeight.blocks``, the float copy dropped)."""

    name: ClassVar[str] = "gguf"

    def __init__(self, gguf_weight: GGUFWeight) -> None:
        self.gguf_weight = gguf_weight

    @classmethod
    def use_blocks(cls, layer: LinearBase, w: GGUFWeight) -> None:
        """Give ``layer`` this method over ``w`` and drop its float weight."""
        layer.weight = nn.Parameter(w.blocks, requires_grad=False)
        layer.set_quant_method(cls(w))

    def apply(self, layer: LinearLike, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.ops.gguf_linear(x, self.gguf_weight, bias, layer.state)

    def weight_bytes(self, layer: LinearLike) -> int:
        return self.gguf_weight.nbytes()


class GGUFShardsLinearMethod(LinearMethod):
    """A fused layer whose shards are GGUF tensors of different types (q/k Q4_K and v Q6_K in a Q4_K_M file): one
    ``GGUFWeight`` per shard, in output order, each computed from its blocks and the outputs put side by side
    (``layer.weight`` becomes an empty placeholder: the float copy dropped)."""

    name: ClassVar[str] = "gguf"

    def __init__(self, parts: list[GGUFWeight]) -> None:
        self.parts = parts

    @classmethod
    def use_blocks(cls, layer: LinearBase, parts: list[GGUFWeight]) -> None:
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.set_quant_method(cls(parts))

    def apply(self, layer: LinearLike, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outs, start = [], 0
        for w in self.parts:
            rows = w.shape[0]
            part_bias = None if bias is None else bias[start:start + rows]
            outs.append(layer.ops.gguf_linear(x, w, part_bias, layer.state))
            start += rows
        return torch.cat(outs, dim=-1)

    def weight_bytes(self, layer: LinearLike) -> int:
        return sum(w.nbytes() for w in self.parts)


_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per (super-)block


def repack(raw: np.ndarray, qtype: str) -> GGUFWeight:
    """GGUF blocks, ``raw`` uint8 [N, K / 32 * bytes per block] (K / 256 for K-quants), as a ``GGUFWeight`` (the
    same values, 8 rows' blocks interleaved; fp16 scales kept)."""
    if qtype in KQUANTS:
        from model_registry.layers.quantization.kquants import repack_kquant

        return repack_kquant(raw, qtype)
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).view(n, -1, _BYTES[qtype])
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, -1)
    if qtype == "Q8_0":
        return pack_gguf(qtype, blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, -1), d)
    if qtype == "Q4_0":
        return pack_gguf(qtype, blocks[:, :, 2:].reshape(n, -1), d)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, -1)
    return pack_gguf(qtype, blocks[:, :, 4:].reshape(n, -1), d, m)


def _rows(gguf: GGUFFile, name: str, heads: dict[str, int]) -> tuple[str, np.ndarray]:
    """(type, the tensor's blocks as uint8 [rows, bytes]) in Hugging Face row order."""
    info = gguf.tensors[name]
    raw = np.asarray(gguf.raw(name)).reshape(info.shape[0], -1)
    if gguf.architecture in _PERMUTED_ARCHS:
        for part, n_head in heads.items():
            if f".{part}." in name:
                raw = unpermute_rotary(raw, n_head)
    return info.ggml_type.name, raw


def _layer_blocks(layer: LinearBase, gguf: GGUFFile, by_hf: dict[str, str],
                  heads: dict[str, int]) -> list[GGUFWeight] | None:
    """The layer's weight as blocks: one GGUFWeight when its shards' tensors share a type, else one per shard in
    output order (a Q4_K_M file's Q4_K q/k beside a Q6_K v); None when a tensor is of another type or this rank's
    columns cut its blocks."""
    segments = getattr(layer, "segments", None) or {None: None}
    if set(layer.checkpoint_names) != set(segments):
        return None
    parts: list[tuple[str, np.ndarray]] = []
    for shard, seg in sorted(segments.items(), key=lambda kv: kv[1].dst_start if kv[1] else 0):
        name = by_hf.get(layer.checkpoint_names[shard])
        if name is None:
            return None
        qtype, raw = _rows(gguf, name, heads)
        if qtype not in _BYTES:
            if qtype.endswith("_K") or qtype.startswith("IQ"):
                logger.info("quantization gguf: %s is %s, which has no kernel here: dequantised at load", name, qtype)
            return None
        raw = raw if seg is None else raw[seg.src_start:seg.src_start + seg.length]
        if isinstance(layer, RowParallelLinear) and layer.in_range != (0, layer.in_features):
            lo, hi = layer.in_range
            blk = weights_per_record(qtype)
            if lo % blk or hi % blk:
                logger.info("quantization gguf: %s's columns %d..%d of this rank cut %s blocks of %d: dequantised",
                            name, lo, hi, qtype, blk)
                return None
            raw = raw[:, lo // blk * _BYTES[qtype]:hi // blk * _BYTES[qtype]]
        parts.append((qtype, raw))
    if len({qtype for qtype, _ in parts}) == 1:
        raw = np.concatenate([r for _, r in parts]) if len(parts) > 1 else parts[0][1]
        return [repack(raw, parts[0][0])]
    return [repack(raw, qtype) for qtype, raw in parts]


def _vocab_blocks(shard: VocabShard, gguf: GGUFFile, name: str | None) -> GGUFWeight | None:
    """A whole vocabulary table's blocks (an LM head's or an embedding's), when its type has a kernel."""
    if name is None or not shard.is_whole:
        return None
    info = gguf.tensors[name]
    qtype = info.ggml_type.name
    if qtype not in _BYTES or info.shape[0] != shard.padded:
        return None
    return repack(np.asarray(gguf.raw(name)).reshape(info.shape[0], -1), qtype)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _expert_blocks(moe: FusedMoE, path: str, gguf: GGUFFile) -> list[tuple[list[GGUFWeight], GGUFWeight]] | None:
    """A mixture's experts as blocks: per expert (gate and up, as one weight when their types agree; down), from
    the layer's stacked ``ffn_{gate,up,down}_exps``; None when a rank holds part of them or a type has no kernel."""
    m = _LAYER.search(path)
    names = [f"blk.{m.group(1)}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")] if m else []
    if not names or not _whole(moe) or any(n not in gguf.tensors for n in names):
        return None
    types = [gguf.tensors[n].ggml_type.name for n in names]
    if any(t not in _BYTES for t in types):
        logger.info("quantization gguf: layer %s's experts are %s: dequantised at load", m.group(1), "/".join(types))
        return None
    gate, up, down = (np.asarray(gguf.raw(n)).reshape(gguf.tensors[n].shape[0], gguf.tensors[n].shape[1], -1)
                      for n in names)
    experts = []
    for e in range(moe.num_experts):
        w13 = [repack(np.concatenate((gate[e], up[e])), types[0])] if types[0] == types[1] else \
            [repack(gate[e], types[0]), repack(up[e], types[1])]
        experts.append((w13, repack(down[e], types[2])))
    return experts


def _head_blocks(head: ParallelLMHead, gguf: GGUFFile, by_hf: dict[str, str]) -> GGUFWeight | None:
    name = by_hf.get("lm_head.weight")
    if name is None and head.tied:
        name = by_hf.get("model.embed_tokens.weight")
    return _vocab_blocks(head.shard, gguf, name)


# The tensors use_gguf_blocks reads as blocks, as transformers names them: a decoder layer's projection weights
# (a shared expert's too), the token embedding and the LM head.
_AS_BLOCKS = re.compile(r"^(model\.layers\.\d+\.(self_attn|mlp)\.([a-z_]+\.)?[a-z_]+_proj\.weight|"
                        r"model\.embed_tokens\.weight|lm_head\.weight)$")


def deferrable(model: torch.nn.Module) -> Callable[[str, str], bool]:
    """Which GGUF tensors loading ``model`` may defer (``params.deferred``: not dequantised, as ``defer(HF name, ggml
    type)`` says) because use_gguf_blocks will read them as blocks: the projection weights of a type with a kernel,
    and the embedding and LM head too where one rank holds the whole vocabulary and every stage (no pipeline
    split: a stage's tied head reads the embedding's tensor under another name). A layer that stays dense after all
    (a shard of another type, a rank's columns cutting blocks) reads them then (``dense_deferred``)."""
    stage = getattr(model, "stage", None)
    vocab = (stage is None or (stage.is_first and stage.is_last)) and all(
        m.shard.is_whole for m in model.modules() if isinstance(m, (VocabParallelEmbedding, ParallelLMHead)))
    experts = all(_whole(m) for m in model.modules() if isinstance(m, FusedMoE))

    def defer(hf_name: str, qtype: str) -> bool:
        if "{}" in hf_name:  # a stack of experts
            return experts and qtype in _BYTES
        m = _AS_BLOCKS.match(hf_name)
        return qtype in _BYTES and m is not None and (vocab or m.group(2) is not None)

    return defer


def _whole(moe: FusedMoE) -> bool:
    """Every expert whole on this rank (no tensor- or expert-parallel split): its blocks can serve it."""
    return moe.experts == (0, moe.num_experts) and moe.local == (0, moe.intermediate_size)


def _is_blocks(method: LinearMethod) -> bool:
    return isinstance(method, (GGUFLinearMethod, GGUFShardsLinearMethod))


def dense_deferred(model: torch.nn.Module, deferred_names: set[str]) -> set[str]:
    """The deferred checkpoint names whose layers use_gguf_blocks left dense: their float weights are still
    unwritten."""
    names: set[str] = set()
    for path, layer in model.named_modules():
        if isinstance(layer, LinearBase) and not _is_blocks(layer.quant_method):
            names |= set(layer.checkpoint_names.values()) & deferred_names
        elif isinstance(layer, VocabParallelEmbedding) and layer.blocks is None and path == "model.embed_tokens":
            names |= {"model.embed_tokens.weight"} & deferred_names  # a tied head's table too
        elif isinstance(layer, ParallelLMHead) and not layer.tied and not _is_blocks(layer.quant_method):
            names |= {"lm_head.weight"} & deferred_names
        elif isinstance(layer, FusedMoE) and layer.gguf is None and (m := _LAYER.search(path)):
            names |= {n for n in deferred_names if "{}" in n and n.startswith(f"model.layers.{m.group(1)}.")}
    return names


def use_gguf_blocks(model: torch.nn.Module, source: Any) -> int:
    """Switch every linear layer of ``model`` whose tensors are Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K in the GGUF file
    ``source`` to its blocks; returns how many were (ConfigError when the checkpoint is not GGUF)."""
    if getattr(source, "kind", None) != "gguf":
        raise ConfigError("quantization: 'gguf' needs a GGUF checkpoint (a .gguf file)")
    from model_registry.source import open_gguf

    gguf = open_gguf(source)
    by_hf = {}
    for name in gguf.tensors:
        target = hf_name(name, family(gguf))
        if target is not None:
            by_hf[target] = name
    cfg = model.config
    heads = {"attn_q": cfg.num_attention_heads,
             "attn_k": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    count, before, after, dense = 0, 0, 0, 0
    tied: dict[int, GGUFWeight] = {}  # embedding module id -> the blocks its tied head took
    for layer in model.modules():
        if isinstance(layer, ParallelLMHead):
            head = _head_blocks(layer, gguf, by_hf)
            if head is not None:
                layer.set_quant_method(GGUFLinearMethod(head))
                count += 1
                if layer.tied:
                    tied.update({id(m): head for m in model.modules() if isinstance(m, VocabParallelEmbedding)
                                 and m.weight is layer.weight})
                else:  # its float table is not read: dropped
                    layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
            continue
        if not isinstance(layer, LinearBase):
            continue
        parts = _layer_blocks(layer, gguf, by_hf, heads)
        if parts is None:
            dense += 1
            continue
        before += layer.weight.numel() * layer.weight.element_size()
        if len(parts) == 1:
            GGUFLinearMethod.use_blocks(layer, parts[0])
        else:
            GGUFShardsLinearMethod.use_blocks(layer, parts)
        after += sum(w.nbytes() for w in parts)
        count += 1
    for path, moe in [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)]:
        experts = _expert_blocks(moe, path, gguf)
        if experts is not None:
            moe.use_gguf_blocks(experts)
            count += 1
    for path, emb in [(n, m) for n, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)]:
        # The lookup from blocks too: a tied head's (one copy for both), or the token embedding's own tensor.
        own = by_hf.get("model.embed_tokens.weight") if path == "model.embed_tokens" else None
        blocks = tied.get(id(emb)) or _vocab_blocks(emb.shard, gguf, own)
        if blocks is not None:
            heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight is emb.weight]
            emb.use_blocks(blocks)
            for head in heads:  # a tied head computes from its blocks: the float table goes with the embedding's
                head.weight = emb.weight
            logger.info("quantization gguf: the embedding looked up in %s blocks", blocks.qtype)
    logger.info("quantization gguf: %d linear layers from their blocks (weights %.1f -> %.1f MiB), %d stay dense",
                count, before / 2**20, after / 2**20, dense)
    return count
