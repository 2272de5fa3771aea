"""Mamba and hybrid models on the engine: greedy tokens identical to Hugging Face (fp32) with several requests
of different lengths in a step, prompts split by a small chunk budget, staggered arrivals, and preemption
(which drops the recurrent state and recomputes it).

The reference is HF's own forward over the whole sequence at every step (no HF cache): HF ``generate``
with its recurrent cache is not a safe reference here, since for a prompt shorter than ``conv_kernel - 1``
tokens it diverges from HF's own uncached forward (checked on transformers 5.24)."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy_with
from tiny_models import save_tiny

from vllite_core import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = (2, 17, 40, 75)


def _configs():
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2)
    return {
        "mamba": lambda: tf.MambaConfig(**common, state_size=8, conv_kernel=4, expand=2,
                                        architectures=["MambaForCausalLM"]),
        "falcon_mamba": lambda: tf.FalconMambaConfig(**common, state_size=8, conv_kernel=4, expand=2,
                                                     architectures=["FalconMambaForCausalLM"]),
        "mamba2": lambda: tf.Mamba2Config(**common, state_size=16, conv_kernel=4, expand=2, num_heads=8, head_dim=16,
                                          n_groups=1, chunk_size=16, architectures=["Mamba2ForCausalLM"]),
        "jamba": lambda: tf.JambaConfig(**common, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                                        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                        architectures=["JambaForCausalLM"]),
        # The attention layer with a dense MLP (a Mamba layer with the MoE): the CPU platform's fused layer call.
        "jamba_dense": lambda: tf.JambaConfig(**common, intermediate_size=96, num_attention_heads=4,
                                              num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                                              expert_layer_period=2, expert_layer_offset=0, num_experts=2,
                                              num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                              architectures=["JambaForCausalLM"]),
        "lfm2": lambda: tf.Lfm2Config(**common, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                      layer_types=["conv", "full_attention"], conv_L_cache=3,
                                      max_position_embeddings=256, architectures=["Lfm2ForCausalLM"]),
        "nemotron_h": lambda: tf.NemotronHConfig(**common, hybrid_override_pattern="M*", num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
                                                 mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16,
                                                 intermediate_size=96, max_position_embeddings=256,
                                                 architectures=["NemotronHForCausalLM"]),
        # Granite's multipliers away from 1 and RoPE on, so each is exercised.
        "granite_moe_hybrid": lambda: tf.GraniteMoeHybridConfig(
            **common, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
            intermediate_size=96, shared_intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
            position_embedding_type="rope", max_position_embeddings=256,
            architectures=["GraniteMoeHybridForCausalLM"]),
        # muP multipliers away from 1 and the gated norm on, so each is exercised.
        "falcon_h1": lambda: tf.FalconH1Config(
            **common, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128,
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
            mamba_rms_norm=True, mamba_norm_before_gate=False, ssm_multipliers=[1.5, 0.5, 2.0, 0.8, 1.2],
            ssm_in_multiplier=1.3, ssm_out_multiplier=0.7, attention_in_multiplier=0.9,
            attention_out_multiplier=1.1, key_multiplier=0.6, mlp_multipliers=[1.4, 0.6], embedding_multiplier=2.0,
            lm_head_multiplier=0.8, max_position_embeddings=256, architectures=["FalconH1ForCausalLM"]),
        # Attention adapters and RoPE on; three layers, two of them hybrid sharing one block (tied weights).
        "zamba2": lambda: tf.Zamba2Config(
            vocab_size=512, hidden_size=64, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
            hybrid_layer_ids=[1, 2], num_mem_blocks=1, n_mamba_heads=8, mamba_headdim=16, mamba_d_state=16,
            mamba_ngroups=1, chunk_size=16, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
            adapter_rank=8, use_shared_attention_adapter=True, use_mem_rope=True, max_position_embeddings=256,
            architectures=["Zamba2ForCausalLM"]),
    }


ARCHS = list(_configs())
# Hybrids (attention beside state layers) -> KV blocks small enough to preempt in the pressure test.
HYBRIDS: dict[str, int] = {"jamba": 10, "jamba_dense": 10, "lfm2": 10, "nemotron_h": 10, "granite_moe_hybrid": 10,
                             "falcon_h1": 10, "zamba2": 10}


def _hf_reference(hf, prompts):
    return [hf_greedy_with(hf, p, MAX_TOKENS, lambda logits, *_: logits) for p in prompts]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(path, _configs()[request.param]())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return request.param, str(path), hf, prompts, _hf_reference(hf, prompts)


def test_greedy_matches_hf_with_chunked_prefill(tiny):
    _, path, _, prompts, ref = tiny
    # A 24-token budget splits the longer prompts into chunks beside the others' decodes.
    llm = LLM(model=path, dtype="float32", max_model_len=256, max_num_batched_tokens=24, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.llm_engine.core.engine_core.kv_cache_manager.enable_caching is False


def test_staggered_arrivals_under_cache_pressure(tiny):
    """Few blocks, later arrivals more urgent. A pure state-space model holds one block per request for its
    whole life, so requests wait for a state block (max_num_seqs is lowered to what fits) and no running
    request ever needs another; a hybrid's attention layers grow, run out of blocks and preempt, and the
    preempted request's state is dropped and recomputed from zero. Every request still matches HF."""
    name, path, _, prompts, ref = tiny
    hybrid = name in HYBRIDS
    llm = LLM(model=path, dtype="float32", max_model_len=256, max_num_batched_tokens=32,
              num_kv_blocks=HYBRIDS.get(name, 3), scheduling_policy="priority")
    engine = llm.llm_engine
    done: dict[str, list[int]] = {}
    arrivals = {0: [0, 1], 3: [2], 5: [3]}  # step -> prompts arriving; later ones are more urgent
    max_running = 0
    for step in range(400):
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, GREEDY, priority=2 - i)
        if step > max(arrivals) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        max_running = max(max_running, len(engine.core.engine_core.scheduler.running))
    assert done == {f"r{i}": ref[i] for i in range(len(prompts))}
    if hybrid:
        assert engine.core.stats().num_preemptions_total > 0
    else:
        assert max_running == 2
    kv = engine.core.engine_core.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def _state_bytes_per_request(hf_config) -> int:
    """Recurrent state of one request from the HF config alone (float32): per layer the conv window
    (kernel - 1 inputs of every channel) and the SSM state."""
    c = hf_config
    if c.model_type == "mamba2":  # conv over x, B and C; SSM state per head
        inner = c.num_heads * c.head_dim
        conv = (inner + 2 * c.n_groups * c.state_size) * (c.conv_kernel - 1)
        return c.num_hidden_layers * 4 * (conv + inner * c.state_size)
    return c.num_hidden_layers * 4 * c.intermediate_size * ((c.conv_kernel - 1) + c.state_size)


