"""Mamba-1 (MambaForCausalLM) and FalconMamba written for the engine.

Every layer is a selective state-space mixer with no attention: its per-request memory is a
convolution state (the last ``conv_kernel - 1`` inputs) and an SSM state (``intermediate x state_size``),
one ``StateSpec`` per layer (``vllite_core/state_cache.py``). The step's tokens arrive flattened; the
causal conv and the selective scan run through the platform's model ops, which carry each request's
state across prefill chunks and decode steps. Module names follow the HF checkpoint's.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.models.hf_weights import load_by_name, tie_loaded
from vllite_core.core.kv_cache_spec import KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops
from vllite_core.state_cache import StateMetadata, gather_states, scatter_states


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Conv1d(nn.Module):
    """Depthwise conv weights in the checkpoint's layout ([channels, 1, kernel]); the op runs elsewhere."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(channels, 1, kernel, dtype=dtype)
        self.bias = _param(channels, dtype=dtype) if bias else None


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden_size, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight (FalconMamba normalises B, C and dt this way)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaMixer(nn.Module):
    """``c`` carries Mamba's config names (hybrids pass theirs renamed). ``rms_eps`` set: dt, B and C are
    RMS-normalised before the scan, with weights (``dt_layernorm`` ...: Jamba) when ``norm_weights``."""

    def __init__(self, c: Any, dtype: torch.dtype, rms_eps: float | None = None, norm_weights: bool = False
                 ) -> None:
        super().__init__()
        self.intermediate = c.intermediate_size
        self.state_size = c.state_size
        self.kernel = c.conv_kernel
        self.dt_rank = int(c.time_step_rank)
        self.activation = c.hidden_act
        self.rms_eps = rms_eps  # FalconMamba: B, C and dt are RMS-normalised
        self.in_proj = ReplicatedLinear(c.hidden_size, 2 * self.intermediate, bool(c.use_bias), dtype)
        self.conv1d = Conv1d(self.intermediate, self.kernel, bool(c.use_conv_bias), dtype)
        self.x_proj = ReplicatedLinear(self.intermediate, self.dt_rank + 2 * self.state_size, False, dtype)
        self.dt_proj = ReplicatedLinear(self.dt_rank, self.intermediate, True, dtype)
        self.A_log = _param(self.intermediate, self.state_size, dtype=dtype)
        self.D = _param(self.intermediate, dtype=dtype)
        self.out_proj = ReplicatedLinear(self.intermediate, c.hidden_size, bool(c.use_bias), dtype)
        self.norm_weights = norm_weights
        if norm_weights:
            assert rms_eps is not None
            self.dt_layernorm = RMSNorm(self.dt_rank, rms_eps, dtype)
            self.b_layernorm = RMSNorm(self.state_size, rms_eps, dtype)
            self.c_layernorm = RMSNorm(self.state_size, rms_eps, dtype)
        self._ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.intermediate, self.kernel - 1), (self.intermediate, self.state_size)]

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        ops, qsl = self._ops, md.query_start_loc_cpu
        states = gather_states(cache, md, tuple(self.state_shapes))
        conv_state, ssm_state = states
        xs, gate = self.in_proj(x).chunk(2, dim=-1)
        xs = ops.causal_conv1d(xs.contiguous(), self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, qsl,
                               self.activation)
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.norm_weights:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.rms_eps is not None:
            B, C, dt = _unit_rms(B, self.rms_eps), _unit_rms(C, self.rms_eps), _unit_rms(dt, self.rms_eps)
        dt = F.linear(dt, self.dt_proj.weight)  # the bias is added in float32 inside the scan
        A = -torch.exp(self.A_log.float())
        y = ops.selective_scan(xs, dt, A, B.contiguous(), C.contiguous(), self.D.float(), gate,
                               self.dt_proj.bias.float(), ssm_state, qsl)
        scatter_states(cache, md, states)
        return self.out_proj(y)


class MambaBlock(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype, rms_eps: float | None) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(c, "residual_in_fp32", True))
        self.norm = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)
        self.mixer = MambaMixer(c, dtype, rms_eps)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        h = self.mixer(self.norm(x.to(self.norm.weight.dtype)), cache, md)
        return residual + h


class MambaBackbone(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype, rms_eps: float | None) -> None:
        super().__init__()
        self.embeddings = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(MambaBlock(c, dtype, rms_eps) for _ in range(c.num_hidden_layers))
        self.norm_f = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)

    def forward(self, input_ids: torch.Tensor, caches: list[torch.Tensor], mds: list[StateMetadata]) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer, cache, md in zip(self.layers, caches, mds, strict=True):
            x = layer(x, cache, md)
        return self.norm_f(x.to(self.norm_f.weight.dtype))


class MambaForCausalLM(nn.Module, IsStateful):
    """Engine model for MambaForCausalLM checkpoints (HF names: ``backbone.*``, ``lm_head.weight``)."""

    mixer_rms: bool = False

    def __init__(self, hf_config: Any, attn_backend: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.vocab_size: int = hf_config.vocab_size
        rms_eps = float(hf_config.mixer_rms_eps) if self.mixer_rms else None
        self.backbone = MambaBackbone(hf_config, dtype, rms_eps)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = (self.backbone.embeddings.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, hf_config.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """One state per layer, kept in the model's dtype (the recurrence accumulates; it is not quantised)."""
        return [StateSpec.of(block_size, layer.mixer.state_shapes, self.dtype) for layer in self.backbone.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        return self.backbone(input_ids, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            name = name.replace("backbone.embedding.", "backbone.embeddings.")  # older checkpoints
            if name == "lm_head.weight":
                return None if self.tie_word_embeddings else "lm_head"
            return name

        loaded = load_by_name(self, weights, rename)
        return tie_loaded(self, loaded, "lm_head", "backbone.embeddings.weight") if self.tie_word_embeddings \
            else loaded


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba-1 with B, C and dt RMS-normalised (no weights) before the scan."""

    mixer_rms = True
