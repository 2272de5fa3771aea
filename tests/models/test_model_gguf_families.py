"""GGUF files of the qwen3, gemma2, gemma3, phi3, qwen2moe and qwen3moe architectures and Mixtral's (a "llama"
with experts), written with the ``gguf`` package's own writer from a tiny random model the way llama.cpp's converter
lays them out (its tensor names, Gemma's norms stored as 1 + w, Phi-3's stacked q/k/v and gate/up, its LongRoPE
factors as tensors, the experts stacked per layer, Llama's q/k rows in its rotary order), against the safetensors
run of the same weights and against transformers; and the bad input a GGUF can bring."""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from paged_harness import PagedHarness, assert_matches_hf, run_standard_schedule
from vllite_platform_cpu.attention import TorchPagedAttention

from model_registry.builtin import BUILTIN_MODELS
from model_registry.loader import load_model
from model_registry.source import load_hf_config, resolve_model_source
from vllite_core.errors import ConfigError

torch.set_num_threads(2)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
_LLAMA = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA = {**_LLAMA, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3 = {**_LLAMA, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Mixtures of experts: the router; transformers' stacked experts (gate_up_proj: the gate rows, then up) become
# llama.cpp's three stacks, [experts, rows, columns].
_MOE = {**_LLAMA, "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp"}
NAMES = {"qwen3": _LLAMA, "gemma2": _GEMMA, "gemma3": _GEMMA, "phi3": _PHI3, "mixtral": _MOE, "qwen2moe": _MOE,
         "qwen3moe": _MOE}
GGUF_ARCH = {"mixtral": "llama"}  # llama.cpp files Mixtral as a Llama with experts


def _config(arch):
    import transformers as t

    if arch == "qwen3":
        return t.Qwen3Config(**TINY, head_dim=16)
    if arch == "mixtral":
        return t.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2moe":  # a shared expert with its sigmoid gate, q/k/v biases, the top-k weights as routed
        return t.Qwen2MoeConfig(**TINY, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                                num_experts_per_tok=2)
    if arch == "qwen3moe":
        return t.Qwen3MoeConfig(**TINY, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True)
    if arch == "gemma2":
        return t.Gemma2Config(**TINY, head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                              attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
    if arch == "gemma3":  # llama.cpp's layer pattern: every sixth layer global; global rope scaled
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
        return t.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}, head_dim=16, sliding_window=5,
                                  query_pre_attn_scalar=16, rope_parameters=rope)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(6)],
            "long_factor": [2.0 + i for i in range(6)], "original_max_position_embeddings": 40,
            "partial_rotary_factor": 0.75}
    return t.Phi3Config(**TINY, pad_token_id=0, sliding_window=7, rope_parameters=rope,
                        original_max_position_embeddings=40, partial_rotary_factor=0.75)