def test_memory_budget_bounds_concurrent_requests(tiny, caplog):
    name, path, hf, prompts, ref = tiny
    if name in HYBRIDS:
        pytest.skip("a hybrid's blocks also hold attention KV pages: the state-only count does not apply")
    per_request = _state_bytes_per_request(hf.config)
    with caplog.at_level("INFO"):
        llm = LLM(model=path, dtype="float32", max_model_len=256, kv_cache_memory=int(4.5 * per_request))
    # One block per request in the (single) state group: 4 blocks, one of them the null block.
    assert llm.llm_engine.model_info.num_kv_blocks == 4
    assert llm.llm_engine.config.scheduler_config.max_num_seqs == 3
    assert "max_num_seqs lowered from 256 to 3" in caplog.text
    assert f"{per_request} bytes of recurrent state per request" in caplog.text
    assert f"enable_prefix_caching: {hf.config.architectures[0]} keeps a recurrent state" in caplog.text
    assert "prefix caching is turned off" in caplog.text
    engine = llm.llm_engine
    for i, p in enumerate(prompts + prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    running, done = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running.append(len(engine.core.engine_core.scheduler.running))
    assert max(running) == 3
    assert done == {f"r{i}": (ref + ref)[i] for i in range(2 * len(prompts))}


def test_fp8_cache_is_a_config_error_naming_model_and_option(tiny):
    from vllite_core.errors import ConfigError

    name, path, hf, _, _ = tiny
    with pytest.raises(ConfigError, match=rf"kv_cache_dtype.*{hf.config.architectures[0]}"):
        LLM(model=path, dtype="float32", max_model_len=256, kv_cache_dtype="fp8")


def test_ssd_chunked_scan_matches_the_recurrence():
    """The chunked Mamba-2 scan against the plain step-by-step recurrence (float64, written here), with an
    initial state and lengths that leave a partial last chunk."""
    from vllite_core.model_ops import ssd_chunked

    g = torch.Generator().manual_seed(0)
    L, H, P, N = 37, 4, 3, 5
    x, B, C = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((L, H, P), (L, H, N), (L, H, N)))
    dt = torch.rand(L, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64)
    h0 = torch.randn(H, P, N, generator=g, dtype=torch.float64)
    h, ys = h0.clone(), []
    for t in range(L):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]))
    for chunk in (1, 4, 16, 64):
        y, final = ssd_chunked(x, dt, A, B, C, chunk, h0)
        torch.testing.assert_close(y, torch.stack(ys))
        torch.testing.assert_close(final, h)


