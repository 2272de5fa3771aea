"""vllite-plugin-bart (plugins/bart): BART through the out-of-tree plugin.

Greedy tokens identical to Hugging Face ``generate`` on the same tiny random checkpoint, with requests of
different lengths in one step; the encoder-decoder config rules; the plugin found through its installed
entry point, listed by ``vllite plugins --json``, and named in the error when it is blocked.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from tiny_bart import EOS, hf_seq2seq_greedy, save_tiny_bart

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError

FORCED_BOS = 1  # bart-large-cnn style generation config: the first generated token is forced to BOS


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """Untied embeddings (encoder, decoder, LM head each their own): the most varied greedy outputs."""
    path = tmp_path_factory.mktemp("tiny-bart")
    hf = save_tiny_bart(path, tie_word_embeddings=False)
    from transformers import AutoTokenizer

    return path, hf, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def bart_llm(bart):
    path, _, _ = bart
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64)


def test_bart_greedy_matches_hf(bart, bart_llm):
    _, hf, tok = bart
    n = 10
    texts = ["Hello world", "a", "The quick brown fox jumps over the lazy dog. " * 4,
             "Paris is the capital of France and", "vllite runs BART through a plugin."]
    gen = torch.Generator().manual_seed(5)
    token_prompt = torch.randint(3, 49152, (23,), generator=gen).tolist()
    prompts = texts + [{"prompt_token_ids": token_prompt},
                       {"encoder_prompt": "Translate this sentence, please.", "decoder_prompt": "Sure, here"}]
    ref = [hf_seq2seq_greedy(hf, n, input_ids=torch.tensor([tok.encode(t)])) for t in texts]
    ref.append(hf_seq2seq_greedy(hf, n, input_ids=torch.tensor([token_prompt])))
    dec = [EOS] + tok.encode("Sure, here", add_special_tokens=False)
    ref.append(hf_seq2seq_greedy(hf, n, input_ids=torch.tensor([tok.encode("Translate this sentence, please.")]),
                                 decoder_input_ids=torch.tensor([dec]))[len(dec) - 1:])
    # All requests are admitted, encoded and decoded together in the same steps.
    outs = bart_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.prompt_token_ids for o in outs] == [[EOS]] * (len(prompts) - 1) + [dec]
    assert len({tuple(r) for r in ref}) == len(ref)  # the outputs depend on the encoder input
    assert outs[0].prompt == "Hello world"


def test_bart_preempted_requests_are_reencoded(bart):
    """Too few KV blocks for every request's decoder: preempted requests give back their blocks, are encoded
    again when readmitted, and still produce the same tokens."""
    path, hf, tok = bart
    texts = ["one two three", "The quick brown fox jumps over the lazy dog.", "x y", "Hello there, general",
             "A somewhat longer prompt, to give the encoder more positions to attend over."]
    n = 20  # 21 decoder positions: two blocks of 16 each, and only 7 blocks for five requests' decoders
    # (besides one cross-attention block per request: their encoder prompts are shorter than a block)
    ref = [hf_seq2seq_greedy(hf, n, input_ids=torch.tensor([tok.encode(t)])) for t in texts]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=8 + len(texts))
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_tied_bart_with_forced_bos_matches_hf(tmp_path):
    """The usual BART checkpoint: LM head and token embeddings tied, and a generation config forcing BOS
    first (vllite puts it in the decoder prompt; transformers generates it)."""
    hf = save_tiny_bart(tmp_path, seed=1, std=0.2, generation={"forced_bos_token_id": FORCED_BOS})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a b c d e f g"]
    n = 8
    ref = [hf_seq2seq_greedy(hf, n + 1, input_ids=torch.tensor([tok.encode(t)])) for t in texts]
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=32)
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert all(o.prompt_token_ids == [EOS, FORCED_BOS] for o in outs) and all(r[0] == FORCED_BOS for r in ref)
    assert [o.outputs[0].token_ids for o in outs] == [r[1:] for r in ref]


def test_bart_prompt_errors(bart, bart_llm):
    with pytest.raises(InvalidRequestError, match="160 positions"):
        bart_llm.generate({"prompt_token_ids": [5] * 161}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="empty"):
        bart_llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="encoder_prompt"):
        bart_llm.generate({"decoder_prompt": "x"}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="out of range"):
        bart_llm.generate({"prompt_token_ids": [49152]}, SamplingParams(max_tokens=2))


def test_default_decoder_prompt_follows_generation_config(tmp_path, bart):
    """Without a forced BOS the decoder starts from decoder_start_token_id alone."""
    from transformers import BartConfig
    from vllite_plugin_bart.bart import BartForConditionalGeneration

    from vllite_core.inputs import InputContext

    path, hf, tok = bart
    config = BartConfig(**{**hf.config.to_dict(), "decoder_start_token_id": 7})
    ctx = InputContext(tok, config, str(tmp_path))  # no generation_config.json: derived from the config
    out = BartForConditionalGeneration.process_prompt("Hello world", ctx)
    assert out.prompt_token_ids == [7] and out.encoder_inputs == tok.encode("Hello world")
    assert out.num_encoder_tokens == len(out.encoder_inputs)
    assert BartForConditionalGeneration.process_prompt(
        {"encoder_prompt": {"prompt_token_ids": [5, 6]}, "decoder_prompt": [7, 9]}, ctx).prompt_token_ids == [7, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"decoder_start_token_id": 2,
                                                                 "forced_bos_token_id": FORCED_BOS}))
    ctx = InputContext(tok, BartConfig(**config.to_dict()), str(tmp_path))  # generation_config.json wins
    assert BartForConditionalGeneration.process_prompt("x", ctx).prompt_token_ids == [EOS, FORCED_BOS]


def test_config_turns_off_chunked_prefill_and_prefix_caching(bart, caplog):
    path, _, _ = bart
    with caplog.at_level(logging.WARNING, logger="vllite.config"):
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, enable_chunked_prefill=True,
                  enable_prefix_caching=True)
    config = llm.llm_engine.config
    assert config.model_config.capabilities.is_encoder_decoder
    assert not config.scheduler_config.enable_chunked_prefill and not config.cache_config.enable_prefix_caching
    assert any(r.name == "vllite.config" and "chunked prefill and prefix caching are turned off" in r.getMessage()
               for r in caplog.records)


def test_registered_only_through_the_installed_entry_point():
    from model_registry.builtin import BUILTIN_MODELS
    from model_registry.registry import build_registry
    from vllite_core.plugins.manager import get_plugin_manager

    eps = {ep.name: ep for ep in entry_points(group="vllite.plugins")}
    assert eps["bart"].value == "vllite_plugin_bart" and eps["bart"].dist.name == "vllite-plugin-bart"
    assert "BartForConditionalGeneration" not in BUILTIN_MODELS
    entry = build_registry(get_plugin_manager()).entry("BartForConditionalGeneration")
    assert entry.plugin == "vllite-plugin-bart"
    assert entry.target == "vllite_plugin_bart.bart:BartForConditionalGeneration"


def test_vllite_plugins_lists_the_plugin(capsys):
    from vllite_core.entrypoints.cli import main

    assert main(["plugins", "--json"]) == 0
    info = next(p for p in json.loads(capsys.readouterr().out)["plugins"]
                if p["distribution"] == "vllite-plugin-bart")
    assert info["name"] == "bart" and info["group"] == "vllite.plugins" and info["status"] == "loaded"
    assert info["hooks"] == ["vllite_register_models"] and info["version"] == "0.1.0"


# In a fresh process with the plugin denied: `vllite plugins --json`, then loading a BART checkpoint.
BLOCKED = """
import sys
from model_registry.registry import UnknownArchitectureError
from vllite_core import LLM
from vllite_core.entrypoints.cli import main
main(["plugins", "--json"])
try:
    LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=16)
