"""Mamba-1 (MambaForCausalLM) and FalconMamba written for the engine.

Every layer is a selective state-space mixer (``layers.mamba.MambaMixer``) with no attention: its
per-request memory is a state (``StateSpec``), carried by the platform's ops across prefill chunks and
decode steps. The checkpoint's ``backbone.*`` names map onto the hybrid shell's ``model.*``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_registry.layers import RMSNorm, ShardsByHeads
from model_registry.layers.hybrid import HybridForCausalLM, HybridStep
from model_registry.layers.mamba import MambaBase, MambaMixer
from vllite_core.attention.backend import AttentionBackend
from vllite_core.state_cache import StateMetadata

BACKBONE = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.embedding.", "model.embed_tokens."),
            ("backbone.norm_f.", "model.norm."), ("backbone.layers.", "model.layers."))


class MambaBlock(nn.Module):
    """``x + mixer(norm(x))``, the residual kept in float32 when ``residual_in_fp32``."""

    def __init__(self, c: Any, mixer: MambaBase, dtype: torch.dtype) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(c, "residual_in_fp32", True))
        self.norm = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)
        self.mixer = mixer

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[StateMetadata],
                step: HybridStep) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)), caches[0], mds[0])


class MambaForCausalLM(HybridForCausalLM, ShardsByHeads):
    """Engine model for MambaForCausalLM checkpoints; tensor-parallel over the mixers' channels."""

    tie_default = True
    renames = BACKBONE
    mixer_rms: bool = False  # FalconMamba: B, C and dt RMS-normalised (no weights) before the scan

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        rms_eps = float(c.mixer_rms_eps) if self.mixer_rms else None
        super().__init__(c, dtype, (MambaBlock(c, MambaMixer(c, dtype, rms_eps), dtype)
                                    for _ in range(c.num_hidden_layers)), float(c.layer_norm_epsilon))


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba-1 with B, C and dt RMS-normalised (no weights) before the scan."""

    mixer_rms = True
