"""What travels between the API process and an engine-core process (typed msgspec Structs).

Python objects msgpack cannot carry faithfully (dataclasses with private state, a model class) travel
as pickled bytes fields; tensors are raw frames (serial_utils).

Client -> engine: ``EngineCoreRequest`` (a new request; one per engine request, so the n
children of a parallel-sampling request are n of these), ``EngineCoreAbort`` (abort, or finish
as stopped when the API's stop-string check ended it), ``EngineCoreUtility`` (LoRA cache
removal, prefix cache reset, shutdown). Engine -> client: ``EngineCoreReady`` once (or ``EngineCoreFailed`` when
start-up failed), then ``EngineCoreOutputs`` per step, ``EngineCoreFailed`` if the loop dies.
"""
from __future__ import annotations

from typing import Any

import msgspec

from vllite_core.core.stats import SchedulerStats
from vllite_core.engine.core import EngineCoreOutput


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: bytes  # pickled SamplingParams: private fields (the grammar backend chosen) ride along
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = 0.0
    max_tokens: int = 16
    encoder_inputs: Any = None
    num_encoder_tokens: int = 0
    cache_salt: str | None = None
    block_extra_keys: tuple = ()
    pooling_params: bytes | None = None  # pickled PoolingParams
    lora_request: bytes | None = None  # pickled LoRARequest: the engine resolves it with its own adapter cache
    mm_features: bytes | None = None  # pickled list of MultiModalFeature (image pixels as tensors, hashes, ranges)


class EngineCoreAbort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    stopped: bool = False  # finished by a stop string (the API saw it) rather than aborted


class EngineCoreUtility(msgspec.Struct, tag="utility", array_like=True):
    method: str  # "remove_lora" | "reset_prefix_cache" | "shutdown"
    args: list[Any] = []


ClientMessage = EngineCoreRequest | EngineCoreAbort | EngineCoreUtility


class EngineCoreBatch(msgspec.Struct, tag="batch", array_like=True):
    """What the client queued since its last send, in order, in one ZMQ message: the prompts of one
    multi-prompt request reach the scheduler together (the same batch as in-process)."""

    messages: list[ClientMessage]


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    engine_index: int
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats  # the numbers after this step
    stepped: bool = True  # False: only the stats changed (an abort freed blocks)
    num_applied: int = 0  # client messages applied so far: the client waits for these numbers to catch up


class EngineCoreReady(msgspec.Struct, tag="ready", array_like=True):
    engine_index: int
    pid: int
    info: bytes  # pickled engine.core.CoreInfo: the finalized config, ModelInfo, vocab size, model class...
    stats: SchedulerStats  # the numbers before any request (all blocks free)


class EngineCoreFailed(msgspec.Struct, tag="failed", array_like=True):
    engine_index: int
    error: Any  # the exception itself (pickled), or its text when it cannot be pickled
    text: str  # the traceback's last line


EngineMessage = EngineCoreOutputs | EngineCoreReady | EngineCoreFailed
