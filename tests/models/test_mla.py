"""Multi-head latent attention (``model_registry.layers.mla``, ``MLAAttentionSpec``) on a tiny DeepSeek-V2: the
absorbed decode form equals the expanded one; the cache holds kv_lora_rank + qk_rope_head_dim values per token,
so the same memory gives more blocks than an MHA cache of the same heads (the engine's own count); prefix-cache
hits are reused and the tokens stay Hugging Face's."""
from __future__ import annotations

import logging

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.core.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec

CFG = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
           max_position_embeddings=256, rms_norm_eps=1e-5, intermediate_size=80, moe_intermediate_size=32,
           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, q_lora_rank=None)
BLOCK = 16


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp("deepseek_v2")
    hf = save_tiny(path, tf.DeepseekV2Config(**CFG, architectures=["DeepseekV2ForCausalLM"]), seed=11)
    return str(path), hf


def test_absorbed_decode_equals_expanded_attention(deepseek):
    import transformers as tf

    from model_registry.layers.mla import MLAAttention

    torch.manual_seed(0)
    layer = MLAAttention(tf.DeepseekV2Config(**CFG), torch.float64)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    length, h = 23, CFG["num_attention_heads"]
    c, k_pe = torch.randn(length, 16, dtype=torch.float64), torch.randn(length, 8, dtype=torch.float64)
    for tq in (1, 4):
        q_nope, q_pe = torch.randn(tq, h, 16, dtype=torch.float64), torch.randn(tq, h, 8, dtype=torch.float64)
        absorbed = layer._absorbed(q_nope, q_pe, c, k_pe)
        expanded = layer._expanded(q_nope, q_pe, c, k_pe)
        assert absorbed.shape == (tq, h, 12)
        torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)


def test_cache_blocks_and_prefix_reuse(deepseek, caplog):
    path, hf = deepseek
    budget = 1 << 20
    with caplog.at_level(logging.INFO):
        llm = LLM(model=path, dtype="float32", max_model_len=128, max_num_batched_tokens=32, kv_cache_memory=budget,
                  enable_prefix_caching=True, block_size=BLOCK)
    core = llm.llm_engine.core.engine_core
    mla = MLAAttentionSpec(BLOCK, 1, 16 + 8, torch.float32)
    mha = FullAttentionSpec(BLOCK, 4, 16 + 8, torch.float32)  # same heads: K of qk_head_dim, V padded to it
    layers = CFG["num_hidden_layers"]
    blocks = core.kv_cache_manager.block_pool.num_blocks
    assert blocks == budget // (layers * mla.page_bytes)
    assert mla.page_bytes * 8 == mha.page_bytes  # 24 values a token instead of 2 x 4 heads x 24
    assert f"{blocks} KV blocks" in caplog.text and "mla x2" in caplog.text

    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 512, (3 * BLOCK + 5,), generator=gen).tolist()
    prompts = [prefix, prefix + torch.randint(0, 512, (9,), generator=gen).tolist()]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)[0]
    second = llm.generate([{"prompt_token_ids": prompts[1]}], greedy)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 3 * BLOCK
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [hf_greedy(hf, p, 6) for p in prompts]


def test_decode_graphs_are_not_captured_over_model_read_caches():
    """MLA (and sink) layers plan from the metadata's host lists, which a replayed graph would not refresh: the
    runner asks the platform for no graphs when a group's cache is model-read, and does otherwise."""
    from types import SimpleNamespace

    from vllite_core.worker.graph_runner import ModelForward

    asked = []
    platform = SimpleNamespace(capture_graphs=lambda fwd, sizes, make_inputs, cfg: asked.append(sizes) or {})
    config = SimpleNamespace(enforce_eager=False, lora_config=None, scheduler_config=SimpleNamespace(max_num_seqs=4),
                             cache_config=SimpleNamespace(calculate_kv_scales=False),
                             model_config=SimpleNamespace(capabilities=SimpleNamespace(is_stateful=False)))
    kv = [torch.zeros(4, 16, 24)]
    for model_read in (True, False):
        forward = ModelForward(torch.nn.Identity(), SimpleNamespace(prepare=lambda md: None), 1)
        forward.capture(platform, config, kv, 1, 16, 64, torch.device("cpu"), model_read_caches=model_read)
    assert len(asked) == 1
