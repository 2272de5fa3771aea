"""Tensor parallelism on tiny random checkpoints, against Hugging Face transformers, and its bad input.

The tiny Qwen2 has one KV head (replicated on both ranks), an odd MLP width (49 + 48 columns) and a
vocabulary of 509 (padded shards of 255): every uneven path of the sharding. The last test kills a
worker of the module's engine: the engine reports the rank and the signal, and nothing hangs.
"""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy, hf_logits
from tiny_models import TINY, save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.config import ConfigError, EngineArgs
from vllite_core.distributed.sharding import check_heads, shard_heads, shard_vocab, split
from vllite_core.errors import EngineDeadError
from vllite_core.executor.errors import WorkerDiedError

QWEN2 = dict(TINY, vocab_size=509, intermediate_size=97, num_attention_heads=4, num_key_value_heads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2")
    hf = save_tiny(path, Qwen2Config(**QWEN2, architectures=["Qwen2ForCausalLM"]))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 509, (n,), generator=gen).tolist() for n in (3, 21, 40)]
    return str(path), hf, prompts


@pytest.fixture(scope="module")
def tp2(qwen2):
    llm = LLM(qwen2[0], dtype="float32", tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=32)
    yield llm
    llm.llm_engine.core.shutdown()


def _generate(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_greedy_and_logprobs_match_hf(qwen2, tp2):
    _, hf, prompts = qwen2
    outs = _generate(tp2, prompts)
    for out, prompt in zip(outs, prompts):
        comp = out.outputs[0]
        assert comp.token_ids == hf_greedy(hf, prompt, 10)
        ref = torch.log_softmax(hf_logits(hf, prompt + comp.token_ids[:-1])[len(prompt) - 1:], dim=-1)
        for step, (lp, tok) in enumerate(zip(comp.logprobs, comp.token_ids)):
            top = torch.topk(ref[step], 3)
            assert list(lp)[:1] == [tok]
            assert set(lp) == {tok, *top.indices.tolist()}
            for t, v in lp.items():
                assert abs(v.logprob - float(ref[step, t])) < 1e-4


def test_seeded_sampling_matches_one_rank(qwen2, tp2):
    path, _, prompts = qwen2
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    one = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in _generate(one, prompts, params)]
    assert [o.outputs[0].token_ids for o in _generate(tp2, prompts, params)] == expected


def test_speculative_decoding_over_two_ranks_matches_hf(qwen2):
    """ngram drafts verified on every rank (rank 0's verification shared): greedy tokens equal HF's."""
    path, hf, _ = qwen2
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 4]
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    try:
        outs = _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
        assert llm.llm_engine.core.stats().spec_decoding.num_draft_tokens > 0
    finally:
        llm.llm_engine.core.shutdown()


def test_layout_names_two_worker_processes(tp2):
    layout = tp2.llm_engine.core.engine_core.executor.layout
    assert layout["backend"] == "mp" and layout["ranks"] == 2 and layout["nodes"] == 1
    pids = [p.pid for p in tp2.llm_engine.core.engine_core.executor.procs]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(str(pid) in line for pid, line in zip(pids, layout["processes"]))


def test_a_killed_worker_fails_the_step_naming_its_rank(qwen2, tp2):
    """Runs last: it kills the module engine's rank 1."""
    executor = tp2.llm_engine.core.engine_core.executor
    os.kill(executor.procs[1].pid, signal.SIGKILL)
    executor.procs[1].wait(30)
    result: dict[str, BaseException] = {}

    def go():
        try:
            _generate(tp2, qwen2[2][:1])
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(120)  # a bound so a regression fails instead of hanging the suite
    assert not t.is_alive(), "the engine hung on a dead worker"
    err = result["error"]
    assert isinstance(err, WorkerDiedError) and err.rank == 1
    assert "rank 1" in str(err) and "SIGKILL" in str(err)
    assert all(p.poll() is not None for p in executor.procs)  # rank 0 was stopped too
    with pytest.raises(EngineDeadError):
        _generate(tp2, qwen2[2][:1])


