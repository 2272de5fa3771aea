"""The MoE layer (``model_registry.layers.moe``) against plain per-token float64 references written here: each
router option, ``ModelOps.fused_moe`` (top-k > 1, experts no token chose), shared experts with their gate, and
per-expert checkpoint loading."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model_registry.layers.moe import FusedMoE, TopKRouter, expert_weight
from vllite_core.model_ops import ModelOps, use_model_ops

T, H, INTER, E = 7, 8, 6, 8


def _reference_route(x: torch.Tensor, w: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                     n_group: int | None, topk_group: int | None, bias: torch.Tensor | None,
                     scale: float) -> list[dict[int, float]]:
    """Per token: {expert: weight}, by the textbook definition of each option."""
    out = []
    for row in x.double():
        logits = [float(row @ w[e].double()) for e in range(E)]
        if scoring == "softmax":
            z = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / z for v in logits]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        allowed = list(range(E))
        if n_group is not None:
            size = E // n_group
            groups = [choice[g * size:(g + 1) * size] for g in range(n_group)]
            rank = [sum(sorted(g)[-2:]) if bias is not None else max(g) for g in groups]
            best = sorted(range(n_group), key=lambda g: -rank[g])[:topk_group]
            allowed = [e for e in allowed if e // size in best]
        ids = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        weights = {e: scores[e] for e in ids}
        total = sum(weights.values())
        out.append({e: (v / total if renormalize else v) * scale for e, v in weights.items()})
    return out


ROUTERS = {
    "softmax": dict(scoring="softmax"),  # Jamba
    "softmax_renormalized": dict(scoring="softmax", renormalize=True),  # Mixtral, Granite
    "sigmoid_renormalized": dict(scoring="sigmoid", renormalize=True),
    "grouped_softmax": dict(scoring="softmax", n_group=4, topk_group=2),  # DeepSeek-V2
    "grouped_sigmoid_bias_scaled": dict(scoring="sigmoid", renormalize=True, n_group=4, topk_group=2,
                                        correction_bias=True, routed_scaling_factor=2.5),  # DeepSeek-V3
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("top_k", [1, 3])
def test_router_matches_reference(name, top_k):
    torch.manual_seed(0)
    opts = ROUTERS[name]
    router = TopKRouter(H, E, top_k, torch.float64, **opts)
    router.weight.data.copy_(torch.randn(E, H, dtype=torch.float64))
    bias = None
    if router.e_score_correction_bias is not None:
        bias = torch.randn(E) * 0.5
        router.e_score_correction_bias.data.copy_(bias)
    x = torch.randn(T, H, dtype=torch.float64)
    weights, ids = router(x)
    assert weights.dtype == torch.float32 and weights.shape == ids.shape == (T, top_k)
    ref = _reference_route(x, router.weight, top_k, opts["scoring"], opts.get("renormalize", False),
                           opts.get("n_group"), opts.get("topk_group"), bias, opts.get("routed_scaling_factor", 1.0))
    for t in range(T):
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert set(got) == set(ref[t])
        for e, v in ref[t].items():
            assert got[e] == pytest.approx(v, rel=1e-5)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = (w13 @ x).chunk(2)
    return w2 @ (F.silu(gate) * up)


def test_fused_moe_matches_per_token_loop():
    """top-k 2 over 4 experts; expert 3 gets no token (its weights NaN: never touched)."""
    torch.manual_seed(1)
    x = torch.randn(T, H, dtype=torch.float64)
    w13 = torch.randn(4, 2 * INTER, H, dtype=torch.float64)
    w2 = torch.randn(4, H, INTER, dtype=torch.float64)
    w13[3], w2[3] = float("nan"), float("nan")
    ids = torch.randint(0, 3, (T, 2))
    ids[:, 1] = (ids[:, 0] + 1) % 3  # two distinct experts per token, never expert 3
    weights = torch.rand(T, 2, dtype=torch.float64)
    out = ModelOps().fused_moe(x, w13, w2, weights, ids)
    for t in range(T):
        want = sum(weights[t, j] * _expert(x[t], w13[ids[t, j]], w2[ids[t, j]]) for j in range(2))
        torch.testing.assert_close(out[t], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gated", [False, True])
def test_fused_moe_layer_with_shared_expert(gated):
    """Router + experts + shared expert (sigmoid-gated or not), against the same computation per token."""
    torch.manual_seed(2)
    with use_model_ops(ModelOps()):
        moe = FusedMoE(TopKRouter(H, E, 2, torch.float64, renormalize=True), H, INTER, torch.float64,
                       shared_intermediate_size=5, shared_expert_gate=gated)
    for p in moe.parameters():
        p.data.copy_(torch.randn_like(p))
    x = torch.randn(T, H, dtype=torch.float64)
    out = moe(x)
    routes = _reference_route(x, moe.router.weight, 2, "softmax", True, None, None, None, 1.0)
    shared = moe.shared_experts
    for t in range(T):
        want = sum(v * _expert(x[t], moe.w13_weight[e], moe.w2_weight[e]) for e, v in routes[t].items())
        s = _expert(x[t], shared.gate_up_proj.weight, shared.down_proj.weight)
        if gated:
            s = torch.sigmoid(moe.shared_expert_gate.weight[0] @ x[t]) * s
        torch.testing.assert_close(out[t], want + s, rtol=1e-6, atol=1e-6)  # routing weights are float32


def test_per_expert_checkpoint_tensors_fill_the_stacked_weights():
    torch.manual_seed(3)
    moe = FusedMoE(TopKRouter(H, E, 2, torch.float32), H, INTER, torch.float32)
    w13 = torch.randn(E, 2 * INTER, H)
    w2 = torch.randn(E, H, INTER)
    for e in range(E):
        for part, tensor in (("gate_proj", w13[e, :INTER]), ("up_proj", w13[e, INTER:]), ("down_proj", w2[e])):
            name = f"model.layers.0.feed_forward.experts.{e}.{part}.weight"
            prefix, expert, shard = expert_weight(name)
            assert (prefix, expert) == ("model.layers.0.feed_forward", e)
            moe.load_expert(tensor, expert, shard, name)
    assert torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2)
    assert expert_weight("model.layers.0.block_sparse_moe.experts.3.w3.weight") == (
        "model.layers.0.block_sparse_moe", 3, "w3")
    assert expert_weight("model.layers.0.feed_forward.experts.gate_up_proj") is None
    with pytest.raises(ValueError, match="experts.0.down_proj"):
        moe.load_expert(torch.zeros(H, INTER + 1), 0, "w2", "experts.0.down_proj.weight")


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=9), "num_experts_per_tok"),
    (dict(top_k=0), "num_experts_per_tok"),
    (dict(scoring="relu"), "scoring_func"),
    (dict(n_group=3, topk_group=1), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=None), "topk_group"),
    (dict(top_k=5, n_group=4, topk_group=2), "num_experts_per_tok"),  # 2 groups of 2 experts kept
])
def test_router_configs_it_cannot_serve_are_config_errors(kwargs, field):
    from vllite_core.errors import ConfigError

    opts = dict(top_k=2) | kwargs
    with pytest.raises(ConfigError, match=field):
        TopKRouter(H, E, opts.pop("top_k"), torch.float32, **opts)
