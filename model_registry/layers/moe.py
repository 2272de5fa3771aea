"""Mixture-of-experts: a top-k router and the experts' stacked weights, computed through one platform op
(``ModelOps.fused_moe``), with optional shared experts every token also runs.

Routing options cover the common families: softmax or sigmoid scores, renormalised top-k weights (Mixtral,
Granite), grouped top-k (``n_group`` groups, the best ``topk_group`` kept: DeepSeek), a score correction bias
that steers the choice but not the weights (DeepSeek-V3), and a routed scaling factor.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.linear import ReplicatedLinear
from model_registry.layers.mlp import GatedMLP
from model_registry.layers.params import check_full, copy_checked, empty_param
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import shard_experts, split
from vllite_core.errors import ConfigError
from vllite_core.model_ops import current_model_ops

if TYPE_CHECKING:
    from model_registry.layers.quantization.gguf import GGUFWeight

ExpertShard = Literal["w1", "w2", "w3"]  # vLLM's names: gate, down, up

_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_SHARD: dict[str, ExpertShard] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2",
                                  "w3": "w3"}


def expert_weight(name: str) -> tuple[str, int, ExpertShard] | None:
    """``<moe>.experts.<e>.<gate_proj|up_proj|down_proj|w1|w2|w3>.weight`` -> (the FusedMoE's name, e, shard)."""
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2)), _SHARD[m.group(3)]) if m else None


def check_routing(num_experts: int, top_k: int, scoring: str, n_group: int | None, topk_group: int | None) -> None:
    """A routing the router cannot serve is a ConfigError at load, naming the config field."""
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"scoring_func: must be 'softmax' or 'sigmoid', got {scoring!r}")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                          f"({num_experts})")
    if n_group is None:
        return
    if n_group < 1 or num_experts % n_group:
        raise ConfigError(f"n_group: {n_group} groups do not split {num_experts} experts evenly")
    if topk_group is None or not 1 <= topk_group <= n_group:
        raise ConfigError(f"topk_group: must be between 1 and n_group ({n_group}), got {topk_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ConfigError(f"num_experts_per_tok ({top_k}) exceeds the experts of the topk_group ({topk_group}) "
                          f"groups kept ({topk_group * (num_experts // n_group)})")


class TopKRouter(nn.Module):
    """Scores each token against ``num_experts`` (``weight`` [E, H]) and picks ``top_k`` of them; returns
    float32 weights and the expert ids, both [T, top_k]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 scoring: Literal["softmax", "sigmoid"] = "softmax", renormalize: bool = False,
                 n_group: int | None = None, topk_group: int | None = None, correction_bias: bool = False,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        check_routing(num_experts, top_k, scoring, n_group, topk_group)
        self.weight = empty_param(num_experts, hidden_size, dtype=dtype)
        self.e_score_correction_bias = empty_param(num_experts, dtype=torch.float32) if correction_bias else None
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight).float()
        plain = self.n_group is None and self.e_score_correction_bias is None
        if self.scoring == "softmax" and self.renormalize and plain:
            # The softmax of the chosen logits is the renormalised softmax, in fewer steps (Granite's order).
            top, ids = logits.topk(self.top_k, dim=-1)
            return self._scaled(torch.softmax(top, dim=-1)), ids
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group is not None:
            choice = self._best_groups(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return self._scaled(weights), ids

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's ``topk_group`` best groups masked out; a group
        scores its best expert, or its best two with a correction bias (DeepSeek-V3)."""
        assert self.topk_group is not None, "grouped top-k needs topk_group"
        groups = choice.view(choice.shape[0], self.n_group, -1)
        best = groups.topk(2, dim=-1).values.sum(-1) if self.e_score_correction_bias is not None \
            else groups.amax(-1)
        kept = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1).indices, 1.0)
        return groups.masked_fill(kept.unsqueeze(-1) == 0, float("-inf")).view_as(choice)

    def _scaled(self, weights: torch.Tensor) -> torch.Tensor:
        return weights if self.routed_scaling_factor == 1.0 else weights * self.routed_scaling_factor


