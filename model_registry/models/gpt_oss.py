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
from model_registry.layers.params import empty_param
from model_registry.layers.sink_attention import SinkAttention
from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.errors import ConfigError
from vllite_core.model_ops import current_model_ops


class GptOssAttention(nn.Module):
    def __init__(self, c: Any, window: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.head_size = c.head_dim
        self.qkv_proj = QKVParallelLinear(c.hidden_size, d, c.num_attention_heads, c.num_key_value_heads, True,
                                          dtype)
        self.sizes = [c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads]
        self.o_proj = RowParallelLinear(c.num_attention_heads * d, c.hidden_size, True, dtype)
        self.attn = SinkAttention(c.num_attention_heads, c.num_key_value_heads, d, dtype, window)
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
    """Stacked expert weights as the checkpoint stores them (input-major: ``x @ W``), with biases."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.gate_up_proj = empty_param(e, h, 2 * i, dtype=dtype)
        self.gate_up_proj_bias = empty_param(e, 2 * i, dtype=dtype)
        self.down_proj = empty_param(e, i, h, dtype=dtype)
        self.down_proj_bias = empty_param(e, h, dtype=dtype)
        self.alpha, self.limit = float(c.swiglu_alpha), float(c.swiglu_limit)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert; only the experts some token chose are computed."""
        t, k = ids.shape
        order = torch.argsort(ids.reshape(-1), stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=self.gate_up_proj.shape[0]).tolist()
        grouped = x.index_select(0, order // k)
        ys = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                gate_up = grouped[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
                gate = gate_up[:, 0::2].clamp(max=self.limit)
                up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
                ys[rows] = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj[e] \
                    + self.down_proj_bias[e]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.router(x).topk(self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=-1), ids)


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
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        raise ConfigError(f"tensor_parallel_size: {cls.__name__}'s attention with sinks runs on one rank; "
                          "use tensor_parallel_size=1")

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
