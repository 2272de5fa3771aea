"""Multi-head latent attention (DeepSeek-V2/V3) over its own paged cache (``MLAAttentionSpec``): per token the
cache holds the normalised KV latent ``c`` (``kv_lora_rank`` values) and the rotated shared rope key
(``qk_rope_head_dim``), not K and V per head.

``kv_b_proj`` expands a latent into each head's no-rope key (``W_UK``) and value (``W_UV``). A prefill chunk
expands its request's cached latents and runs ordinary attention; a decode token uses the absorbed form instead:
its query is moved into latent space (``q_nope @ W_UK``), scored against the latents directly, and the
latent-space output is mapped to values by ``W_UV`` afterwards, so a decode step never expands the context.
Both are the same function; the torch ops here run on any device (this layer reads the cache itself, not
through the platform's attention backend).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from model_registry.layers.norm import RMSNorm
from model_registry.layers.rotary import rope_parameters
from vllite_core.attention.backend import AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import split
from vllite_core.errors import ConfigError
from vllite_core.utils import cdiv

_LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a norms take no eps from the config


def mla_softmax_scale(c: Any) -> float:
    """``qk_head_dim ** -0.5``, times yarn's ``mscale_all_dim`` correction squared when rope is scaled."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    p = rope_parameters(c)
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        factor = float(p["factor"])
        m = 0.1 * float(p["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout), returned de-interleaved
    (evens, then odds): queries and keys both get that order, so their dot products are the interleaved ones.
    ``cos``/``sin`` [T, D] in the NeoX layout (each frequency twice); ``x`` [T, H, D]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.cat((xe * c - xo * s, xo * c + xe * s), dim=-1)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


class MLAAttention(nn.Module):
    """DeepSeek's attention: q from ``q_proj`` or the low-rank ``q_a_proj`` -> norm -> ``q_b_proj``; the KV latent
    and rope key from ``kv_a_proj_with_mqa``. Over tensor-parallel ranks the heads split (``split``): the
    per-head projections (``q_proj`` / ``q_b_proj``, ``kv_b_proj``) are column-parallel over them and ``o_proj``
    row-parallel; the latent path (``q_a_proj``, ``kv_a_proj_with_mqa``) and so the cache are the same on every
    rank (each holds all the latents, and computes its heads from them)."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp()
        h0, h1 = split(c.num_attention_heads, tp.world_size, tp.rank)
        self.num_heads = h1 - h0
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rank = c.kv_lora_rank
        qk = self.nope + self.rope
        total_qk, kv, total_kv = c.num_attention_heads * qk, self.nope + self.v_dim, c.num_attention_heads * (
            self.nope + self.v_dim)
        bias = bool(getattr(c, "attention_bias", False))
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_qk, False, dtype,
                                                 out_range=(h0 * qk, h1 * qk))
        else:
            self.q_proj = ColumnParallelLinear(c.hidden_size, total_qk, False, dtype, out_range=(h0 * qk, h1 * qk))
        self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, self.rank + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.rank, total_kv, False, dtype, out_range=(h0 * kv, h1 * kv))
        self.o_proj = RowParallelLinear(c.num_attention_heads * self.v_dim, c.hidden_size, bias, dtype,
                                        (h0 * self.v_dim, h1 * self.v_dim))
        self.scale = mla_softmax_scale(c)
        self.interleaved = bool(getattr(c, "rope_interleave", True))

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if dtype.itemsize == 1:
            raise ConfigError("kv_cache_dtype: an MLA cache (DeepSeek) holds latents in the model dtype; use "
                              "kv_cache_dtype='auto'")
        return MLAAttentionSpec(block_size, 1, self.rank + self.rope, dtype)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [H, nope, rank] and ``W_UV`` [H, v, rank], views of ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        rotate = rotate_interleaved if self.interleaved else rotate_neox
        q_pe, k_pe = rotate(q_pe, *rope), rotate(k_pe.unsqueeze(1), *rope)[:, 0]
        n = md.num_actual_tokens
        rows = kv_cache.view(-1, kv_cache.shape[-1])
        rows.index_copy_(0, md.slot_mapping[:n], torch.cat((self.kv_a_layernorm(latent), k_pe), -1)[:n]
                         .to(kv_cache.dtype))
        out = torch.zeros(t, self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
        qsl, bs = md.query_start_loc_cpu, kv_cache.shape[1]
        for i, length in enumerate(md.seq_lens_cpu):
            q0, q1 = qsl[i], qsl[i + 1]
            if q1 == q0:
                continue
            blocks = md.block_table[i, :cdiv(length, bs)].long()
            ctx = kv_cache.index_select(0, blocks).view(-1, kv_cache.shape[-1])[:length].to(x.dtype)
            attend = self._absorbed if q1 - q0 == 1 else self._expanded
            out[q0:q1] = attend(q_nope[q0:q1], q_pe[q0:q1], ctx[:, :self.rank], ctx[:, self.rank:])
        return self.o_proj(out.reshape(t, -1))

    def _mask(self, tq: int, length: int, device: torch.device) -> torch.Tensor:
        """[tq, length]: query j (the context's position length - tq + j) sees keys up to itself."""
        return torch.arange(length, device=device)[None, :] <= torch.arange(length - tq, length, device=device)[:, None]

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
                  k_pe: torch.Tensor) -> torch.Tensor:
        """Prefill: every head's keys and values expanded from the latents, then attention as usual."""
        length, tq = c.shape[0], q_nope.shape[0]
        kv = F.linear(c, self.kv_b_proj.weight).view(length, self.num_heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)), -1)
        q = torch.cat((q_nope, q_pe), -1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=self._mask(tq, length, q.device), scale=self.scale)
        return o.transpose(0, 1)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
                  k_pe: torch.Tensor) -> torch.Tensor:
        """Decode: the query moved into latent space (``W_UK`` absorbed), scored against the cached latents and
        rope keys, the weighted latents mapped to values by ``W_UV``; the context is never expanded."""
        w_uk, w_uv = self._weights()
        q_lat = torch.einsum("thn,hnr->htr", q_nope, w_uk)
        scores = q_lat @ c.T + q_pe.transpose(0, 1) @ k_pe.T  # [H, tq, L], softmax in float32 at least
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * self.scale
        scores = scores.masked_fill(~self._mask(q_nope.shape[0], c.shape[0], c.device), float("-inf"))
        o_lat = torch.softmax(scores, dim=-1).to(c.dtype) @ c  # [H, tq, rank]
        return torch.einsum("htr,hvr->thv", o_lat, w_uv)
