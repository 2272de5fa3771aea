"""Mamba-2 (Mamba2ForCausalLM) written for the engine: every layer a Mamba-2 mixer (``layers.mamba``), chunked
SSD scan for prefill, one recurrent step for decode. The checkpoint's ``backbone.*`` names map onto the
hybrid shell's ``model.*``. Tensor-parallel: each mixer holds whole heads (``layers.mamba.mamba2_shard``).
"""
from __future__ import annotations

from typing import Any

import torch

from model_registry.layers.hybrid import HybridForCausalLM
from model_registry.layers.mamba import Mamba2Dims, Mamba2Mixer, check_mamba2_split, mamba2_shard
from model_registry.models.mamba import BACKBONE, MambaBlock
from vllite_core.attention.backend import AttentionBackend
from vllite_core.model_interfaces import SupportsTensorParallel


def mamba2_dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.num_heads, head_dim=c.head_dim, n_groups=c.n_groups,
                      state_size=c.state_size, conv_kernel=c.conv_kernel, chunk_size=c.chunk_size,
                      use_bias=bool(c.use_bias), use_conv_bias=bool(c.use_conv_bias),
                      norm_eps=float(c.layer_norm_epsilon), dt_limit=tuple(c.time_step_limit),
                      activation=c.hidden_act)


class Mamba2ForCausalLM(HybridForCausalLM, SupportsTensorParallel):
    """Engine model for Mamba2ForCausalLM checkpoints."""

    renames = BACKBONE

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        check_mamba2_split(hf_config.num_heads, hf_config.n_groups, tensor_parallel_size)

    @classmethod
    def tensor_parallel_layout(cls, hf_config: Any, tensor_parallel_size: int) -> list[str]:
        """Each rank's SSM heads and B/C groups, as ``vllite env`` prints them."""
        c, lines = hf_config, []
        for rank in range(tensor_parallel_size):
            sh = mamba2_shard(c.num_heads, c.n_groups, tensor_parallel_size, rank)
            (h0, h1), (g0, g1) = sh.heads, sh.groups
            lines.append(f"tensor-parallel rank {rank}: SSM heads {h0}-{h1 - 1} ({h1 - h0}) of {c.num_heads}, "
                         f"groups {g0}-{g1 - 1} of {c.n_groups}")
        return lines

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (MambaBlock(c, Mamba2Mixer(mamba2_dims(c), dtype), dtype)
                                    for _ in range(c.num_hidden_layers)), float(c.layer_norm_epsilon))