def _random(config, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return model.eval()


def _write(path, arch, hf, extra_tensor=None, qtype=None):
    """The model as llama.cpp's converter writes it (metadata keys, tensor names, layouts; a "llama" file's q and k
    rows in its rotary order)."""
    c = hf.config
    model_arch, arch = arch, GGUF_ARCH.get(arch, arch)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny " + arch)
    for key, value in (("context_length", c.max_position_embeddings), ("embedding_length", c.hidden_size),
                       ("feed_forward_length", c.intermediate_size), ("block_count", c.num_hidden_layers),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c.shared_expert_intermediate_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if arch != "phi3":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if getattr(c, "sliding_window", None):
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", c.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    if arch == "gemma3":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if arch == "phi3":
        head = c.hidden_size // c.num_attention_heads
        w.add_uint32(f"{arch}.rope.dimension_count", int(head * 0.75))
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    tied = getattr(c, "tie_word_embeddings", False)
    for name, t in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = t.numpy().astype(np.float32)
        stacked = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if stacked:
            parts = (("ffn_gate_exps", data[:, :data.shape[1] // 2]), ("ffn_up_exps", data[:, data.shape[1] // 2:])) \
                if stacked.group(2) == "gate_up_proj" else (("ffn_down_exps", data),)
            for part, x in parts:
                _add(w, f"blk.{stacked.group(1)}.{part}.weight", np.ascontiguousarray(x), qtype)
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m:
            gname = f"blk.{m.group(1)}.{NAMES[model_arch][m.group(2)]}.{m.group(3)}"
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(gname.split(".")[2])
            if arch == "llama" and heads:  # llama.cpp's converter's row order for its rotary kernel
                data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(data.shape)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            data = data + np.float32(1.0)
        _add(w, gname, data, qtype if re.search(r"\.(attn_[qkvo]\w*|ffn_\w+_shexp)\.weight$", gname) else None)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros((4, 64), dtype=np.float32), raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w, name, data, qtype):
    """A tensor in float32, or quantized by the gguf package to ``qtype``."""
    if qtype is None:
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType.F32)
    else:
        gtype = getattr(GGMLQuantizationType, qtype)
        w.add_tensor(name, quantize(np.ascontiguousarray(data, dtype=np.float32), gtype), raw_dtype=gtype)


def _load(folder):
    source = resolve_model_source(str(folder))
    config = load_hf_config(source)
    module, name = BUILTIN_MODELS[config.architectures[0]].split(":")
    backend = TorchPagedAttention()
    model = load_model(source, config, getattr(importlib.import_module(module), name), backend, torch.float32,
                       torch.device("cpu"))
    return config, model, backend


def _run(model, backend, prompts):
    harness = PagedHarness(model, backend, num_blocks=48, block_size=4)
    run_standard_schedule(harness, prompts, decode_steps=3)
    return harness


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_gguf_equals_the_safetensors_run(tmp_path, arch):
    hf = _random(_config(arch), seed=len(arch) + 3)
    hf.save_pretrained(tmp_path / "st")
    (tmp_path / "gguf").mkdir()
    _write(tmp_path / "gguf" / "tiny.gguf", arch, hf)
    config, model, backend = _load(tmp_path / "gguf")
    assert config.architectures == hf.config.architectures
    _, st_model, st_backend = _load(tmp_path / "st")
    gen = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(0, 256, (n,), generator=gen).tolist() for r, n in (("a", 9), ("b", 14), ("c", 6))}
    ours, theirs = _run(model, backend, prompts), _run(st_model, st_backend, prompts)
    for rid in prompts:
        assert ours.tokens(rid) == theirs.tokens(rid)
        torch.testing.assert_close(ours.logits(rid), theirs.logits(rid), atol=1e-5, rtol=1e-5)
    assert_matches_hf(ours, hf, atol=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe", "qwen3moe"])
def test_moe_gguf_against_transformers(tmp_path, tiny_path, arch):
    """A mixture of experts from GGUF (each layer's experts stacked, Mixtral filed as a "llama" with an expert count
    and its q/k rows permuted) on the engine: the config read from the file's keys, greedy tokens identical to
    transformers' on the same weights in float32, each token's logprob within 1e-4 of HF's log-softmax."""
    from hf_reference import hf_greedy

    from vllite_core import LLM, SamplingParams

    hf = _random(_config(arch), seed=len(arch))
    _write(tmp_path / "tiny.gguf", arch, hf)
    config = load_hf_config(resolve_model_source(str(tmp_path / "tiny.gguf")))
    assert config.architectures == [type(hf).__name__] and config.num_experts_per_tok == 2
    llm = LLM(model=str(tmp_path / "tiny.gguf"), tokenizer=tiny_path, dtype="float32", num_threads=1,
              max_model_len=64, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 13)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp)):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, 6)
        with torch.no_grad():
            ref = torch.log_softmax(hf(input_ids=torch.tensor([prompt + tokens])).logits[0].double(), dim=-1)
        for i, t in enumerate(tokens):
            assert abs(out.outputs[0].logprobs[i][t].logprob - ref[len(prompt) - 1 + i, t].item()) < 1e-4


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_moe_gguf_experts_from_blocks(tmp_path, tiny_path, arch, monkeypatch):
    """quantization="gguf" on a mixture of experts whose experts and attention are Q8_0: every expert computed from
    its blocks (none dequantised at load: ``GGUFFile.dequantize`` counted), each expert's weights the dequantised
    load's bit for bit, the stacked float weights dropped; through the dequantised float32 panels
    (GGUF_GEMM_MIN_ROWS = 1) the greedy tokens and logprobs of the same file dequantised at load."""
    from model_registry.gguf_file import GGUFFile
    from model_registry.layers.moe import FusedMoE
    from vllite_core import LLM, SamplingParams

    kernels = pytest.importorskip("vllite_platform_cpu.kernels")
    hf = _random(_config(arch), seed=len(arch) + 1)
    _write(tmp_path / "tiny.gguf", arch, hf, qtype="Q8_0")
    args = dict(model=str(tmp_path / "tiny.gguf"), tokenizer=tiny_path, dtype="float32", num_threads=1,
                max_model_len=64, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=gen).tolist()} for n in (4, 11)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    dense = LLM(**args)
    base = dense.generate(prompts, sp)
    dense_moes = [m for m in dense.llm_engine.core.engine_core.worker.runner.model.modules() if isinstance(m, FusedMoE)]
    want = [(m.w13_weight.detach().clone(), m.w2_weight.detach().clone()) for m in dense_moes]
    del dense, dense_moes
    read: list[str] = []
    real = GGUFFile.dequantize
    monkeypatch.setattr(GGUFFile, "dequantize", lambda self, name: read.append(name) or real(self, name))
    monkeypatch.setattr(kernels, "GGUF_GEMM_MIN_ROWS", 1)
    llm = LLM(**args, quantization="gguf")
    assert not [n for n in read if re.search(r"\.(ffn_(gate|up|down)_(exps|shexp)|attn_(q|k|v|output))\.weight", n)]
    moes = [m for m in llm.llm_engine.core.engine_core.worker.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all(m.gguf is not None and m.w13_weight.numel() == 0 for m in moes)
    for m, (w13, w2) in zip(moes, want):
        for e, (gate_up, down) in enumerate(m.gguf):
            assert torch.equal(torch.cat([w.dequantize() for w in gate_up]), w13[e])
            assert torch.equal(down.dequantize(), w2[e])
    for a, b in zip(base, llm.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ref, got, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(ref[t].logprob - got[t].logprob) < 1e-4


def test_unknown_gguf_tensor_is_a_config_error(tmp_path):
    hf = _random(_config("qwen3"), seed=1)
    _write(tmp_path / "tiny.gguf", "qwen3", hf, extra_tensor="blk.0.attn_sinks.weight")
    with pytest.raises(ConfigError, match="blk.0.attn_sinks.weight"):
        _load(tmp_path)


def test_missing_gguf_metadata_is_a_config_error(tmp_path):
    """A Gemma 2 GGUF without its window: the field is named at load, not guessed."""
    hf = _random(_config("gemma2"), seed=1)
    hf.config.sliding_window = None
    _write(tmp_path / "tiny.gguf", "gemma2", hf)
    with pytest.raises(ConfigError, match="gemma2.attention.sliding_window"):
        load_hf_config(resolve_model_source(str(tmp_path)))
