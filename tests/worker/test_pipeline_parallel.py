"""Pipeline parallelism (``pipeline_parallel_size``) on tiny random checkpoints, against Hugging Face transformers.

The tiny Llama has 3 layers over 2 stages (vLLM's uneven split: 2 + 1) and a tied LM head, so the last stage
holds its own copy of the embedding table as its head; the tiny Qwen3 (a dense family: q/k norms) has an
untied head. Chunked prefill (a 16-token budget under 40-token prompts) and prefix caching (the same
prompts again, served from cached blocks) are on. TP=2 x PP=2 runs 4 worker processes (marked slow).
With 2 stages the engine keeps 2 batches in flight (the batch queue): the 16-token budget splits the
prompts over batches, and the shortest request stops after 3 tokens while the others' batch is in flight.
Beyond the dense decoders, each on two stages against transformers: Mixtral (MoE), Jamba (a Mamba stage and
an attention stage: different caches per stage), and (slow) Llava (the vision tower on the first stage), a
Qwen3Model embedding model (the pooler on the last stage), DeepSeek-V2 and gpt-oss; TP=2 x PP=2 (slow) for
Qwen3-MoE, Jamba and the embedding model.
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
def test_two_by_two_ranks_match_hf(llama, four_devices):
    """TP=2 x PP=2 for a dense decoder (Qwen3's q/k norms run under PP=2 below, and under TP in
    test_tensor_parallel: their combination adds no path of its own)."""
    model = llama
    runs, layout, procs, _ = _run(model, tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=64)
    _check(model, runs)
    assert layout["ranks"] == 4 and len({p.pid for p in procs}) == 4


# ---- beyond the dense decoders: MoE, a hybrid, a VLM, a pooling model -------------------------------------

def _greedy(llm, prompts, max_tokens=8):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _random_prompts(seed, lens=(3, 17, 40)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Mixtral (every layer routed) and Qwen3-MoE (layer 0 dense, layer 1 routed) of test_models_moe, their
    prompts and transformers' float32 greedy tokens."""
    from test_models_moe import _configs

    out = {}
    for arch in ("mixtral", "qwen3_moe"):
        path = tmp_path_factory.mktemp(f"tiny-{arch}-pp")
        hf = save_tiny(path, _configs()[arch]())
        prompts = _random_prompts(7)
        out[arch] = (str(path), prompts, [hf_greedy(hf, p, 8) for p in prompts])
    return out


def test_mixtral_two_stages_match_hf(moe_models):
    """Each stage holds one MoE layer and hands the next only its stream (the layers add their own residual)."""
    path, prompts, ref = moe_models["mixtral"]
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=16, num_kv_blocks=64)
    try:
        assert _greedy(llm, prompts) == ref
        assert llm.llm_engine.core.engine_core.max_batches_in_flight == 2
        # Stage 0 built layer 0 (and the embedding), stage 1 layer 1 (and the head): each only its own experts.
        held = llm.collective_rpc(lambda w: sorted({n.split(".")[2] for n, _ in w.runner.model.named_parameters()
                                                    if n.startswith("model.layers.")}))
        assert held == [["0"], ["1"]]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v2", "gpt_oss"])
def test_more_moe_families_two_stages_match_hf(arch, tmp_path):
    """DeepSeek-V2 (MLA; layer 0 dense, layer 1 routed) and gpt-oss, whose layer 0 is sliding-window attention
    with sinks and layer 1 full: its stages hold different cache groups, both follow the engine's two."""
    from test_models_moe import _configs

    hf = save_tiny(tmp_path, _configs()[arch]())
    prompts = _random_prompts(7)
    llm = LLM(str(tmp_path), dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=16, num_kv_blocks=64)
    try:
        assert _greedy(llm, prompts) == [hf_greedy(hf, p, 8) for p in prompts]
        groups = llm.collective_rpc(lambda w: [(g.spec.kind, g.layers) for g in w.runner.kv_cache_groups])
        if arch == "gpt_oss":
            assert groups == [[("sliding_window_sinks", (0,)), ("attention_sinks", ())],
                              [("sliding_window_sinks", ()), ("attention_sinks", (0,))]]
    finally:
        llm.llm_engine.core.shutdown()


