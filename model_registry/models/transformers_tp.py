"""Tensor parallelism for the Transformers fallback, from transformers' own plan.

A transformers config class names how its base model shards (``base_model_tp_plan``: module-name patterns ->
``"colwise"`` / ``"rowwise"`` / ...). The fallback swaps each ``nn.Linear`` the plan calls colwise for a
``ColumnParallelLinear`` (this rank's output rows) and each rowwise one for a ``RowParallelLinear`` (this rank's
input columns, outputs all-reduced), both loading their slice from the full checkpoint tensor. Rows split
evenly, as transformers splits them, which keeps whole attention heads (fused per-head q/k/v layouts too) on a
rank when the rank count divides the KV heads; the HF attention modules infer their local head count from the
projection widths. Embeddings, norms and the LM head stay whole on every rank. Plans with other kinds (packed
fused projections, experts, split inputs) are refused.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from model_registry.layers import ColumnParallelLinear, RowParallelLinear
from vllite_core.errors import ConfigError


class _Rows:
    """HF modules pass [batch, tokens, features]; the layers' ops and LoRA slots take token rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)  # type: ignore[misc]


class FallbackColumnLinear(_Rows, ColumnParallelLinear):
    """A colwise ``nn.Linear`` of the plan: this rank's output rows."""


class FallbackRowLinear(_Rows, RowParallelLinear):
    """A rowwise ``nn.Linear`` of the plan: this rank's input columns, outputs summed over ranks."""


SHARDED = {"colwise": FallbackColumnLinear, "rowwise": FallbackRowLinear}
# Kinds whose module stays whole on every rank: a replicated copy computes the same values.
REPLICATED = ("embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce")


def tp_plan(hf_config: Any) -> dict[str, str]:
    return dict(getattr(hf_config.get_text_config(), "base_model_tp_plan", None) or {})


def check_tp_plan(architecture: str, hf_config: Any, tensor_parallel_size: int) -> None:
    """ConfigError naming ``tensor_parallel_size`` when the fallback cannot shard this model so."""
    plan = tp_plan(hf_config)
    if not plan:
        raise ConfigError(f"tensor_parallel_size: transformers' {architecture} has no tensor-parallel plan "
                          "(base_model_tp_plan), so the Transformers fallback runs it on one rank only")
    other = sorted({f"{name}: {kind}" for name, kind in plan.items() if kind not in SHARDED and kind not in REPLICATED})
    if other:
        raise ConfigError(f"tensor_parallel_size: the Transformers fallback shards colwise/rowwise linear layers "
                          f"only; {architecture}'s plan also has {', '.join(other)}")
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if kv_heads % tensor_parallel_size or heads % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size: the Transformers fallback splits attention heads evenly, so "
                          f"{tensor_parallel_size} must divide num_key_value_heads={kv_heads} and "
                          f"num_attention_heads={heads}")


def shard_linears(base_model: nn.Module, hf_config: Any, dtype: torch.dtype) -> int:
    """Swap the plan's colwise/rowwise ``nn.Linear`` modules of ``base_model`` for this rank's parallel layers
    (same parameter names, so the checkpoint loads by name); returns how many were swapped."""
    patterns = [(re.compile("^" + re.escape(name).replace(r"\*", r"\d+") + "$"), SHARDED[kind])
                for name, kind in tp_plan(hf_config).items() if kind in SHARDED]
    swapped = 0
    for name, module in list(base_model.named_modules()):
        layer_cls = next((cls for rx, cls in patterns if rx.match(name)), None)
        if layer_cls is None:
            continue
        if type(module) is not nn.Linear:
            raise ConfigError(f"tensor_parallel_size: {name} is a {type(module).__name__}, not a linear layer the "
                              "Transformers fallback can shard")
        parent, _, child = name.rpartition(".")
        setattr(base_model.get_submodule(parent) if parent else base_model, child,
                layer_cls(module.in_features, module.out_features, module.bias is not None, dtype))
        swapped += 1
    return swapped
