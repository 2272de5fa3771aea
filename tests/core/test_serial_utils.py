"""The engine-core wire format (engine/serial_utils.py, engine/core_messages.py): tensors travel as
raw frames and come back equal (dtype, shape, values), typed messages decode into their types."""
from __future__ import annotations

import pickle

import numpy as np
import torch

from vllite_core.core.stats import SchedulerStats, StepTimes
from vllite_core.engine.core import EngineCoreOutput
from vllite_core.engine.core_messages import (
    EngineCoreAbort,
    EngineCoreBatch,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineMessage,
)
from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllite_core.sampling_params import SamplingParams
from vllite_core.spec_decode.metrics import SpecDecodingStats
from vllite_core.worker.model_runner import SampleLogprobs


def roundtrip(obj, type_):
    frames = MsgpackEncoder().encode(obj)
    # what ZMQ hands the receiver: separate buffers, copied
    return MsgpackDecoder(type_).decode([bytes(f) for f in frames]), len(frames)


def test_tensors_are_raw_frames_and_come_back_equal():
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
               "i64": torch.arange(7), "empty": torch.empty(0, 3), "strided": torch.randn(6, 4, generator=g).t(),
               "bool": torch.tensor([True, False, True])}
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    got, n_frames = roundtrip({"t": tensors, "a": arr}, dict)
    assert n_frames == 1 + len(tensors) + 1  # the body, one frame per tensor, one for the array
    for name, t in tensors.items():
        back = got["t"][name]
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), name
    assert got["a"].dtype == arr.dtype and np.array_equal(got["a"], arr)


def test_step_outputs_decode_into_their_types():
    pooled = torch.randn(8)
    out = EngineCoreOutput("r1", [5, 6], new_logprobs=[SampleLogprobs([5, 9], [-0.5, -1.5], 1)],
                           finish_reason="length", stop_reason=None, pooling_output=pooled, num_cached_tokens=16)
    stats = SchedulerStats(num_running=3, kv_cache_usage=0.25, spec_decoding=SpecDecodingStats(2, 1, 2, 1, [1, 0]),
                           step_times=StepTimes(steps=5, tokens=9))
    msg = EngineCoreOutputs(1, [out], stats, True, 4)
    got, _ = roundtrip(msg, EngineMessage)
    assert isinstance(got, EngineCoreOutputs) and got.engine_index == 1 and got.num_applied == 4
    back = got.outputs[0]
    assert isinstance(back, EngineCoreOutput) and isinstance(back.new_logprobs[0], SampleLogprobs)
    assert (back.request_id, back.new_token_ids, back.finish_reason, back.num_cached_tokens) == ("r1", [5, 6],
                                                                                               "length", 16)
    assert back.new_logprobs[0] == out.new_logprobs[0] and torch.equal(back.pooling_output, pooled)
    assert got.stats == msg.stats


def test_requests_keep_their_sampling_params_whole():
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, stop=["\n"], seed=3)
    req = EngineCoreRequest("a", [1, 2, 3], pickle.dumps(params), eos_token_id=2, priority=-1, max_tokens=5,
                            encoder_inputs={"features": torch.ones(2, 3)}, cache_salt="s")
    got, _ = roundtrip(EngineCoreBatch([req, EngineCoreAbort(["b"], stopped=True)]), EngineCoreBatch)
    add, abort = got.messages
    assert isinstance(add, EngineCoreRequest) and isinstance(abort, EngineCoreAbort) and abort.stopped
    assert pickle.loads(add.sampling_params) == params
    assert torch.equal(add.encoder_inputs["features"], torch.ones(2, 3)) and add.cache_salt == "s"
    assert (add.priority, add.max_tokens, add.eos_token_id) == (-1, 5, 2)