JAMBA_STATE_BYTES = 128 * (3 + 8) * 4  # a Mamba layer's state: 128 channels x (conv kernel - 1 + d_state), fp32
JAMBA_KV_BYTES = 2 * 16 * 2 * 16 * 4  # an attention layer's block: K and V, 16 tokens, 2 KV heads of 16, fp32


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    """test_state_space_models' Jamba: layer 0 a Mamba mixer (dense MLP), layer 1 attention (MoE). Over two
    stages, stage 0 holds only a recurrent state, stage 1 only paged KV."""
    from hf_reference import hf_greedy_with
    from test_state_space_models import _configs

    path = tmp_path_factory.mktemp("tiny-jamba-pp")
    hf = save_tiny(path, _configs()["jamba"]())
    prompts = _random_prompts(5, (2, 17, 40))
    return str(path), prompts, [hf_greedy_with(hf, p, 8, lambda logits, *_: logits) for p in prompts]


def test_jamba_stages_hold_different_caches_and_match_hf(jamba):
    path, prompts, ref = jamba
    memory = 64 * JAMBA_STATE_BYTES
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2, max_model_len=256, max_num_batched_tokens=16,
              kv_cache_memory=memory)
    try:
        assert _greedy(llm, prompts) == ref
        core = llm.llm_engine.core.engine_core
        # Each stage sizes the blocks of its own cache only: 64 states, or memory // 4096 KV blocks (one rank with
        # both layers would hold memory // (5632 + 4096) = 37); the engine uses the fewest.
        assert core.executor.layout["kv_blocks_per_stage"] == [64, memory // JAMBA_KV_BYTES]
        assert core.model_info.num_kv_blocks == 64
        # Both stages follow the engine's two groups; each allocated only its own layers' tensors.
        facts = llm.collective_rpc(lambda w: ([g.spec.kind for g in w.runner.kv_cache_groups],
                                              [g.layers for g in w.runner.kv_cache_groups],
                                              [tuple(t.shape) for t in w.runner.kv_caches]))
        assert [f[0] for f in facts] == [["state", "full_attention"]] * 2
        assert [f[1] for f in facts] == [[(0,), ()], [(), (0,)]]
        assert facts[0][2] == [(64, 128 * 11)] and len(facts[1][2]) == 1 and 64 in facts[1][2][0]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.fixture(scope="module")
def llava_model(tmp_path_factory):
    from tiny_llava import save_tiny_llava

    path = tmp_path_factory.mktemp("tiny-llava-pp")
    return path, save_tiny_llava(path)


@pytest.fixture(scope="module")
def llava_pp(llava_model):
    from tiny_bart import make_image
    from tiny_llava import hf_llava_greedy, llava_processor

    path, hf = llava_model
    q = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    mixed = [(q, [make_image(40, 30, 0)]), (q, [make_image(90, 64, 1)]),
             ("USER: <image> and <image>: which is brighter? ASSISTANT:",
              [make_image(50, 30, 2), make_image(20, 60, 3)]),
             ("A prompt without any picture", [])]
    return str(path), mixed, [hf_llava_greedy(hf, llava_processor(path), t, im, 6) for t, im in mixed]


@pytest.mark.slow
def test_llava_two_stages_of_two_ranks_match_hf(llava_pp, four_devices):
    """TP=2 x PP=2 for the VLM: the vision tower and the projector are built, loaded and run on the first stage's
    two ranks only (whole on each); the language model's heads split over each stage's two ranks; the last stage
    computes the logits."""
    path, mixed, ref = llava_pp
    llm = LLM(model=path, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=64)
    try:
        prompts = [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
                   for t, im in mixed]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert ref[0] != ref[1]  # the image matters
        towers = llm.collective_rpc(lambda w: (w.runner.model.vision_tower is not None,
                                               w.runner.model.multi_modal_projector is not None))
        assert towers == [(True, True)] * 2 + [(False, False)] * 2
    finally:
        llm.llm_engine.core.shutdown()


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    """A Qwen3Model checkpoint (Qwen3-Embedding's architecture), 3 layers with a tied table: its last-token
    embeddings are transformers' final hidden states."""
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("tiny-qwen3-embed-pp")
    hf = save_tiny(path, Qwen3Config(**QWEN3_EMBED))
    hf.model.save_pretrained(path)  # the base model alone, as Qwen3-Embedding ships (names without "model.")
    prompts = _random_prompts(9, (5, 17, 40))
    with torch.no_grad():
        ref = torch.stack([hf.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    return str(path), prompts, ref


QWEN3_EMBED = dict(TINY, num_hidden_layers=3, head_dim=16, tie_word_embeddings=True)


@pytest.mark.slow
def test_qwen3_embedding_two_stages_match_hf(qwen3_embedding):
    """The pooler runs on the last stage and its output is what returns (the 40-token prompt pools after three
    16-token chunks)."""
    import torch.nn.functional as F

    from vllite_core import PoolingParams

    path, prompts, ref = qwen3_embedding
    llm = LLM(path, runner="pooling", dtype="float32", pipeline_parallel_size=2, num_kv_blocks=64,
              max_num_batched_tokens=16)
    try:
        raw = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False))
        mine = torch.tensor([o.outputs.embedding for o in raw])
        assert F.cosine_similarity(mine, ref).min() >= 0.9999
        assert (mine - ref).abs().max() <= 1e-5
    finally:
        llm.llm_engine.core.shutdown()


def test_env_shows_the_stages_of_each_class(moe_models, jamba, llava_model, qwen3_embedding, capsys):
    from vllite_core.entrypoints.cli import main

    def env(path):
        assert main(["env", "--device", "cpu", "-pp", "2", "--model", path]) == 0
        return capsys.readouterr().out

    out = env(moe_models["qwen3_moe"][0])
    assert "stage 0: rank 0: layers 0-0 (1), the embedding" in out
    out = env(jamba[0])
    assert "stage 0: rank 0: layers 0-0 (1), 1 mamba layer(s), the embedding" in out
    assert "stage 1: rank 1: layers 1-1 (1), 1 attention layer(s), the final norm and the LM head (samples)" in out
    assert "stage 0: rank 0: layers 0-0 (1), the embedding and the vision encoder" in env(str(llava_model[0]))
    assert "stage 1: rank 1: layers 2-2 (1), the final norm and the pooler (pools)" in env(qwen3_embedding[0])


@pytest.mark.slow
def test_jamba_two_by_two_ranks_match_hf(jamba, four_devices):
    """TP=2 x PP=2 for the hybrid: stage 0's two ranks each hold half of the Mamba mixer's channels (half of each
    request's state), stage 1's two ranks half of the attention heads."""
    path, prompts, ref = jamba
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=256,
              max_num_batched_tokens=16, num_kv_blocks=64)
    try:
        assert _greedy(llm, prompts) == ref
        held = llm.collective_rpc(lambda w: [tuple(t.shape) for t in w.runner.kv_caches])
        assert held[0] == held[1] == [(64, 64 * 11)]  # 64 of the 128 channels' states
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.slow
def test_qwen3_embedding_two_by_two_ranks_match_hf(qwen3_embedding, four_devices):
    import torch.nn.functional as F

    from vllite_core import PoolingParams

    path, prompts, ref = qwen3_embedding
    llm = LLM(path, runner="pooling", dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2,
              num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        raw = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False))
        mine = torch.tensor([o.outputs.embedding for o in raw])
        assert F.cosine_similarity(mine, ref).min() >= 0.9999 and (mine - ref).abs().max() <= 1e-5
    finally:
        llm.llm_engine.core.shutdown()


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
    from tiny_pooling import minilm_path  # BERT: not built from the decoder layers

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
