"""NemotronH (NemotronHForCausalLM): a stack of single-mixer blocks chosen by ``hybrid_override_pattern``
(``M`` Mamba-2, ``*`` attention without positional encoding, ``-`` an MLP), each ``x + mixer(norm(x))``.

Mamba-2 blocks hold a state, attention blocks paged KV; MLP blocks hold no cache, so the model's
``kv_caches`` cover the cache-holding blocks only, in order. The checkpoint's ``backbone.*`` names map onto
the hybrid shell's ``model.*``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_registry.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep
from model_registry.layers.mamba import Mamba2Dims, Mamba2Mixer
from model_registry.layers.tensor_parallel import ShardsMamba2Hybrid
from model_registry.models.mamba import BACKBONE
from vllite_core.attention.backend import AttentionBackend


class ReluSquaredMLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if c.mlp_hidden_act != "relu2":
            raise NotImplementedError(f"NemotronH mlp_hidden_act {c.mlp_hidden_act!r} (relu2 only)")
        self.up_proj = ColumnParallelLinear(c.hidden_size, c.intermediate_size, bool(c.mlp_bias), dtype)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bool(c.mlp_bias), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


def _dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
                      n_groups=c.n_groups, state_size=c.ssm_state_size, conv_kernel=c.conv_kernel,
                      chunk_size=c.chunk_size, use_bias=bool(c.use_bias), use_conv_bias=bool(c.use_conv_bias),
                      norm_eps=float(c.layer_norm_epsilon), dt_limit=(float(c.time_step_min), float("inf")),
                      activation=c.mamba_hidden_act)


class NemotronHBlock(nn.Module):
    def __init__(self, c: Any, kind: str, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)
        if kind == "linear_attention":
            self.mixer: nn.Module = Mamba2Mixer(_dims(c), dtype)
        elif kind == "full_attention":
            self.mixer = HybridAttention.from_config(c, attn_backend, dtype)
        elif kind == "mlp":
            self.mixer = ReluSquaredMLP(c, dtype)
        else:
            raise NotImplementedError(f"NemotronH block type {kind!r} is not supported (mamba, attention, mlp)")

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "mlp":
            return x + self.mixer(h)
        if self.kind == "full_attention":
            return x + self.mixer(h, caches[0], mds[0], step.rope)
        return x + self.mixer(h, caches[0], mds[0])


class NemotronHForCausalLM(HybridForCausalLM, ShardsMamba2Hybrid):
    """Engine model for NemotronHForCausalLM checkpoints. Tensor-parallel: attention by heads, the Mamba-2 mixers
    by whole heads, the MLPs by their intermediate channels."""

    mamba2_fields = ("mamba_num_heads", "n_groups")

    renames = BACKBONE

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (NemotronHBlock(c, kind, attn_backend, dtype) for kind in c.layers_block_type),
                         float(c.layer_norm_epsilon))
