"""Tiny random Llama / Qwen2 / Mistral checkpoints (safetensors) through vllite, against transformers."""
from __future__ import annotations

import os

import pytest
import torch
from paged_harness import PagedHarness, assert_matches_hf, run_standard_schedule
from vllite_platform_cpu.attention import TorchPagedAttention

from model_registry.loader import hf_weight_files, load_model
from model_registry.models.llama import LlamaForCausalLM
from model_registry.source import load_hf_config, resolve_model_source

torch.set_num_threads(2)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def _save_random(tmp_path, config, seed=0, **save_kwargs):
    """A random-weight HF model saved as safetensors; weights scaled up so greedy choices are not near-ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path, **save_kwargs)
    return model.eval()


def _check(tmp_path, config, **save_kwargs):
    hf = _save_random(tmp_path, config, **save_kwargs)
    source = resolve_model_source(str(tmp_path))
    assert source.kind == "hf"
    hf_config = load_hf_config(source)
    backend = TorchPagedAttention()
    model = load_model(source, hf_config, LlamaForCausalLM, backend, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    prompts = {rid: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
               for rid, n in (("a", 9), ("b", 14), ("c", 6))}
    harness = PagedHarness(model, backend, num_blocks=48, block_size=4)
    run_standard_schedule(harness, prompts, decode_steps=4)
    assert_matches_hf(harness, hf, atol=1e-4)
    return model


def test_qwen2_gqa_bias(tmp_path):
    from transformers import Qwen2Config

    model = _check(tmp_path, Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False))
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    assert model.num_kv_heads == 2 and model.head_size == 16


def test_qwen2_sliding_window_layers(tmp_path):
    from transformers import Qwen2Config

    config = Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=5,
                         max_window_layers=1)
    model = _check(tmp_path, config)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 5]
    # Two cache groups: the full layer keeps everything, the sliding one only its window.
    kinds = [spec.kind for spec in model.get_kv_cache_specs(4, torch.float32)]
    assert kinds == ["full_attention", "sliding_window"]


def test_mistral_sliding_window(tmp_path):
    from transformers import MistralConfig

    model = _check(tmp_path, MistralConfig(**TINY, architectures=["MistralForCausalLM"], sliding_window=6))
    specs = model.get_kv_cache_specs(4, torch.float32)
    assert {(s.kind, s.sliding_window) for s in specs} == {("sliding_window", 6)}


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
], ids=lambda r: r["rope_type"])
def test_llama_rope_variants(tmp_path, rope):
    from transformers import LlamaConfig

    _check(tmp_path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], rope_parameters=rope,
                                 tie_word_embeddings=True))


def test_llama_bias_and_explicit_head_dim(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(**{**TINY, "num_key_value_heads": 1}, head_dim=24, attention_bias=True, mlp_bias=True,
                         architectures=["LlamaForCausalLM"])
    model = _check(tmp_path, config)
    assert model.head_size == 24 and model.model.layers[0].self_attn.o_proj.bias is not None


def test_sharded_safetensors(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    _check(tmp_path, config, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(hf_weight_files(str(tmp_path))) > 1


def test_missing_weight_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    _save_random(tmp_path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    path = os.path.join(tmp_path, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    source = resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match="gate_up_proj"):
        load_model(source, load_hf_config(source), LlamaForCausalLM, TorchPagedAttention(), torch.float32,
                   torch.device("cpu"))


def test_bf16_model_runs(tmp_path):
    from transformers import LlamaConfig

    _save_random(tmp_path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    source = resolve_model_source(str(tmp_path))
    backend = TorchPagedAttention()
    model = load_model(source, load_hf_config(source), LlamaForCausalLM, backend, torch.bfloat16,
                       torch.device("cpu"))
    harness = PagedHarness(model, backend, num_blocks=16, block_size=4)
    harness.add("a", [1, 2, 3, 4, 5])
    logits = harness.step({"a": 5})["a"]
    # Logits come in the model dtype, as vLLM's do; the sampler widens them where it computes with them.
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_cpu_platform_one_call_layers_match_hf(tmp_path, monkeypatch):
    """The CPU platform's ops (C++ kernels, the layers one C++ call: ModelOps.decoder_stack / decoder_layer) against
    transformers, on a Qwen2 checkpoint (qkv bias, GQA), prefill chunks and decode steps mixed."""
    from transformers import Qwen2Config
    from vllite_platform_cpu import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels not built here: {kernels.error()}")
    from vllite_platform_cpu.decoder_layer import NativeDecoderLayer, NativeDecoderStack
    from vllite_platform_cpu.model_ops import CpuModelOps
    from vllite_platform_cpu.platform import has_fast_bf16, use_avx2_gemm, use_bf16_gemm

    from vllite_core.model_ops import use_model_ops

    taken = []

    def counting(call):
        def counted(self, *args):
            out = call(self, *args)
            taken.append(out is not None)
            return out
        return counted

    # All layers in one call where the step allows (NativeDecoderStack), else one C++ call per layer.
    monkeypatch.setattr(NativeDecoderLayer, "__call__", counting(NativeDecoderLayer.__call__))
    monkeypatch.setattr(NativeDecoderStack, "__call__", counting(NativeDecoderStack.__call__))
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=not has_fast_bf16(), avx2_gemm=use_avx2_gemm(),
                       bf16_gemm=use_bf16_gemm())
    with use_model_ops(ops):
        _check(tmp_path, Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False))
    assert any(taken) and (all(taken) or not ops.avx2_gemm)  # on the AVX2 GEMM every layer call is one C++ call
