"""Pipeline parallelism (``pipeline_parallel_size``) on tiny random checkpoints, against Hugging Face transformers.

The tiny Llama has 3 layers over 2 stages (vLLM's uneven split: 2 + 1) and a tied LM head, so the last stage
holds its own copy of the embedding table as its head; the tiny Qwen3 (a dense family: q/k norms) has an
untied head. Chunked prefill (a 16-token budget under 40-token prompts) and prefix caching (the same
prompts again, served from cached blocks) are on. TP=2 x PP=2 runs 4 worker processes (marked slow).
With 2 stages the engine keeps 2 batches in flight (the batch queue): the 16-token budget splits the
prompts over batches, and the shortest request stops after 3 tokens while the others' batch is in flight.
"""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import TINY, save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.config import ConfigError, EngineArgs
from vllite_core.distributed.pipeline import stage_layer_counts, stage_layers

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)  # the 3-token prompt finishes early
PARAMS = [SHORT, GREEDY, GREEDY, GREEDY]
LLAMA = dict(TINY, num_hidden_layers=3, tie_word_embeddings=True)
QWEN3 = dict(TINY, num_hidden_layers=2, head_dim=16)
BLOCK_BYTES_PER_LAYER = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, float32
KV_MEMORY = 96 * BLOCK_BYTES_PER_LAYER  # 32 blocks of all 3 layers on one rank, 48 of 2 layers, 96 of 1


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, vocab, (24,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 40)] + [
        shared + torch.randint(0, vocab, (9,), generator=gen).tolist() for _ in range(2)]  # a common prefix


def _model(tmp_path_factory, name, config_cls, fields, arch):
    path = tmp_path_factory.mktemp(name)
    hf = save_tiny(path, config_cls(**fields, architectures=[arch]))
    prompts = _prompts(fields["vocab_size"])
    return str(path), prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig

    return _model(tmp_path_factory, "tiny-llama-3-layers", LlamaConfig, LLAMA, "LlamaForCausalLM")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import Qwen3Config

    return _model(tmp_path_factory, "tiny-qwen3", Qwen3Config, QWEN3, "Qwen3ForCausalLM")


def _run(model, **kwargs):
    """Greedy tokens of the prompts twice (the second time from the prefix cache), the engine's executor, and
    the most batches it had in flight at once."""
    path, prompts, _ = model
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True, **kwargs)
    try:
        runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS) for _ in range(2)]
        core = llm.llm_engine.core.engine_core
        assert core.batch_queue_size == kwargs.get("pipeline_parallel_size", 1)
        return runs, core.executor.layout, core.executor.procs, core.max_batches_in_flight
    finally:
        llm.llm_engine.core.shutdown()


def _check(model, runs):
    expected = [tokens[:p.max_tokens] for tokens, p in zip(model[2], PARAMS)]
    for outs in runs:
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 16 for o in runs[1][1:])  # the second run's long prompts hit the cache


def test_llama_two_stages_match_hf(llama):
    runs, layout, procs, in_flight = _run(llama, pipeline_parallel_size=2, kv_cache_memory=KV_MEMORY)
    _check(llama, runs)
    assert in_flight == 2  # the second stage ran one batch while the first ran the next
    assert layout["ranks"] == 2 and layout["pipeline_parallel_size"] == 2 and len({p.pid for p in procs}) == 2
    # Each stage sizes the cache of its own layers: stage 0 holds 2 layers, stage 1 one, in the same memory.
    one_rank = KV_MEMORY // (3 * BLOCK_BYTES_PER_LAYER)
    assert layout["kv_blocks_per_stage"] == [KV_MEMORY // (2 * BLOCK_BYTES_PER_LAYER),
                                             KV_MEMORY // BLOCK_BYTES_PER_LAYER]
    assert layout["kv_blocks_per_stage"][0] > one_rank


def test_qwen3_two_stages_match_hf(qwen3):
    runs, _, _, _ = _run(qwen3, pipeline_parallel_size=2, num_kv_blocks=64)
    _check(qwen3, runs)


@pytest.fixture
def four_devices(monkeypatch):
    """Four ranks on this (2-core) host: the CPU platform counts one device per core."""
    from vllite_core.platforms.resolve import current_platform

    monkeypatch.setattr(type(current_platform()), "device_count", lambda self: 4)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_two_by_two_ranks_match_hf(which, request, four_devices):
    model = request.getfixturevalue(which)
    runs, layout, procs, _ = _run(model, tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=64)
    _check(model, runs)
    assert layout["ranks"] == 4 and len({p.pid for p in procs}) == 4


# ---- the split and bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("layers,pp,counts", [(32, 4, [8, 8, 8, 8]), (22, 4, [5, 6, 6, 5]), (61, 2, [31, 30]),
                                              (61, 4, [15, 15, 16, 15]), (3, 2, [2, 1]), (7, 3, [2, 3, 2])])
def test_layers_split_as_vllm_does(layers, pp, counts):
    """vLLM's split: the remainder one layer each to the stages before the last, backwards."""
    assert stage_layer_counts(layers, pp) == counts
    assert [stage_layers(layers, s, pp) for s in range(pp)] == [
        (sum(counts[:s]), sum(counts[:s + 1])) for s in range(pp)]


def test_fewer_layers_than_stages_is_refused(llama):
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 4 stages for a model of 3 layer"):
        LLM(llama[0], dtype="float32", pipeline_parallel_size=4)


def test_a_model_class_without_stages_is_refused():
    from tiny_pooling import minilm_path  # BERT: not built from the dense decoder layers

    with pytest.raises(ConfigError, match="pipeline_parallel_size: BertModel .*does not support pipeline"):
        LLM(minilm_path(), pipeline_parallel_size=2)


def test_pipeline_with_speculative_decoding_is_refused(llama):
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 2 stages do not run with speculative decoding"):
        LLM(llama[0], dtype="float32", pipeline_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("kwargs,field", [
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, "distributed_executor_backend"),
])
def test_bad_pipeline_arguments(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineArgs(**kwargs).create_config()


def test_world_is_tensor_times_pipeline_ranks():
    pc = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=3).create_config().parallel_config
    assert pc.world_size == 6 and pc.distributed_executor_backend == "mp"


def test_cli_short_flags():
    import argparse

    from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["-tp", "2", "-pp", "3"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)


def test_env_shows_the_stages_and_refuses_too_many(llama, capsys):
    from vllite_core.entrypoints.cli import main

    assert main(["env", "--device", "cpu", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                 "--model", llama[0]]) == 0
    out = capsys.readouterr().out
    assert "4 rank(s) (tensor_parallel_size 2 x pipeline_parallel_size 2), mp executor" in out
    assert "stage 0: ranks 0-1: layers 0-1 (2), the embedding" in out
    assert "stage 1: ranks 2-3: layers 2-2 (1), the final norm and the LM head (samples)" in out
    assert main(["env", "--device", "cpu", "-pp", "4", "--model", llama[0]]) == 1
    assert "pipeline_parallel_size: 4 stages for a model of 3 layer(s)" in capsys.readouterr().err
