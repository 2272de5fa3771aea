"""gpt-oss (GptOssForCausalLM): attention with q/k/v/o bias and a learned sink logit per head
(``layers.sink_attention``), sliding-window and full layers alternating (``layer_types``), and a MoE whose router
has a bias (softmax over the top-k logits) and whose experts have biases and a clamped SwiGLU:
``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``, gate and up interleaved in the
checkpoint's ``gate_up_proj`` [E, H, 2I] columns. MXFP4 checkpoints (the released ones: ``*_blocks`` and
``*_scales`` expert tensors) are dequantised at load into the model dtype."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from model_registry.layers import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from model_registry.layers.params import check_full, copy_checked, empty_param
from model_registry.layers.sink_attention import SinkAttention
from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import shard_experts, split
from vllite_core.errors import ConfigError
from vllite_core.model_ops import current_model_ops


class GptOssAttention(nn.Module):
    """Over tensor-parallel ranks: this rank's KV-head groups (``QKVParallelLinear``), their sinks, and the
    matching input columns of the row-parallel ``o_proj`` (its bias added once)."""

    def __init__(self, c: Any, window: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.head_size = c.head_dim
        self.qkv_proj = QKVParallelLinear(c.hidden_size, d, c.num_attention_heads, c.num_key_value_heads, True,
                                          dtype)
        h = self.qkv_proj.heads
        self.sizes = [h.num_heads, h.num_kv_heads, h.num_kv_heads]
        self.o_proj = RowParallelLinear(c.num_attention_heads * d, c.hidden_size, True, dtype,
                                        (h.q_start * d, (h.q_start + h.num_heads) * d))
        self.attn = SinkAttention(h.num_heads, h.num_kv_heads, d, dtype, window, head_start=h.q_start,
                                  total_heads=c.num_attention_heads)
        self.ops = current_model_ops()

    @property
    def sinks(self) -> nn.Parameter:
        return self.attn.sinks

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return self.attn.kv_cache_spec(block_size, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, -1, self.head_size).split(self.sizes, 1)
        q, k = self.ops.rotary(q.contiguous(), k.contiguous(), *rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, md).reshape(t, -1))


class GptOssExperts(nn.Module):
    """Stacked expert weights as the checkpoint stores them (input-major: ``x @ W``), with biases. Over
    tensor-parallel ranks a rank holds every expert's slice ``[i0, i1)`` of the intermediate dimension (gate/up
    columns ``[2 i0, 2 i1)``, interleaved pairs kept together; down rows; the down bias on rank 0 only), or with
    expert parallelism the whole experts ``[e0, e1)``; the caller sums the ranks' outputs."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp()
        self.num_experts, h, self.intermediate_size = c.num_local_experts, c.hidden_size, c.intermediate_size
        if tp.enable_expert_parallel and tp.world_size > 1:
            self.experts, self.local = shard_experts(self.num_experts, tp.world_size, tp.rank), \
                (0, self.intermediate_size)
        else:
            self.experts, self.local = (0, self.num_experts), split(self.intermediate_size, tp.world_size, tp.rank)
        e, i = self.experts[1] - self.experts[0], self.local[1] - self.local[0]
        self.down_bias_here = self.local[0] == 0  # each expert's down bias added by one rank
        self.gate_up_proj = empty_param(e, h, 2 * i, dtype=dtype)
        self.gate_up_proj_bias = empty_param(e, 2 * i, dtype=dtype)
        self.down_proj = empty_param(e, i, h, dtype=dtype)
        self.down_proj_bias = empty_param(e, h, dtype=dtype)
        for p in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias):
            p.weight_loader = self._load  # type: ignore[attr-defined]
        self.alpha, self.limit = float(c.swiglu_alpha), float(c.swiglu_limit)

    @torch.no_grad()
    def _load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        """This rank's experts, and its slice of their intermediate dimension, of a stacked tensor."""
        check_full(src, 0, self.num_experts, name)
        src = src[self.experts[0]:self.experts[1]]
        (i0, i1), full = self.local, self.intermediate_size
        if param is self.gate_up_proj:
            check_full(src, 2, 2 * full, name)
            src = src[:, :, 2 * i0:2 * i1]
        elif param is self.gate_up_proj_bias:
            check_full(src, 1, 2 * full, name)
            src = src[:, 2 * i0:2 * i1]
        elif param is self.down_proj:
            check_full(src, 1, full, name)
            src = src[:, i0:i1]
        copy_checked(param.data, src, name)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert; only this rank's experts that some token chose are computed (the rows of
        choices routed elsewhere stay zero)."""
        t, k = ids.shape
        e0, e1 = self.experts
        order = torch.argsort(ids.reshape(-1), stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()
        grouped = x.index_select(0, order // k)
        ys = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = sum(counts[:e0])
        for e in range(e0, e1):
            n, local = counts[e], e - e0
            if n:
                rows = slice(start, start + n)
                gate_up = grouped[rows] @ self.gate_up_proj[local] + self.gate_up_proj_bias[local]
                gate = gate_up[:, 0::2].clamp(max=self.limit)
                up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
                ys[rows] = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj[local]
                if self.down_bias_here:
                    ys[rows] += self.down_proj_bias[local]
                start += n
        back = torch.empty_like(ys)
        back[order] = ys
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), back.view(t, k, -1)).squeeze(1)


class GptOssMoE(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.router = ReplicatedLinear(c.hidden_size, c.num_local_experts, True, dtype)
        self.experts = GptOssExperts(c, dtype)
        self.tp = get_tp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.router(x).topk(self.top_k, dim=-1)
        out = self.experts(x, torch.softmax(top, dim=-1), ids)
        return self.tp.communicator.all_reduce(out) if self.tp.world_size > 1 else out


_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """OCP MXFP4 -> ``dtype``: ``blocks`` [..., N, G, 16] uint8 hold 32 FP4 (E2M1) values per group of a row, the
    low nibble first; ``scales`` [..., N, G] uint8 are each group's power of two (E8M0, bias 127). Returns
    [..., G * 32, N]: the rows transposed to gpt-oss's input-major expert layout."""
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)  # [..., N, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return vals.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


