"""The engine core boundary (engine/core_client.py): one EngineCoreClient protocol, an in-process and a
multiprocess implementation, the core built from the config alone, one stats record.

- The engine-core process's start-up (EngineCoreProc, run here in this process) builds no frontend:
  no LLMEngine, no OutputProcessor, no tokenizer; the core's grammar compiler loads its tokenizer
  with the first structured-output request, and that request's tokens equal the frontend's.
- LLMEngine on an MPClient (engine core in its own process) answers what an in-process engine does:
  the same greedy tokens, unfinished requests, the stats record.
- ``combine`` (data-parallel engine cores) sums the records, KV usage weighted by each one's blocks.
"""
from __future__ import annotations

from collections import deque

import pytest

from vllite_core import LLM, SamplingParams
from vllite_core.config import EngineArgs
from vllite_core.core.stats import SchedulerStats, StepTimes, combine
from vllite_core.multimodal.encoder_cache import EncoderCacheStats
from vllite_core.request import Request
from vllite_core.sampling_params import StructuredOutputsParams
from vllite_core.spec_decode.metrics import SpecDecodingStats

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=64)
PROMPT = [5, 17, 42, 99, 3, 250, 11]


def regex_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="(ab|cd)+"))


def test_the_core_process_starts_without_a_frontend(tiny_path, monkeypatch):
    import model_registry.source as source
    from vllite_core.engine import llm_engine, output_processor
    from vllite_core.engine.core_proc import EngineCoreProc

    loads: list[tuple] = []
    real_load = source.load_tokenizer

    def recording_load(*args, **kw):
        loads.append(args)
        return real_load(*args, **kw)

    def refuse(*args, **kw):
        raise AssertionError("a frontend object was built in the engine-core process")

    monkeypatch.setattr(source, "load_tokenizer", recording_load)
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", refuse)
    monkeypatch.setattr(output_processor.OutputProcessor, "__init__", refuse)
    proc = EngineCoreProc(EngineArgs.from_kwargs(model=tiny_path, **ENGINE).create_config(), 0)
    try:
        info, stats = proc.core.info(), proc.core.stats()  # what the process sends when it is ready
        assert loads == []  # no tokenizer at start-up
        assert info.config.model_config.max_model_len == 256 and info.model_info.num_kv_blocks == 64
        assert stats.num_free_blocks == stats.num_total_blocks == 63 and stats.step_times.steps == 0
        core = proc.core
        core.add_request(Request("r", PROMPT, regex_params(), max_tokens=6))
        tokens: list[int] = []
        for _ in range(100):
            for out in core.step():
                tokens += out.new_token_ids
            if not core.has_unfinished_requests():
                break
        assert len(loads) == 1  # the grammar's tokenizer, loaded for the first structured request
    finally:
        proc.core.shutdown()
    monkeypatch.undo()
    llm = LLM(model=tiny_path, **ENGINE)
    want = llm.generate([{"prompt_token_ids": PROMPT}], regex_params())[0].outputs[0]
    assert tokens == want.token_ids and want.text and set(want.text) <= set("abcd")


@pytest.mark.slow
def test_an_engine_on_the_multiprocess_client_answers_as_in_process(tiny_path):
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.engine.mp_client import MPClient

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[::-1]}]
    local = LLM(model=tiny_path, **ENGINE)
    want = [o.outputs[0].token_ids for o in local.generate(prompts, params)]
    client = MPClient(EngineArgs.from_kwargs(model=tiny_path, **ENGINE).create_config())
    try:
        engine = LLMEngine(client.info.config, core=client)
        assert engine.config.model_config.max_model_len == 256 and client.num_kv_blocks() == 64
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        assert engine.get_num_unfinished_requests() == 2
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
        assert [got["0"], got["1"]] == want
        assert engine.get_num_unfinished_requests() == 0
        stats = engine.get_stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks == 63
        assert stats.step_times.steps >= 8 and stats.step_times.tokens >= 2 * len(PROMPT) + 14
        assert client.engine_stats() == [stats]
    finally:
        client.shutdown()


