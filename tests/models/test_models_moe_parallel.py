"""Expert parallelism (``enable_expert_parallel``): whole experts placed by rank over the tensor-parallel ranks.

The layer: ``FusedMoE`` built as each rank of a simulated group holds its share of the experts (and its slice of
the shared expert); the ranks' outputs summed equal the unsharded layer in float64, also when a rank's experts
receive no token. The engine: Mixtral, Qwen2-MoE and Qwen3-MoE over two ranks of the mp executor give Hugging
Face's float32 greedy tokens, logprobs within 1e-4. A layout the experts cannot divide is a ConfigError naming
``enable_expert_parallel`` before any worker starts.
"""
from __future__ import annotations

import argparse

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import save_tiny

from model_registry.layers.moe import FusedMoE, TopKRouter
from vllite_core import LLM, SamplingParams
from vllite_core.config import EngineArgs
from vllite_core.distributed import parallel_state
from vllite_core.distributed.parallel_state import TensorParallelState
from vllite_core.distributed.sharding import shard_experts
from vllite_core.errors import ConfigError

H, INTER, SHARED, E, TOP_K = 16, 12, 10, 8, 2
MAX_TOKENS = 8
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)


def _as_rank(monkeypatch, rank: int, world: int, ep: bool = True) -> None:
    monkeypatch.setattr(parallel_state, "_state", TensorParallelState(rank, world, enable_expert_parallel=ep))


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"router.weight": torch.randn(E, H, generator=g, dtype=torch.float64)}
    for e in range(E):
        for shard, shape in (("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))):
            w[f"experts.{e}.{shard}"] = torch.randn(*shape, generator=g, dtype=torch.float64) / 3
    for name, shape in (("gate_proj", (SHARED, H)), ("up_proj", (SHARED, H)), ("down_proj", (H, SHARED))):
        w[f"shared_experts.{name}.weight"] = torch.randn(*shape, generator=g, dtype=torch.float64) / 3
    return w


def _build(ckpt: dict[str, torch.Tensor], stacked: bool) -> FusedMoE:
    """A FusedMoE (softmax top-2, shared expert) loaded the way this process's rank loads it."""
    from model_registry.layers.params import load_parameter

    moe = FusedMoE(TopKRouter(H, E, TOP_K, torch.float64), H, INTER, torch.float64, SHARED)
    params = dict(moe.named_parameters())
    load_parameter(params["router.weight"], ckpt["router.weight"], None, "router.weight")
    if stacked:  # [E, 2I, H] and [E, H, I], as GraniteMoE stores them
        w13 = torch.stack([torch.cat((ckpt[f"experts.{e}.w1"], ckpt[f"experts.{e}.w3"])) for e in range(E)])
        load_parameter(moe.w13_weight, w13, None, "w13")
        load_parameter(moe.w2_weight, torch.stack([ckpt[f"experts.{e}.w2"] for e in range(E)]), None, "w2")
    else:
        for e in range(E):
            for shard in ("w1", "w3", "w2"):
                moe.load_expert(ckpt[f"experts.{e}.{shard}"], e, shard, f"experts.{e}.{shard}")  # type: ignore
    mlp = moe.shared_experts
    assert mlp is not None
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"shared_experts.{name}.weight"
        param = params[key] if name == "down_proj" else mlp.gate_up_proj.weight
        load_parameter(param, ckpt[key], None if name == "down_proj" else name.split("_")[0], key)
    return moe


@pytest.mark.parametrize("world,stacked", [(2, False), (4, True)])
@pytest.mark.parametrize("routing", ["random", "one_expert_takes_all"])
def test_ranks_holding_whole_experts_sum_to_the_whole_layer(monkeypatch, world, stacked, routing):
    ckpt = _checkpoint(world)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if routing == "one_expert_takes_all":  # every token's top two are experts 0 and 1: the other ranks idle
        x[:, 0] = 1.0
        ckpt["router.weight"][:2, 0] += 50.0
    whole = _build(ckpt, stacked)
    ref = whole(x)
    parts = []
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        moe = _build(ckpt, stacked)
        assert moe.w13_weight.shape == (E // world, 2 * INTER, H)  # whole experts, its share
        assert moe.experts == shard_experts(E, world, rank)
        torch.testing.assert_close(moe.w2_weight, whole.w2_weight[moe.experts[0]:moe.experts[1]], rtol=0, atol=0)
        parts.append(moe(x))
    if routing == "one_expert_takes_all":
        _, ids = whole.router(x)
        assert set(ids.flatten().tolist()) == {0, 1}
    torch.testing.assert_close(sum(parts), ref, rtol=1e-10, atol=1e-10)


def test_experts_that_do_not_divide_are_a_config_error(monkeypatch):
    _as_rank(monkeypatch, 0, 3)
    with pytest.raises(ConfigError, match=r"enable_expert_parallel: 8 experts .* tensor_parallel_size=3"):
        FusedMoE(TopKRouter(H, E, TOP_K, torch.float64), H, INTER, torch.float64)
    _as_rank(monkeypatch, 0, 3, ep=False)  # tensor parallelism alone splits each expert's width: fine
    assert FusedMoE(TopKRouter(H, E, TOP_K, torch.float64), H, INTER, torch.float64).w13_weight.shape[0] == E


def test_engine_refuses_an_uneven_layout_before_starting_workers(tmp_path):
    import transformers as tf

    save_tiny(tmp_path, tf.MixtralConfig(**{**COMMON, "num_hidden_layers": 1}, intermediate_size=16,
                                         num_local_experts=6, num_experts_per_tok=2,
                                         architectures=["MixtralForCausalLM"]))
    with pytest.raises(ConfigError, match=r"enable_expert_parallel: 6 experts .* tensor_parallel_size=4"):
        LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=4, enable_expert_parallel=True,
            num_kv_blocks=8)


def test_cli_flag_and_short_form():
    from vllite_core.entrypoints.engine_args_cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv in (["--enable-expert-parallel"], ["-ep"]):
        ns = parser.parse_args(["--tensor-parallel-size", "2", *argv])
        assert ns.enable_expert_parallel is True
    assert parser.parse_args([]).enable_expert_parallel is False
    args = EngineArgs.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True)
    assert args.create_config().parallel_config.enable_expert_parallel is True


def _families():
    import transformers as tf

    return {
        "mixtral": lambda: tf.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8,
                                            num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
        # Layer 0 dense, layer 1 sparse with the gated shared expert (TP-split beside the placed experts).
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48, num_experts=8,
                                               num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False,
                                               architectures=["Qwen2MoeForCausalLM"]),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32, head_dim=16,
                                               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                               architectures=["Qwen3MoeForCausalLM"]),
    }


