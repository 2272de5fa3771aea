"""SmolLM2-135M-Instruct (GGUF, Q4_1/Q8_0) through vllite's loader and Llama model, against transformers."""
from __future__ import annotations

import time

import pytest
import torch
from paged_harness import PagedHarness, assert_matches_hf, run_standard_schedule
from vllite_platform_cpu.attention import TorchPagedAttention

from model_registry.gguf_weights import iter_gguf_weights
from model_registry.loader import load_model
from model_registry.models.llama import LlamaForCausalLM
from model_registry.source import load_hf_config, load_tokenizer, open_gguf, resolve_model_source

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def source():
    return resolve_model_source(None)


@pytest.fixture(scope="module")
def hf_config(source):
    return load_hf_config(source)


@pytest.fixture(scope="module")
def model(source, hf_config):
    return load_model(source, hf_config, LlamaForCausalLM, TorchPagedAttention(), torch.float32, torch.device("cpu"))


def test_default_source_is_the_embedded_gguf(source):
    assert source.kind == "gguf"
    assert source.gguf_file.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_config_from_gguf_metadata(hf_config, smollm2_hf):
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert (hf_config.bos_token_id, hf_config.eos_token_id) == (1, 2)
    assert hf_config.tie_word_embeddings is True
    ref = smollm2_hf.config  # built by transformers' own GGUF reader
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(hf_config, key) == getattr(ref, key), key


def test_gguf_weights_equal_transformers(source, hf_config, smollm2_hf):
    """Dequantised, renamed and un-permuted tensors are bit-identical to transformers' GGUF loading."""
    ref = dict(smollm2_hf.state_dict())
    ours = dict(iter_gguf_weights(open_gguf(source), hf_config.num_attention_heads,
                                  hf_config.num_key_value_heads))
    ours.setdefault("lm_head.weight", ours["model.embed_tokens.weight"])  # tied
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name


def test_loaded_model_holds_the_same_weights(model, smollm2_hf):
    ref = smollm2_hf.state_dict()
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([ref[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        gate_up = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (30, 3, 64)
    assert {s.kind for s in model.get_kv_cache_specs(16, torch.float32)} == {"full_attention"}


def test_logits_match_transformers(model, smollm2_hf, source):
    tok = load_tokenizer(source)
    prompts = {
        "a": tok("The capital of France is").input_ids,
        "b": tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                     add_generation_prompt=True, tokenize=False),
        "c": tok("def fibonacci(n):").input_ids,
    }
    prompts["b"] = tok(prompts["b"]).input_ids
    harness = PagedHarness(model, model.model.layers[0].self_attn.attn.backend, num_blocks=128, block_size=16)
    run_standard_schedule(harness, prompts, decode_steps=3)
    assert_matches_hf(harness, smollm2_hf, atol=2e-4)


def test_tokenizer_from_gguf(source):
    t0 = time.perf_counter()
    tok = load_tokenizer(source)  # converted once, then served from ~/.cache/vllite
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = load_tokenizer(source)
    again = time.perf_counter() - t0
    assert again < 2.0, f"cached tokenizer load took {again:.1f}s (first: {first:.1f}s)"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = "Hello, world! 123 héllo"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_cached_tokenizer_equals_fresh_conversion(source, tmp_path, monkeypatch):
    """The tokenizer saved to the cache behaves exactly like transformers' direct GGUF conversion (~7 s)."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLITE_CACHE_DIR", str(tmp_path))
    converted = load_tokenizer(source)  # converts and saves
    cached = load_tokenizer(source)  # loads the saved copy
    fresh = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_name)
    assert any(tmp_path.glob("tokenizers/*/tokenizer.json"))
    texts = ["Hello world", " leading  spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>", "日本語 🤖 ünïcödé", ""]
    for tok in (converted, cached):
        for text in texts:
            assert tok(text).input_ids == fresh(text).input_ids, text
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
            (fresh.bos_token_id, fresh.eos_token_id, fresh.pad_token_id)
        assert tok.chat_template == fresh.chat_template