def test_decode_steps_continue_a_prefill():
    """Conv and both scans: a sequence split into a prefill and then single-token steps (the decode
    paths, two requests at once) gives the outputs and final states of one pass over the whole sequence."""
    from vllite_core.model_ops import ModelOps

    ops, g = ModelOps(), torch.Generator().manual_seed(1)
    T, D, N, K = 9, 6, 4, 4
    x = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, K, generator=g, dtype=torch.float64)
    bias = torch.randn(D, generator=g, dtype=torch.float64)
    whole = torch.zeros(2, D, K - 1, dtype=torch.float64)
    y_whole = ops.causal_conv1d(x.reshape(-1, D), w, bias, whole, [0, T, 2 * T], "silu")
    split = torch.zeros(2, D, K - 1, dtype=torch.float64)
    y_pre = ops.causal_conv1d(x[:, :5].reshape(-1, D), w, bias, split, [0, 5, 10], "silu").view(2, 5, D)
    y_steps = [ops.causal_conv1d(x[:, t], w, bias, split, [0, 1, 2], "silu") for t in range(5, T)]
    torch.testing.assert_close(torch.cat([y_pre, torch.stack(y_steps, 1)], 1), y_whole.view(2, T, D))
    torch.testing.assert_close(split, whole)

    dt, z = (torch.randn(2, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    Bm, Cm = (torch.randn(2, T, N, generator=g, dtype=torch.float64) for _ in range(2))
    A, Dv = -torch.rand(D, N, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    flat = [t.reshape(2 * T, -1) for t in (x, dt, Bm, Cm, z)]
    s_whole = torch.zeros(2, D, N, dtype=torch.float64)
    y_whole = ops.selective_scan(flat[0], flat[1], A, flat[2], flat[3], Dv, flat[4], None, s_whole, [0, T, 2 * T])
    s_split = torch.zeros(2, D, N, dtype=torch.float64)
    pre = [t[:, :5].reshape(10, -1) for t in (x, dt, Bm, Cm, z)]
    y_pre = ops.selective_scan(pre[0], pre[1], A, pre[2], pre[3], Dv, pre[4], None, s_split, [0, 5, 10])
    y_steps = [ops.selective_scan(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], Dv, z[:, t], None, s_split, [0, 1, 2])
               for t in range(5, T)]
    torch.testing.assert_close(torch.cat([y_pre.view(2, 5, D), torch.stack(y_steps, 1)], 1), y_whole.view(2, T, D))
    torch.testing.assert_close(s_split, s_whole)

    H, P = 3, 2
    xh = torch.randn(2, T, H, P, generator=g, dtype=torch.float64)
    dth = torch.randn(2, T, H, generator=g, dtype=torch.float64)
    Bh, Ch = (torch.randn(2, T, 1, N, generator=g, dtype=torch.float64) for _ in range(2))
    Ah, Dh, bh = -torch.rand(H, generator=g, dtype=torch.float64), torch.randn(H, dtype=torch.float64), \
        torch.randn(H, generator=g, dtype=torch.float64)
    lim = (0.0, float("inf"))
    h_whole = torch.zeros(2, H, P, N, dtype=torch.float64)
    y_whole = ops.ssd_scan(xh.reshape(2 * T, H, P), dth.reshape(2 * T, H), Ah, Bh.reshape(2 * T, 1, N),
                           Ch.reshape(2 * T, 1, N), Dh, bh, lim, 4, h_whole, [0, T, 2 * T])
    h_split = torch.zeros(2, H, P, N, dtype=torch.float64)
    y_pre = ops.ssd_scan(xh[:, :5].reshape(10, H, P), dth[:, :5].reshape(10, H), Ah, Bh[:, :5].reshape(10, 1, N),
                         Ch[:, :5].reshape(10, 1, N), Dh, bh, lim, 4, h_split, [0, 5, 10])
    y_steps = [ops.ssd_scan(xh[:, t], dth[:, t], Ah, Bh[:, t], Ch[:, t], Dh, bh, lim, 4, h_split, [0, 1, 2])
               for t in range(5, T)]
    # The SSD op computes in float32 (as the models do): float32 tolerances.
    torch.testing.assert_close(torch.cat([y_pre.view(2, 5, H, P), torch.stack(y_steps, 1)], 1),
                               y_whole.view(2, T, H, P), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_split, h_whole, rtol=1e-5, atol=1e-5)
