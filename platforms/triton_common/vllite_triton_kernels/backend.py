"""``TritonPagedAttention``: the AttentionBackend the GPU platforms hand to models.

``forward`` launches two kernels (K/V store, attention) whose grids depend only
on tensor shapes, reads no host-side metadata and allocates only its output, so
a decode step is CUDA-graph capturable as it stands.
"""
from __future__ import annotations

import torch

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import fp8_max, is_fp8
from vllite_triton_kernels.status import interpreter_enabled


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonPagedAttention(AttentionBackend):
    """Paged attention in Triton over the ``(2, num_blocks, block_size, num_kv_heads, head_size)`` cache."""

    name = "triton_paged"
    supports_logits_soft_cap = True
    supports_graph_capture = True

    def __init__(self, tile_n: int = 64, num_warps: int | None = None) -> None:
        # tl.dot wants every dimension >= 16; the kernel pads M, K (head size) and N to that.
        if tile_n < 16 or tile_n & (tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
        self.tile_n = tile_n
        self.num_warps = num_warps

    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu" and not interpreter_enabled():
            raise RuntimeError("TritonPagedAttention got CPU tensors: Triton compiles for GPUs; "
                               "set TRITON_INTERPRET=1 to run the kernels in the interpreter on the CPU")

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """kv_cache at ``slot_mapping[t]`` = key/value of token t, for t < len(slot_mapping); slots < 0 skipped.
        A float8 cache stores key / k_scale and value / v_scale, saturated to its range."""
        from vllite_triton_kernels.kernels import store_kv_kernel

        n = min(key.shape[0], slot_mapping.shape[0])
        if n == 0:
            return
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_size = key.shape[1], key.shape[2]
        extra = {} if self.num_warps is None else {"num_warps": self.num_warps}
        block_t = 16
        store_kv_kernel[(-(-n // block_t),)](
            key, value, k_cache, v_cache, slot_mapping, n, float(k_scale), float(v_scale),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HD_P=_pow2_at_least(num_kv_heads * head_size),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t,
            FP8_MAX=fp8_max(k_cache.dtype) if is_fp8(k_cache.dtype) else 0.0, **extra)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Encoder K/V of encoder-decoder models (the contract's hook): the same store kernel."""
        self._check_device(key)
        self.store_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        from vllite_triton_kernels.kernels import paged_attention_kernel

        self._check_device(query)
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError("expected a (2, blocks, block_size, kv_heads, head_size) cache, got "
                             f"{tuple(kv_cache.shape)}")
        self.store_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        query = _last_dim_contiguous(query)
        num_tokens, num_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[3]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        qpk = num_heads // num_kv_heads
        block_m = _pow2_at_least(qpk, 16)
        block_q = block_m // qpk
        out = torch.zeros_like(query)  # rows past the requests' tokens (padding) stay zero
        num_reqs = metadata.seq_lens.shape[0]
        if num_tokens == 0 or num_reqs == 0:
            return out
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        block_table = metadata.block_table
        grid = (num_tokens // block_q + num_reqs, num_kv_heads)
        extra = {} if self.num_warps is None else {"num_warps": self.num_warps}
        paged_attention_kernel[grid](
            out, query, k_cache, v_cache, block_table, metadata.seq_lens, metadata.query_start_loc,
            float(scale) * float(k_scale), float(v_scale), num_reqs,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            QUERIES_PER_KV=qpk, HEAD_SIZE=head_size, HEAD_P=_pow2_at_least(head_size, 16),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=self.tile_n,
            SLIDING_WINDOW=int(sliding_window or 0), IEEE=query.dtype == torch.float32,
            SOFT_CAP=float(logits_soft_cap or 0.0), **extra)
        return out