class FusedMoE(nn.Module):
    """Routed SwiGLU experts stacked as ``w13_weight`` [E, 2I, H] (gate rows, then up) and ``w2_weight``
    [E, H, I], plus optional shared experts (``shared_intermediate_size``) whose output, scaled by a sigmoid
    gate when ``shared_expert_gate``, is added. Stacked checkpoint tensors load through the parameters' loaders;
    per-expert ones through ``load_expert``. Over tensor-parallel ranks each rank holds every expert's slice
    ``[i0, i1)`` of the intermediate dimension (gate and up rows, down columns); with expert parallelism
    (``enable_expert_parallel``) it holds the whole experts ``[e0, e1)`` instead (``experts``), computes only the
    choices routed to them (every rank routes every token) and leaves the others' rows zero. Either way the
    routed outputs are summed over ranks (the shared experts' row-parallel ``down_proj`` sums its own)."""

    def __init__(self, router: TopKRouter, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 shared_intermediate_size: int | None = None, shared_expert_gate: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts = router.weight.shape[0]
        self.router = router
        self.tp = tp = get_tp()
        self.intermediate_size = intermediate_size  # the checkpoint's (every rank's slice of it: ``local``)
        self.expert_parallel = tp.enable_expert_parallel and tp.world_size > 1
        if self.expert_parallel:  # whole experts [e0, e1) on this rank
            self.experts, self.local = shard_experts(num_experts, tp.world_size, tp.rank), (0, intermediate_size)
        else:  # every expert, this rank's slice of each one's width
            self.experts, self.local = (0, num_experts), split(intermediate_size, tp.world_size, tp.rank)
        n, held = self.local[1] - self.local[0], self.experts[1] - self.experts[0]
        self.w13_weight = empty_param(held, 2 * n, hidden_size, dtype=dtype)
        self.w2_weight = empty_param(held, hidden_size, n, dtype=dtype)
        self.w13_weight.weight_loader = self._load_stacked  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self._load_stacked  # type: ignore[attr-defined]
        self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, dtype) \
            if shared_intermediate_size else None
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype) if shared_expert_gate else None
        self.ops = current_model_ops()
        self.state: dict = {}  # what the platform's fused_moe caches for these weights (packed panels)
        self.gguf: list[tuple[list[GGUFWeight], GGUFWeight]] | None = None  # use_gguf_blocks

    def use_gguf_blocks(self, experts: list[tuple[list[GGUFWeight], GGUFWeight]]) -> None:
        """Compute every expert from its GGUF blocks (w13 as one or two weights, w2), the stacked float weights
        dropped (quantization="gguf"; one rank holding every expert whole)."""
        self.gguf = experts
        self.w13_weight = nn.Parameter(torch.empty(0, dtype=self.w13_weight.dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(0, dtype=self.w2_weight.dtype), requires_grad=False)

    @torch.no_grad()
    def load_expert(self, src: torch.Tensor, expert: int, shard: ExpertShard, name: str) -> None:
        """One expert's gate (``w1``), up (``w3``) or down (``w2``) projection from the checkpoint (this rank's
        slice of it; nothing when another rank holds the expert)."""
        (i0, i1), n = self.local, self.local[1] - self.local[0]
        if not self.experts[0] <= expert < self.experts[1]:
            return
        e = expert - self.experts[0]
        if shard == "w2":
            check_full(src, 1, self.intermediate_size, name)
            copy_checked(self.w2_weight[e], src[:, i0:i1], name)
            return
        check_full(src, 0, self.intermediate_size, name)
        dst = self.w13_weight[e, :n] if shard == "w1" else self.w13_weight[e, n:]
        copy_checked(dst, src[i0:i1], name)

    @torch.no_grad()
    def _load_stacked(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        """All experts at once: ``[E, 2I, H]`` (gate rows, then up) or ``[E, H, I]``, this rank's slice."""
        (i0, i1), full = self.local, self.intermediate_size
        check_full(src, 0, self.num_experts, name)
        src = src[self.experts[0]:self.experts[1]]
        if param is self.w2_weight:
            check_full(src, 2, full, name)
            copy_checked(param.data, src[:, :, i0:i1], name)
            return
        check_full(src, 1, 2 * full, name)
        copy_checked(param.data, torch.cat((src[:, i0:i1], src[:, full + i0:full + i1]), 1), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        if self.gguf is not None:
            out = self.ops.gguf_fused_moe(x, self.gguf, weights.to(x.dtype), ids)
        elif self.expert_parallel:
            out = self._held_experts(x, weights.to(x.dtype), ids)
        else:
            out = self.ops.fused_moe(x, self.w13_weight, self.w2_weight, weights.to(x.dtype), ids, self.state)
        if self.tp.world_size > 1:
            out = self.tp.communicator.all_reduce(out)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def _held_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: the (token, choice) pairs routed to this rank's experts, run through the
        platform's op as top-1 rows (one row per pair, local expert ids), summed back into their tokens."""
        e0, e1 = self.experts
        token, slot = ((ids >= e0) & (ids < e1)).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if token.numel():
            y = self.ops.fused_moe(x.index_select(0, token), self.w13_weight, self.w2_weight,
                                   weights[token, slot].unsqueeze(1), (ids[token, slot] - e0).unsqueeze(1),
                                   self.state)
            out.index_add_(0, token, y)
        return out