# ---- the sharding rules --------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 2), (9, 3, 3), (8, 8, 3), (4, 1, 2), (8, 2, 4), (16, 4, 8)])
def test_each_query_head_lands_on_one_rank_with_its_kv_head(heads, kv, tp):
    group = heads // kv
    seen = []
    for rank in range(tp):
        s = shard_heads(heads, kv, tp, rank)
        q = list(range(s.q_start, s.q_start + s.num_heads))
        seen += q
        # each local query head reads a local KV head: the one its global index maps to
        assert {h // group for h in q} <= set(range(s.kv_start, s.kv_start + s.num_kv_heads))
        assert s.num_heads == s.num_kv_heads * (s.num_heads // s.num_kv_heads)
    assert sorted(seen) == list(range(heads))


def test_splits_cover_their_dimension():
    for n, parts in [(97, 2), (1536, 2), (10, 3), (5, 5)]:
        ranges = [split(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    shards = [shard_vocab(509, 2, r) for r in range(2)]
    assert [(s.start, s.stop, s.padded) for s in shards] == [(0, 255, 255), (255, 509, 255)]


@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 4), (9, 3, 6), (4, 1, 3), (6, 2, 4)])
def test_heads_that_cannot_split_are_a_config_error(heads, kv, tp):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        check_heads(heads, kv, tp)


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "distributed_executor_backend"),
    ({"distributed_executor_backend": "threads"}, "distributed_executor_backend"),
])
def test_bad_parallel_arguments(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineArgs(**kwargs).create_config()


def test_default_backend_follows_the_rank_count():
    assert EngineArgs().create_config().parallel_config.distributed_executor_backend == "uni"
    assert EngineArgs(tensor_parallel_size=2).create_config().parallel_config.distributed_executor_backend == "mp"


def test_smollm2_heads_do_not_split_over_four_ranks():
    with pytest.raises(ConfigError, match="tensor_parallel_size: 4 .*num_attention_heads=9"):
        LLM(dtype="float32", tensor_parallel_size=4)


def test_more_ranks_than_the_platform_has_devices(tmp_path):
    from transformers import LlamaConfig

    from vllite_core.platforms.resolve import current_platform

    n = current_platform().device_count() + 1  # the CPU platform: one rank per usable core
    save_tiny(tmp_path, LlamaConfig(**dict(TINY, num_attention_heads=n, num_key_value_heads=n, hidden_size=16 * n),
                                    architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError, match=f"tensor_parallel_size: {n} ranks on this machine"):
        LLM(str(tmp_path), dtype="float32", tensor_parallel_size=n)


def test_a_model_without_tensor_parallel_support_is_refused(tmp_path):
    from test_tensor_parallel_models import save_untensored_config  # a plugin's class that does not declare it

    save_untensored_config(tmp_path)
    with pytest.raises(ConfigError, match="MyLlamaForCausalLM does not support tensor parallelism"):
        LLM(str(tmp_path), tensor_parallel_size=2)



def test_a_worker_that_exits_names_its_exit_code_and_last_error_line(tmp_path, monkeypatch, tiny_path):
    from vllite_core.executor import multiproc

    (tmp_path / "exiting_worker.py").write_text("import sys\nsys.stderr.write('CUDA error: out of memory\\n')\n"
                                                 "sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the engine's sys.path
    monkeypatch.setattr(multiproc, "WORKER_MODULE", "exiting_worker")
    with pytest.raises(WorkerDiedError, match=r"worker rank \d .*ended \(exit code 3\); its last error line: "
                                              r"CUDA error: out of memory"):
        LLM(tiny_path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=16)


@pytest.mark.slow
def test_a_worker_failing_to_load_names_its_rank(tmp_path):
    import json

    from transformers import LlamaConfig

    save_tiny(tmp_path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128  # the checkpoint's MLP weights no longer fit
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WorkerDiedError, match=r"worker rank \d on node .*weight model.layers.0.mlp"):
        LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16)


@pytest.mark.slow
def test_a_config_error_inside_a_worker_comes_back_as_one(tiny_path):
    with pytest.raises(ConfigError, match=r"num_kv_blocks: 1 blocks cannot hold one request.*\(worker rank \d\)"):
        LLM(tiny_path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=1)


def test_mp_executor_with_one_rank_matches_uni(tiny_path):
    prompts = [[1, 2, 3, 4, 5], list(range(40, 80))]
    mp = LLM(tiny_path, dtype="float32", distributed_executor_backend="mp", num_kv_blocks=32)
    got = [o.outputs[0].token_ids for o in _generate(mp, prompts, SamplingParams(temperature=0, max_tokens=8))]
    mp.llm_engine.core.shutdown()
    uni = LLM(tiny_path, dtype="float32", num_kv_blocks=32)
    assert got == [o.outputs[0].token_ids for o in _generate(uni, prompts, SamplingParams(temperature=0, max_tokens=8))]
    assert np.all([len(g) == 8 for g in got])


# ---- Whisper (encoder-decoder): heads of the encoder, the decoder and cross attention split ----------

def test_whisper_tp2_matches_hf(tmp_path):
    from test_whisper import hf_whisper_greedy
    from tiny_whisper import save_tiny_whisper, tone
    from transformers import WhisperFeatureExtractor

    hf = save_tiny_whisper(tmp_path)
    fe = WhisperFeatureExtractor.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64 + 2 * -(-1500 // 16))
    try:
        audios = [tone(1.5, 300), tone(4.0, 700, chirp_to=1500)]
        outs = llm.generate([{"multi_modal_data": {"audio": a}} for a in audios],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for out, audio in zip(outs, audios):
            features = fe(audio, sampling_rate=16000, return_tensors="pt").input_features
            assert out.outputs[0].token_ids == hf_whisper_greedy(hf, features, out.prompt_token_ids, 8)
    finally:
        llm.llm_engine.core.shutdown()


# ---- the layout, as `vllite env` prints it -------------------------------------------------------

def test_env_prints_the_parallel_layout(capsys):
    from vllite_core.entrypoints.cli import main

    assert main(["env", "--device", "cpu", "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "parallel:      2 rank(s), mp executor, 1 node(s), collectives gloo" in out
    assert "rank 0: worker process 1 of 2 on this host" in out and "rank 1: worker process 2 of 2" in out


def test_env_layout_json_and_a_bad_layout(capsys):
    import json

    from vllite_core.entrypoints.cli import main
    from vllite_core.platforms.resolve import current_platform

    assert main(["env", "--device", "cpu", "--json", "--tensor-parallel-size", "3",
                 "--distributed-executor-backend", "ray"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"]["backend"] == "ray" and data["parallel"]["ranks"] == 3
    n = current_platform().device_count() + 1
    assert main(["env", "--device", "cpu", "--tensor-parallel-size", str(n)]) == 0
    assert f"error: {n} ranks need {n} devices on this host" in capsys.readouterr().out
    assert main(["env", "--device", "cpu", "--tensor-parallel-size", "2", "--distributed-executor-backend",
                 "uni"]) == 1
    assert "distributed_executor_backend: 'uni' runs one worker" in capsys.readouterr().err
