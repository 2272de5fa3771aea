"""``quantization="gguf"``: a loaded model's linear layers switched to their GGUF tensors' blocks.

The model loads as always (dequantised, every check of the loader applies); then each parallel linear layer
whose checkpoint tensors (``checkpoint_names``, recorded by its weight loader) are all Q8_0, all Q4_0 or
all Q4_1 gets the same rows from the file as blocks (``GGUFWeight``), in the layer's shard order and
rotary row order, and drops its float copy. Rows are whole blocks, so any row split is exact; a
row-parallel rank's column range must fall on block boundaries, else that layer stays dense.

The LM head too, where the model has a ``gguf_head`` slot and one rank holds the whole vocabulary: its
tensor (``output``, or ``token_embd`` when the embeddings are tied; Q8_0 in the default model) as blocks
beside the float table the embedding lookup keeps. At one decode row the head is the largest weight
(49152 x 576: 113 MB in float32, 30 MB as Q8_0), as llama.cpp computes it too.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from model_registry.gguf_file import GGUFFile
from model_registry.gguf_weights import _PERMUTED_ARCHS, hf_name, unpermute_rotary
from model_registry.parallel_layers import ParallelLinear, RowParallelLinear
from vllite_core.config import ConfigError
from vllite_core.quantization import GGUF_BLOCK, GGUFWeight, pack_gguf

logger = logging.getLogger("vllite.quantization")

_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights


def repack(raw: np.ndarray, qtype: str) -> GGUFWeight:
    """GGUF blocks, ``raw`` uint8 [N, K / 32 * bytes per block], as a ``GGUFWeight`` (the same bytes, 8 rows'
    blocks interleaved; fp16 scales kept)."""
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


def _layer_blocks(layer: ParallelLinear, gguf: GGUFFile, by_hf: dict[str, str],
                  heads: dict[str, int]) -> GGUFWeight | None:
    segments = getattr(layer, "segments", None) or {None: None}
    if set(layer.checkpoint_names) != set(segments):
        return None
    types, parts = set(), []
    for shard, seg in sorted(segments.items(), key=lambda kv: kv[1].dst_start if kv[1] else 0):
        name = by_hf.get(layer.checkpoint_names[shard])
        if name is None:
            return None
        qtype, raw = _rows(gguf, name, heads)
        if qtype not in _BYTES:
            return None
        types.add(qtype)
        parts.append(raw if seg is None else raw[seg.src_start:seg.src_start + seg.length])
    if len(types) != 1:
        return None
    qtype = types.pop()
    raw = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if isinstance(layer, RowParallelLinear) and layer.in_range != (0, layer.in_features):
        lo, hi = layer.in_range
        if lo % GGUF_BLOCK or hi % GGUF_BLOCK:
            return None
        per = _BYTES[qtype]
        raw = raw[:, lo // GGUF_BLOCK * per:hi // GGUF_BLOCK * per]
    return repack(raw, qtype)


def _head_blocks(model: torch.nn.Module, gguf: GGUFFile, by_hf: dict[str, str]) -> GGUFWeight | None:
    shard = getattr(getattr(model, "model", None), "vocab_shard", None)
    if not hasattr(model, "gguf_head") or shard is None or not shard.is_whole:
        return None
    name = by_hf.get("lm_head.weight")
    if name is None and getattr(model, "tie_word_embeddings", False):
        name = by_hf.get("model.embed_tokens.weight")
    if name is None:
        return None
    info = gguf.tensors[name]
    qtype = info.ggml_type.name
    if qtype not in _BYTES or info.shape[0] != shard.padded:
        return None
    return repack(np.asarray(gguf.raw(name)).reshape(info.shape[0], -1), qtype)


def use_gguf_blocks(model: torch.nn.Module, source: Any) -> int:
    """Switch every linear layer of ``model`` whose tensors are Q8_0/Q4_0/Q4_1 in the GGUF file ``source``
    to its blocks; returns how many were (ConfigError when the checkpoint is not GGUF)."""
    if getattr(source, "kind", None) != "gguf":
        raise ConfigError("quantization: 'gguf' needs a GGUF checkpoint (a .gguf file)")
    from model_registry.source import open_gguf

    gguf = open_gguf(source)
    by_hf = {}
    for name in gguf.tensors:
        target = hf_name(name)
        if target is not None:
            by_hf[target] = name
    cfg = model.config
    heads = {"attn_q": cfg.num_attention_heads,
             "attn_k": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    count, before, after, dense = 0, 0, 0, 0
    for layer in model.modules():
        if not isinstance(layer, ParallelLinear):
            continue
        w = _layer_blocks(layer, gguf, by_hf, heads)
        if w is None:
            dense += 1
            continue
        before += layer.weight.numel() * layer.weight.element_size()
        layer.use_gguf_weight(w)
        after += w.nbytes()
        count += 1
    head = _head_blocks(model, gguf, by_hf)
    if head is not None:
        model.gguf_head = head
        count += 1
    logger.info("quantization gguf: %d linear layers from their blocks (weights %.1f -> %.1f MiB), %d stay dense",
                count, before / 2**20, after / 2**20, dense)
    return count
