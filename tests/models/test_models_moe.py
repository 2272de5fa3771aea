"""Mixture-of-experts families on the engine against Hugging Face transformers on the same tiny random weights
(float32): greedy tokens identical to HF's own cached greedy loop, and each generated token's logprob within
1e-4 of HF's log-softmax over the whole sequence. More experts than the top-k (routing matters), prompts
longer than the chunk budget (chunked prefill beside decodes), one module per family, HF computed once."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.errors import ConfigError

MAX_TOKENS = 8
PROMPT_LENS = (3, 21, 45)
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)


def _configs():
    import transformers as tf

    return {
        "mixtral": lambda: tf.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=6,
                                            num_experts_per_tok=2, architectures=["MixtralForCausalLM"]),
        # Layer 0 dense (mlp_only_layers), layer 1 sparse with the gated shared expert; weights not renormalised.
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48, num_experts=6,
                                               num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False,
                                               architectures=["Qwen2MoeForCausalLM"]),
        # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; per-head q/k norm.
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32, head_dim=16,
                                               num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
                                               norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"]),
        "olmoe": lambda: tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                        clip_qkv=2.0, architectures=["OlmoeForCausalLM"]),
        "granite_moe": lambda: tf.GraniteMoeConfig(**COMMON, intermediate_size=32, num_local_experts=6,
                                                   num_experts_per_tok=2, embedding_multiplier=2.0,
                                                   residual_multiplier=0.5, attention_multiplier=0.2,
                                                   logits_scaling=1.5, architectures=["GraniteMoeForCausalLM"]),
        # MLA without a q LoRA, softmax routing limited to 2 of 4 groups, layer 0 dense, a shared expert.
        "deepseek_v2": lambda: tf.DeepseekV2Config(**DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
                                                   routed_scaling_factor=1.5, architectures=["DeepseekV2ForCausalLM"]),
        # MLA with a q LoRA, sigmoid scores with a (random) correction bias, renormalised and scaled.
        "deepseek_v3": lambda: tf.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, norm_topk_prob=True,
                                                   routed_scaling_factor=2.5, architectures=["DeepseekV3ForCausalLM"]),
        # Sliding (window 6) and full layers alternating, sinks, clamped SwiGLU with biases, yarn rope.
        "gpt_oss": lambda: tf.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                                           head_dim=16, sliding_window=6, swiglu_limit=1.5,
                                           architectures=["GptOssForCausalLM"]),
        # Yarn rope with DeepSeek's mscale / mscale_all_dim (the softmax scale's correction), greedy V2 routing.
        "deepseek_v2_yarn": lambda: tf.DeepseekV2Config(
            **DEEPSEEK, q_lora_rank=None, topk_method="greedy", rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
            architectures=["DeepseekV2ForCausalLM"]),
    }


DEEPSEEK = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=256, rms_norm_eps=1e-5, intermediate_size=80, moe_intermediate_size=32,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4, topk_group=2)


@pytest.fixture(scope="module", params=list(_configs()))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(path, _configs()[request.param](), seed=len(request.param))
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    if biases:  # buffers: save_tiny leaves them zero
        with torch.no_grad():
            for b in biases:
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())) * 0.3)
        hf.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    ref = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    with torch.inference_mode():
        ref_lp = [torch.log_softmax(hf(input_ids=torch.tensor([p + r])).logits[0].float(), -1)[len(p) - 1:-1]
                  for p, r in zip(prompts, ref, strict=True)]
    return request.param, str(path), prompts, ref, ref_lp


def test_greedy_and_logprobs_match_hf(family):
    name, path, prompts, ref, ref_lp = family
    # A 16-token budget splits the longer prompts into chunks beside the others' decodes.
    llm = LLM(model=path, dtype="float32", max_model_len=128, max_num_batched_tokens=16, num_kv_blocks=48)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == ref
    for out, lp in zip(outs, ref_lp, strict=True):
        got = out.outputs[0]
        for i, t in enumerate(got.token_ids):
            assert got.logprobs[i][t].logprob == pytest.approx(float(lp[i, t]), abs=1e-4), (name, i)


def _mixtral(tmp_path, **kw):
    import transformers as tf

    cfg = tf.MixtralConfig(**{**COMMON, "num_hidden_layers": 1}, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, architectures=["MixtralForCausalLM"], **kw)
    save_tiny(tmp_path, cfg)
    return cfg


def test_top_k_above_the_experts_is_a_config_error(tmp_path):
    from vllite_platform_cpu.attention import TorchPagedAttention

    from model_registry.models.mixtral import MixtralForCausalLM

    cfg = _mixtral(tmp_path)
    cfg.num_experts_per_tok = 5
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(5\).*\(4\)"):
        MixtralForCausalLM(cfg, TorchPagedAttention(), torch.float32)


def test_missing_expert_weight_is_named_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    _mixtral(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    from vllite_platform_cpu.attention import TorchPagedAttention

    from model_registry.loader import load_model
    from model_registry.models.mixtral import MixtralForCausalLM
    from model_registry.source import load_hf_config, resolve_model_source

    source = resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match=r"lacks expert weight\(s\) 2\.w3"):
        load_model(source, load_hf_config(source), MixtralForCausalLM, TorchPagedAttention(), torch.float32,
                   torch.device("cpu"))


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_hf(tmp_path):
    """Qwen2-MoE over two ranks (heads split, every expert's intermediate split, the shared expert's too; one
    dense layer): greedy tokens and logprobs as HF's. The other families over two ranks, and expert parallelism:
    test_models_moe_parallel.py."""
    hf = save_tiny(tmp_path, _configs()["qwen2_moe"](), seed=4)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (4, 27)]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, num_kv_blocks=32,
              tensor_parallel_size=2)
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
            assert got.logprobs[i][t].logprob == pytest.approx(float(lp[i, t]), abs=1e-4)


def test_gpt_oss_mxfp4_experts_dequantised_at_load(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales (random bytes: every byte is a valid pair
    of FP4 values), against HF on the weights transformers' own MXFP4 dequantiser gives."""
    import json

    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from model_registry.models.gpt_oss import dequantize_mxfp4

    cfg = tf.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                          sliding_window=6, architectures=["GptOssForCausalLM"])
    hf = save_tiny(tmp_path, cfg, seed=5)
    gen = torch.Generator().manual_seed(9)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    for i, layer in enumerate(hf.model.layers):
        for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            blocks = torch.randint(0, 256, (4, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
            scales = torch.randint(119, 124, (4, rows, cols // 32), dtype=torch.uint8, generator=gen)
            want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), want)
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(want)
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[name]
            tensors[f"{name}_scales"], tensors[f"{name}_blocks"] = scales, blocks
    save_file(tensors, f, metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 30)]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16, num_kv_blocks=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
