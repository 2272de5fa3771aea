"""Zamba2 (Zamba2ForCausalLM): a Mamba-2 stack where "hybrid" layers first run a *shared* transformer block.

The shared block (``num_mem_blocks`` of them, reused in turn by the hybrid layers) reads the current
hidden states concatenated with the original embeddings, attends (paged KV per hybrid layer), runs a
MLP, and its output, through the layer's own linear, is added to the Mamba layer's input. Each hybrid
layer has its own low-rank adapters on the shared block's projections. A mamba layer holds a state; a
hybrid layer holds KV then a state (that order in ``kv_caches``). Module names follow the HF checkpoint's.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    Segment,
)
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep
from model_registry.layers.mamba import Mamba2Dims, Mamba2Mixer
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.layers.tensor_parallel import ShardsMamba2Hybrid
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.state_cache import StateMetadata

_ACTS = {"gelu": lambda x: F.gelu(x), "silu": F.silu, "swish": F.silu}


def _adapters(c: Any, block_id: int, size_in: int, out: dict[str | None, Segment], dtype: torch.dtype
              ) -> nn.ModuleList:
    """One entry per hybrid layer: a low-rank adapter where that layer uses this block, else nothing. The down
    projection is whole on every rank; the up projection yields the rows of the projection it adds to that this
    rank holds (``out``: that projection's segments)."""
    n = len(c.hybrid_layer_ids)
    return nn.ModuleList(
        nn.Sequential(ReplicatedLinear(size_in, c.adapter_rank, False, dtype),
                      ColumnParallelLinear(c.adapter_rank, sum(seg.length for seg in out.values()), False, dtype,
                                           out))
        if i % c.num_mem_blocks == block_id else nn.Identity() for i in range(n))


class SharedAttention(HybridAttention):
    """Attention over ``[x, embeddings]`` with the hybrid layer's adapters added to q, k and v."""

    def __init__(self, c: Any, block_id: int, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        width = c.attention_hidden_size
        super().__init__(width, c.num_attention_heads, c.num_key_value_heads, c.attention_head_dim, attn_backend,
                         dtype, scale=(c.attention_head_dim / 2) ** -0.5, out_size=c.hidden_size)
        self.use_adapters = bool(c.use_shared_attention_adapter)
        if self.use_adapters:  # each adds to its projection's rows on this rank (checkpoint segment q, k or v)
            for name in ("q", "k", "v"):
                seg = self.qkv_proj.segments[name]
                setattr(self, f"linear_{name}_adapter_list",
                        _adapters(c, block_id, width, {None: Segment(0, seg.src_start, seg.length, seg.full)}, dtype))

    def adapted(self, x: torch.Tensor, hybrid_index: int, kv_cache: torch.Tensor, md: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, -1)
        if self.use_adapters:
            q = q + self.linear_q_adapter_list[hybrid_index](x)
            k = k + self.linear_k_adapter_list[hybrid_index](x)
            v = v + self.linear_v_adapter_list[hybrid_index](x)
        return self.attend(q.view(t, self.num_heads, self.head_size), k.view(t, self.num_kv_heads, self.head_size),
                           v.view(t, self.num_kv_heads, self.head_size), kv_cache, md, rope)


class SharedMLP(nn.Module):
    def __init__(self, c: Any, block_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        if c.hidden_act not in _ACTS:
            raise NotImplementedError(f"Zamba2 hidden_act {c.hidden_act!r} (gelu or silu)")
        self.act = _ACTS[c.hidden_act]
        bias = bool(c.add_bias_linear)
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, {"gate": c.intermediate_size,
                                                                       "up": c.intermediate_size}, bias, dtype)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias, dtype)
        # the checkpoint stacks gate and up in one tensor (gate_up_proj and its adapters alike): this rank's rows
        self.gate_up_proj_adapter_list = _adapters(c, block_id, c.hidden_size, self.gate_up_proj.segments, dtype)

    def forward(self, x: torch.Tensor, hybrid_index: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[hybrid_index](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SharedTransformer(nn.Module):
    def __init__(self, c: Any, block_id: int, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.attention_hidden_size, float(c.rms_norm_eps), dtype)
        self.self_attn = SharedAttention(c, block_id, attn_backend, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        self.feed_forward = SharedMLP(c, block_id, dtype)

    def forward(self, x: torch.Tensor, hybrid_index: int, kv_cache: torch.Tensor, md: AttentionMetadata,
                step: HybridStep) -> torch.Tensor:
        h = self.input_layernorm(torch.cat([x, step.embeddings], dim=-1))
        h = self.pre_ff_layernorm(self.self_attn.adapted(h, hybrid_index, kv_cache, md, step.rope))
        return self.feed_forward(h, hybrid_index)


class MambaLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        self.mamba = Mamba2Mixer(Mamba2Dims(
            hidden_size=c.hidden_size, num_heads=c.n_mamba_heads, head_dim=c.mamba_headdim, n_groups=c.mamba_ngroups,
            state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv, chunk_size=c.chunk_size,
            use_bias=bool(c.add_bias_linear), use_conv_bias=True, norm_eps=1e-5,
            dt_limit=(float(c.time_step_min), float("inf")), activation="silu"), dtype)

    def mix(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata, added: torch.Tensor | None = None
            ) -> torch.Tensor:
        h = self.input_layernorm(x if added is None else x + added)
        return x + self.mamba(h, cache, md)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        return self.mix(x, caches[0], mds[0])


class HybridLayer(nn.Module):
    """The shared block (KV cache first), its output through ``linear`` added to the Mamba layer's input."""

    def __init__(self, shared: SharedTransformer, hybrid_index: int, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shared_transformer = shared
        self.hybrid_index = hybrid_index
        self.linear = ReplicatedLinear(c.hidden_size, c.hidden_size, False, dtype)
        self.mamba_decoder = MambaLayer(c, dtype)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        t = self.shared_transformer(x, self.hybrid_index, caches[0], mds[0], step)
        return self.mamba_decoder.mix(x, caches[1], mds[1], added=self.linear(t))


class Zamba2ForCausalLM(HybridForCausalLM, ShardsMamba2Hybrid):
    """Engine model for Zamba2ForCausalLM checkpoints (shared blocks stored once, under their first layer).
    Tensor-parallel: the shared attention by heads (its adapters' up projections by the same rows), the shared
    MLP by its intermediate channels, the mixers by whole heads; each hybrid layer's ``linear`` is whole."""

    mamba2_fields = ("n_mamba_heads", "mamba_ngroups")

    tie_default = True
    renames = (("model.final_layernorm.", "model.norm."),)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        if getattr(c, "use_long_context", False):
            raise NotImplementedError("Zamba2 use_long_context (rescaled RoPE) is not supported")
        shared = [SharedTransformer(c, b, attn_backend, dtype) for b in range(c.num_mem_blocks)]
        hybrid_index = {layer: i for i, layer in enumerate(c.hybrid_layer_ids)}
        super().__init__(c, dtype, (HybridLayer(shared[hybrid_index[i] % c.num_mem_blocks], hybrid_index[i], c, dtype)
                                    if kind == "hybrid" else MambaLayer(c, dtype)
                                    for i, kind in enumerate(c.layers_block_type)), float(c.rms_norm_eps))
        self.rotary_emb = RotaryEmbedding(c, c.attention_head_dim) if c.use_mem_rope else None