except UnknownArchitectureError as e:
    print("ERROR", e)
"""


def test_blocked_plugin_error_names_the_package(bart):
    path, _, _ = bart
    env = {k: v for k, v in os.environ.items() if k not in ("VLLITE_PLATFORM", "VLLITE_PLUGINS")}
    proc = subprocess.run([sys.executable, "-c", BLOCKED, str(path)], capture_output=True, text=True, timeout=180,
                          env={**env, "VLLITE_LOG_LEVEL": "WARNING", "VLLITE_PLUGINS": "-bart"})
    assert proc.returncode == 0, proc.stderr
    listing, _, error = proc.stdout.partition("\nERROR ")
    info = next(p for p in json.loads(listing)["plugins"] if p["distribution"] == "vllite-plugin-bart")
    assert info["status"] == "blocked" and "VLLITE_PLUGINS" in info["reason"]
    assert "BartForConditionalGeneration" in error and "pip install vllite-plugin-bart" in error


def test_a_pool_too_small_for_one_requests_cross_blocks_is_refused(bart):
    """The cross-attention blocks come out of the one pool: an override that cannot hold one request's
    (160 encoder positions: 10 blocks, plus a decoder block and the null block) fails at start, not by waiting."""
    from vllite_core.errors import ConfigError

    path, _, _ = bart
    with pytest.raises(ConfigError, match="num_kv_blocks: 11 blocks cannot hold one request.*need 12"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=11)
