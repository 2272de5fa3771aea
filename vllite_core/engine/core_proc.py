"""The engine-core process: one EngineCore behind two ZMQ sockets (vLLM's EngineCoreProc).

It pulls requests from its input socket and pushes each step's ``EngineCoreOutputs`` (token
ids, logprobs, pooled tensors as raw frames, the ``SchedulerStats`` record) to the API process.
It builds an ``EngineCore`` from the config alone (the core makes its own structured-output
compiler, whose tokenizer loads with the first grammar) and its LoRA adapter cache; no
frontend: no tokenizer at start-up, no detokenizer or output processor (text is the API
process's job, as in vLLM).

Start-up failure is sent back as the exception itself (the API re-raises it with its original
text) and the process exits 1. A step that fails with a fault of no single request is sent the
same way (``EngineCoreFailed``) before the process exits 1; the client names it to every open
request. The process also exits when the API process that started it is gone, and an engine core of
a headless node (dp_layout.py) when the link to its API server closes.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import traceback
from typing import Any

import zmq

from vllite_core.config import VlliteConfig
from vllite_core.engine.core import EngineCore, EngineCoreOutput
from vllite_core.engine.core_messages import (
    CallMessage,
    EngineCoreAbort,
    EngineCoreBatch,
    EngineCoreCallResult,
    EngineCoreCollectiveRpc,
    EngineCoreFailed,
    EngineCoreIsSleeping,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreSleep,
    EngineCoreUtility,
    EngineCoreWakeUp,
)
from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("vllite.engine_core")

_PARENT_CHECK_MS = 1000  # how often an idle engine checks that the API process still exists


def last_error_line(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else repr(exc)


def _picklable(exc: BaseException) -> Any:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return f"{type(exc).__name__}: {exc}"


class EngineCoreProc:
    def __init__(self, config: VlliteConfig, engine_index: int) -> None:
        self.engine_index = engine_index
        self.core = EngineCore(config)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreBatch)
        self.num_applied = 0
        self.stop = threading.Event()  # set from another thread: stop between steps once idle

    def _apply(self, msg: Any) -> bool:
        """Apply one client message; False when it asks the process to stop."""
        from vllite_core.request import Request, RequestStatus

        if isinstance(msg, EngineCoreRequest):
            # The API process checked the adapter; the workers load it (their own caches).
            lora = pickle.loads(msg.lora_request) if msg.lora_request is not None else None
            pooling = pickle.loads(msg.pooling_params) if msg.pooling_params is not None else None
            self.core.add_request(Request(
                msg.request_id, msg.prompt_token_ids, pickle.loads(msg.sampling_params), eos_token_id=msg.eos_token_id,
                priority=msg.priority, arrival_time=msg.arrival_time, max_tokens=msg.max_tokens,
                encoder_inputs=msg.encoder_inputs, num_encoder_tokens=msg.num_encoder_tokens,
                cache_salt=msg.cache_salt, block_extra_keys=tuple(msg.block_extra_keys),
                pooling_params=pooling, lora_request=lora,
                mm_features=pickle.loads(msg.mm_features) if msg.mm_features is not None else []))
        elif isinstance(msg, EngineCoreAbort):
            if msg.stopped:
                for rid in msg.request_ids:
                    self.core.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            else:
                self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, EngineCoreUtility):
            if msg.method == "shutdown":
                return False
            if msg.method == "remove_lora":
                self.core.remove_lora(int(msg.args[0]))
            if msg.method == "reset_prefix_cache":
                self.core.reset_prefix_cache()
        return True

    def _call(self, msg: CallMessage) -> EngineCoreCallResult:
        """Run one call and answer it; what it raises goes back to the caller, the engine goes on."""
        try:
            if isinstance(msg, EngineCoreSleep):
                value: Any = self.core.sleep(msg.level)
            elif isinstance(msg, EngineCoreWakeUp):
                value = self.core.wake_up(msg.tags)
            elif isinstance(msg, EngineCoreIsSleeping):
                value = self.core.is_sleeping()
            else:
                import cloudpickle

                method = msg.method if msg.method is not None else cloudpickle.loads(msg.function)
                value = self.core.collective_rpc(method, pickle.loads(msg.args), pickle.loads(msg.kwargs))
            return EngineCoreCallResult(self.engine_index, msg.call_id, pickle.dumps(value))
        except Exception as e:  # noqa: BLE001 - answered to the caller, named
            logger.warning("engine core call %s failed: %s", type(msg).__name__, last_error_line(e))
            return EngineCoreCallResult(self.engine_index, msg.call_id, error=_picklable(e), text=last_error_line(e))

    def run(self, inp: zmq.Socket, out: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(inp, zmq.POLLIN)
        parent = os.getppid()
        while True:
            busy = self.core.has_unfinished_requests()
            applied = False
            if not poller.poll(0 if busy else _PARENT_CHECK_MS):
                if not busy and os.getppid() != parent:
                    logger.warning("the API process is gone: the engine core stops")
                    return
                if not busy and self.stop.is_set():
                    return
            refused: list[EngineCoreOutput] = []
            while inp.poll(0):
                frames = [f.buffer for f in inp.recv_multipart(copy=False)]
                for msg in self.decoder.decode(frames).messages:
                    if isinstance(msg, (EngineCoreSleep, EngineCoreWakeUp, EngineCoreIsSleeping,
                                        EngineCoreCollectiveRpc)):
                        out.send_multipart(self.encoder.encode(self._call(msg)), copy=False)
                        applied = True
                        self.num_applied += 1
                        continue
                    try:
                        if not self._apply(msg):
                            return
                    except Exception as e:  # checked by the API already, so unexpected: this request alone fails
                        if not isinstance(msg, EngineCoreRequest):
                            raise
                        logger.exception("engine core refused request %s", msg.request_id)
                        refused.append(EngineCoreOutput(msg.request_id, [], finish_reason="error",
                                                        error=last_error_line(e)))
                    applied = True
                    self.num_applied += 1
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            outputs = refused + outputs
            if outputs or applied:
                msg = EngineCoreOutputs(self.engine_index, outputs, self.core.stats(), bool(outputs),
                                        self.num_applied)
                out.send_multipart(self.encoder.encode(msg), copy=False)


def _configure_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=os.environ.get("VLLITE_LOG_LEVEL", "INFO"),
                            format=f"%(levelname)s %(name)s[engine {os.getpid()}]: %(message)s")


def run_engine_core(config: VlliteConfig, engine_index: int, input_addr: str | None, output_addr: str) -> None:
    """The process's entry point (multiprocessing, spawn). ``input_addr`` None: a headless node's core,
    whose one socket to the API server's front end at ``output_addr`` carries both ways (dp_layout.py)."""
    _configure_logging()
    ctx = zmq.Context()
    stop = threading.Event()
    if input_addr is None:
        from vllite_core.engine.dp_layout import connect_to_front_end, stop_when_front_end_gone

        out = connect_to_front_end(ctx, output_addr, engine_index, stop_when_front_end_gone(stop))
    else:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 5000)
        out.connect(output_addr)
    encoder = MsgpackEncoder()
    try:
        proc = EngineCoreProc(config, engine_index)
    except BaseException as e:  # start-up failed: the API re-raises this with its original text
        traceback.print_exc()
        out.send_multipart(encoder.encode(EngineCoreFailed(engine_index, _picklable(e), last_error_line(e))))
        out.close()
        ctx.term()
        sys.exit(1)
    proc.stop = stop
    if input_addr is None:
        inp = out
    else:
        inp = ctx.socket(zmq.PULL)
        inp.setsockopt(zmq.LINGER, 0)
        inp.connect(input_addr)
    out.send_multipart(encoder.encode(EngineCoreReady(engine_index, os.getpid(), pickle.dumps(proc.core.info()),
                                                      proc.core.stats())))
    code = 0
    try:
        proc.run(inp, out)
    except BaseException as e:  # a fault of no single request: the client fails every open request with it
        logger.exception("engine core %d: a step failed; the engine core stops", engine_index)
        out.send_multipart(encoder.encode(EngineCoreFailed(engine_index, _picklable(e), last_error_line(e))))
        code = 1
    finally:
        inp.close()
        out.close()
        ctx.term()
    try:
        proc.core.shutdown()  # the executor's worker processes (tensor parallel) and the grammar compiler
    except Exception:  # noqa: BLE001 - exiting anyway; the workers notice their parent is gone
        logger.exception("engine core %d: shutting down its workers failed", engine_index)
        code = code or 1
    # Nothing is left to finalize: skip the interpreter's teardown of torch and every module (2-3 s of the
    # server's stop, spent after the engine's work is done and its last words are sent).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