class GptOssForCausalLM(MoeForCausalLM):
    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        quant = getattr(c, "quantization_config", None)
        method = (quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)) \
            if quant else None
        if method not in (None, "mxfp4"):
            raise ConfigError(f"quantization: gpt-oss {method} checkpoints are not supported (float or MXFP4)")
        return MoeFamily(num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                         moe_intermediate_size=c.intermediate_size, moe_layers=(True,) * c.num_hidden_layers,
                         renormalize=True, renames=((".self_attn.sinks", ".self_attn.attn.sinks"),))

    def make_attention(self, c: Any, fam: MoeFamily, layer: int, backend: AttentionBackend,
                       dtype: torch.dtype) -> nn.Module:
        sliding = c.layer_types[layer] == "sliding_attention" and c.sliding_window
        return GptOssAttention(c, int(c.sliding_window) if sliding else None, dtype)

    def make_mlp(self, c: Any, fam: MoeFamily, sparse: bool, dtype: torch.dtype) -> nn.Module:
        return GptOssMoE(c, dtype)

    @classmethod
    def rotary_dim(cls, c: Any) -> int:
        return c.head_dim

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """MXFP4 expert tensors (``<proj>_blocks`` with ``<proj>_scales``, in either order) dequantised into
        ``<proj>``; everything else by name."""
        pending: dict[str, dict[str, torch.Tensor]] = {}

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.endswith(("_blocks", "_scales")):
                    yield name, tensor
                    continue
                base, part = name.rsplit("_", 1)
                pending.setdefault(base, {})[part] = tensor
                if len(pending[base]) == 2:
                    got = pending.pop(base)
                    yield base, dequantize_mxfp4(got["blocks"], got["scales"], self.dtype)
            if pending:
                raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(pending))}")

        return super().load_weights(tensors())