def _generate_matches_hf(path, hf, seed: int, **engine) -> None:
    """Two prompts (one longer than the 16-token chunk budget) over two ranks of the mp executor: HF's greedy
    tokens, each token's logprob within 1e-4 of HF's."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (4, 27)]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, num_kv_blocks=32,
              tensor_parallel_size=2, **engine)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    finally:
        llm.llm_engine.core.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    for out, p in zip(outs, prompts, strict=True):
        got = out.outputs[0]
        with torch.inference_mode():
            lp = torch.log_softmax(hf(input_ids=torch.tensor([p + got.token_ids])).logits[0].float(), -1)[len(p) - 1:]
        for i, t in enumerate(got.token_ids):
            assert got.logprobs[i][t].logprob == pytest.approx(float(lp[i, t]), abs=1e-4), i


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_expert_parallel_two_ranks_match_hf(tmp_path, name):
    hf = save_tiny(tmp_path, _families()[name](), seed=11 + len(name))
    _generate_matches_hf(tmp_path, hf, 9, enable_expert_parallel=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,ep", [("olmoe", False), ("deepseek_v2", False), ("deepseek_v3", True),
                                     ("gpt_oss", False), ("gpt_oss", True)])
def test_families_once_refused_tensor_parallelism_match_hf_over_two_ranks(tmp_path, name, ep):
    """OLMoE (its q/k norm over all heads: the sums span the ranks), DeepSeek (MLA heads split, the latent cache
    on every rank; V3 with its experts placed by rank), gpt-oss (sinks split with their heads; experts' width
    split, or placed by rank)."""
    from test_models_moe import _configs

    hf = save_tiny(tmp_path, _configs()[name](), seed=21 + len(name))
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    if biases:  # buffers: save_tiny leaves them zero
        with torch.no_grad():
            for b in biases:
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())) * 0.3)
        hf.save_pretrained(tmp_path)
    _generate_matches_hf(tmp_path, hf, 10, enable_expert_parallel=ep)


def test_mla_refuses_more_ranks_than_heads():
    import transformers as tf
    from test_models_moe import DEEPSEEK

    from model_registry.models.deepseek import DeepseekV3ForCausalLM

    DeepseekV3ForCausalLM.check_tensor_parallel(tf.DeepseekV3Config(**DEEPSEEK), 4)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 8 ranks is more than .* 4 attention heads"):
        DeepseekV3ForCausalLM.check_tensor_parallel(tf.DeepseekV3Config(**DEEPSEEK), 8)
