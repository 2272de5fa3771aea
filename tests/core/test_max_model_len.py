"""max_model_len: vLLM's forms (-1 / "auto", "8k" / "8K"), a config that names no context length (a Mamba2)
served at vLLM's default with a warning, and "auto" lowering the length to what the KV cache holds.
References: the arithmetic of the forms; HF transformers' greedy tokens on the same tiny weights."""
from __future__ import annotations

import pytest
import torch

from vllite_core import LLM, SamplingParams
from vllite_core.config import DEFAULT_MAX_MODEL_LEN, ConfigError, parse_max_model_len


@pytest.mark.parametrize("text,want", [("auto", -1), ("AUTO", -1), ("-1", -1), (-1, -1), ("4096", 4096),
                                       ("8k", 8000), ("8K", 8192), ("25.6k", 25600), ("1M", 1 << 20), (None, None)])
def test_forms(text, want):
    assert parse_max_model_len(text) == want


@pytest.mark.parametrize("bad", ["lots", "", "8x"])
def test_bad_forms_name_the_field(bad):
    with pytest.raises(ConfigError, match="max_model_len"):
        parse_max_model_len(bad)


def test_cli_passes_auto_through():
    from vllite_core.entrypoints.cli import build_parser
    from vllite_core.entrypoints.engine_args_cli import engine_args_from_namespace

    for flag, want in (("auto", "auto"), ("-1", "-1"), ("2k", "2k")):
        ns = build_parser().parse_args(["serve", "--max-model-len", flag])
        assert engine_args_from_namespace(ns).max_model_len == want


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    import transformers as tf
    from tiny_models import save_tiny

    cfg = tf.Mamba2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=16, conv_kernel=4, expand=2,
                          num_heads=8, head_dim=16, n_groups=1, chunk_size=16, architectures=["Mamba2ForCausalLM"])
    assert not any(hasattr(cfg, k) for k in ("max_position_embeddings", "n_positions", "max_seq_len"))
    path = tmp_path_factory.mktemp("mamba2-nolen")
    return str(path), save_tiny(path, cfg)


def test_config_without_length_gets_the_default_and_a_warning(mamba2, caplog):
    path, hf = mamba2
    with caplog.at_level("WARNING"):
        llm = LLM(model=path, dtype="float32", num_kv_blocks=8)
    assert llm.llm_engine.max_model_len == DEFAULT_MAX_MODEL_LEN
    assert "names no context length" in caplog.text and str(DEFAULT_MAX_MODEL_LEN) in caplog.text
    ids = [5, 17, 99, 3]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == _hf_greedy(hf, ids, 6)


@pytest.fixture(scope="module")
def llama(tiny_path):
    from transformers import AutoModelForCausalLM

    return tiny_path, AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


def test_auto_fits_the_kv_cache(llama, caplog):
    path, hf = llama  # max_position_embeddings 256 = 16 blocks of 16
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # K and V x layers x kv heads x block x head_dim x float32
    budget = 9 * per_block  # 9 blocks: 8 for a request, one the null block
    with pytest.raises(ConfigError, match="lower max_model_len"):
        LLM(model=path, dtype="float32", kv_cache_memory=budget)
    with caplog.at_level("WARNING"):
        llm = LLM(model=path, dtype="float32", max_model_len="auto", kv_cache_memory=budget)
    assert llm.llm_engine.core.engine_core.model_info.num_kv_blocks == 9
    assert llm.llm_engine.max_model_len == 8 * 16 and "max_model_len auto" in caplog.text
    ids = list(range(10, 40))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == _hf_greedy(hf, ids, 8)
    full = LLM(model=path, dtype="float32", max_model_len=-1, num_kv_blocks=64)  # fits: the model's own length
    assert full.llm_engine.max_model_len == 256
