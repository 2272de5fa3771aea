"""Mamba-2 (Mamba2ForCausalLM) written for the engine: every layer a Mamba-2 mixer (``layers.mamba``), chunked
SSD scan for prefill, one recurrent step for decode. The checkpoint's ``backbone.*`` names map onto the
hybrid shell's ``model.*``. Tensor-parallel: each mixer holds whole heads (``layers.mamba.mamba2_shard``).
"""
from __future__ import annotations

from typing import Any

import torch

from model_registry.layers.hybrid import HybridForCausalLM
from model_registry.layers.mamba import Mamba2Dims, Mamba2Mixer
from model_registry.layers.tensor_parallel import ShardsMamba2Hybrid
from model_registry.models.mamba import BACKBONE, MambaBlock
from vllite_core.attention.backend import AttentionBackend


def mamba2_dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.num_heads, head_dim=c.head_dim, n_groups=c.n_groups,
                      state_size=c.state_size, conv_kernel=c.conv_kernel, chunk_size=c.chunk_size,
                      use_bias=bool(c.use_bias), use_conv_bias=bool(c.use_conv_bias),
                      norm_eps=float(c.layer_norm_epsilon), dt_limit=tuple(c.time_step_limit),
                      activation=c.hidden_act)


class Mamba2ForCausalLM(HybridForCausalLM, ShardsMamba2Hybrid):
    """Engine model for Mamba2ForCausalLM checkpoints."""

    renames = BACKBONE

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (MambaBlock(c, Mamba2Mixer(mamba2_dims(c), dtype), dtype)
                                    for _ in range(c.num_hidden_layers)), float(c.layer_norm_epsilon))
