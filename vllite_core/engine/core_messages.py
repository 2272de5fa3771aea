"""What travels between the API process and an engine-core process (typed msgspec Structs).

Python objects msgpack cannot carry faithfully (dataclasses with private state, a model class) travel
as pickled bytes fields; tensors are raw frames (serial_utils).

Client -> engine: ``EngineCoreRequest`` (a new request; one per engine request, so the n
children of a parallel-sampling request are n of these), ``EngineCoreAbort`` (abort, or finish
as stopped when the API's stop-string check ended it), ``EngineCoreUtility`` (LoRA cache
removal, prefix cache reset, shutdown: nothing answered), the calls the client waits for (``CallMessage``: sleep
mode and ``collective_rpc``, each with a ``call_id``). Engine -> client: ``EngineCoreReady`` once (or
``EngineCoreFailed`` when start-up failed), then ``EngineCoreOutputs`` per step, ``EngineCoreCallResult`` per
call, ``EngineCoreFailed`` if the loop dies.
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


class EngineCoreSleep(msgspec.Struct, tag="sleep", array_like=True):
    """Sleep mode: release the KV cache (level 1) and the weights (level 2). Answered by a call result
    holding each rank's ``SleepReport``."""

    call_id: int
    level: int


class EngineCoreWakeUp(msgspec.Struct, tag="wake_up", array_like=True):
    call_id: int
    tags: list[str] | None = None  # "weights", "kv_cache"; None: both


class EngineCoreIsSleeping(msgspec.Struct, tag="is_sleeping", array_like=True):
    call_id: int


class EngineCoreCollectiveRpc(msgspec.Struct, tag="collective_rpc", array_like=True):
    """A worker method on every rank: ``method`` by name, or ``function`` (cloudpickled, called with the
    worker first). Answered with the ranks' results."""

    call_id: int
    method: str | None
    function: bytes | None
    args: bytes  # pickled tuple (a state dict's tensors ride along)
    kwargs: bytes  # pickled dict


CallMessage = EngineCoreSleep | EngineCoreWakeUp | EngineCoreIsSleeping | EngineCoreCollectiveRpc
ClientMessage = EngineCoreRequest | EngineCoreAbort | EngineCoreUtility | CallMessage


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


class EngineCoreCallResult(msgspec.Struct, tag="result", array_like=True):
    """The answer to one call message: its pickled value, or the error it raised (the engine goes on)."""

    engine_index: int
    call_id: int
    value: bytes = b""
    error: Any = None  # the exception (pickled), or its text when it cannot be pickled
    text: str = ""  # the error's last line


EngineMessage = EngineCoreOutputs | EngineCoreReady | EngineCoreFailed | EngineCoreCallResult