def test_combine_sums_engine_records():
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_free_blocks=10, num_total_blocks=20,
                       num_preemptions_total=1, prefix_cache_queries=100, prefix_cache_hits=40,
                       num_jump_forward_tokens=3, spec_decoding=SpecDecodingStats(2, 4, 8, 5, [3, 2]),
                       mm_cache=EncoderCacheStats(4, 1, 0), step_times=StepTimes(0.1, 1.0, 0.2, 10, 300))
    b = SchedulerStats(num_running=1, kv_cache_usage=0.25, num_free_blocks=60, num_total_blocks=80,
                       prefix_cache_queries=50, prefix_cache_hits=10,
                       spec_decoding=SpecDecodingStats(2, 1, 2, 1, [1, 0]), step_times=StepTimes(0.3, 2.0, 0.1, 5, 100))
    both = combine([a, b])
    assert (both.num_running, both.num_waiting, both.num_free_blocks, both.num_total_blocks) == (3, 1, 70, 100)
    assert both.kv_cache_usage == pytest.approx((0.5 * 20 + 0.25 * 80) / 100)
    assert (both.prefix_cache_queries, both.prefix_cache_hits, both.num_preemptions_total) == (150, 50, 1)
    assert both.spec_decoding == SpecDecodingStats(2, 5, 10, 6, [4, 2])
    assert both.mm_cache == EncoderCacheStats(4, 1, 0) and both.num_jump_forward_tokens == 3
    assert both.step_times == StepTimes(pytest.approx(0.4), 3.0, pytest.approx(0.3), 15, 400)
    assert combine([a]) is a


def test_ready_waits_until_the_engines_input_socket_is_joined(monkeypatch):
    """zmq joins sockets in the background, so a core's "ready" can arrive before its input socket is joined
    to the client's; a send in that gap fails as if the core were gone (a restarted data-parallel core was
    once taken for dead, "died: still running"). The client waits for the join: without a peer it gives up
    naming the core, with one it returns the core's info."""
    import multiprocessing
    import pickle

    import zmq

    from vllite_core.engine import core_processes, mp_client
    from vllite_core.engine.core_messages import EngineCoreReady
    from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

    monkeypatch.setattr(core_processes, "_JOIN_S", 0.3)
    client = object.__new__(mp_client.MPClient)
    ctx = zmq.Context()
    client._out = ctx.socket(zmq.PULL)
    out_port = client._out.bind_to_random_port("tcp://127.0.0.1")
    client._decoder = MsgpackDecoder(mp_client.EngineMessage)
    client._pending, client._died, client._results = deque(), None, {}
    client._router, client._inputs, client.dp = None, zmq.Poller(), mp_client.DataParallelLayout()
    client._inputs.register(client._out, zmq.POLLIN)
    engine = core_processes.CoreSlot(0, multiprocessing.current_process(), "", sock=ctx.socket(zmq.PUSH))
    in_port = engine.sock.bind_to_random_port("tcp://127.0.0.1")
    client.engines = [engine]
    core_out = ctx.socket(zmq.PUSH)
    core_out.connect(f"tcp://127.0.0.1:{out_port}")
    ready = MsgpackEncoder().encode(EngineCoreReady(0, 1234, pickle.dumps("the info"), SchedulerStats()))
    try:
        core_out.send_multipart(ready)
        with pytest.raises(core_processes.EngineStartupError, match="engine core 0 .*input socket was not joined"):
            client._wait_ready([engine])
        core_in = ctx.socket(zmq.PULL)
        core_in.connect(f"tcp://127.0.0.1:{in_port}")
        core_out.send_multipart(ready)
        client._wait_ready([engine])
        assert engine.ready and engine.info == "the info"
    finally:
        ctx.destroy(linger=0)


def test_a_failed_spawn_stops_the_cores_already_started(tiny_path, monkeypatch):
    """Data parallel: when starting the second core's process fails, the client raises that error and stops the
    first core (its close() once tripped over the engine that never got a process)."""
    from vllite_core.engine import mp_client

    started = []
    spawn = mp_client.MPClient._spawn

    def failing_spawn(self, eng):
        if eng.index == 1:
            raise OSError("no process for engine 1")
        spawn(self, eng)
        started.append(eng.proc)

    monkeypatch.setattr(mp_client.MPClient, "_spawn", failing_spawn)
    config = EngineArgs.from_kwargs(model=tiny_path, dtype="float32", num_kv_blocks=16).create_config()
    with pytest.raises(OSError, match="no process for engine 1"):
        mp_client.MPClient(config, 2)
    assert len(started) == 1 and started[0].exitcode is not None
