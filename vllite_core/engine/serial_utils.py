"""msgpack (msgspec) encoding for the engine-core sockets, with tensors as raw frames.

A message is a list of ZMQ frames: frame 0 is the msgpack body, each tensor or numpy array
in it becomes an extension value naming (dtype, shape, frame index) and its bytes travel as
their own frame, uncopied on the way out (ZMQ sends the buffer). Dataclasses and msgspec
Structs are msgpack maps/arrays decoded into their declared types. Objects msgpack cannot
express (SamplingParams with their private fields, exceptions, a hf config) travel pickled
in an extension value: both ends are this process's own children, never a remote peer.
"""
from __future__ import annotations

import pickle
from typing import Any

import msgspec
import numpy as np
import torch

EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_PICKLE = 3

Frames = list[bytes | memoryview]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a message")
    return dtype


class MsgpackEncoder:
    """One encoder per sending thread (it keeps the frames of the message being built)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._meta = msgspec.msgpack.Encoder()
        self._frames: Frames = []

    def encode(self, obj: Any) -> Frames:
        self._frames = [b""]
        try:
            self._frames[0] = self._enc.encode(obj)
            return self._frames
        finally:
            self._frames = []

    def _buffer(self, data: memoryview) -> int:
        self._frames.append(data)
        return len(self._frames) - 1

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            raw = t.view(torch.uint8) if t.numel() and t.element_size() else t
            data = memoryview(raw.numpy()).cast("B") if t.numel() else memoryview(b"")
            meta = (str(t.dtype).removeprefix("torch."), list(t.shape), self._buffer(data))
            return msgspec.msgpack.Ext(EXT_TENSOR, self._meta.encode(meta))
        if isinstance(obj, np.ndarray) and obj.dtype.hasobject is False:
            a = np.ascontiguousarray(obj)
            meta = (a.dtype.str, list(a.shape), self._buffer(memoryview(a.reshape(-1).view(np.uint8))))
            return msgspec.msgpack.Ext(EXT_NDARRAY, self._meta.encode(meta))
        return msgspec.msgpack.Ext(EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class MsgpackDecoder:
    """Decodes frames into ``type`` (a Struct, a dataclass, a union of them, or Any)."""

    def __init__(self, type: Any = Any) -> None:
        self._dec = msgspec.msgpack.Decoder(type, ext_hook=self._ext)
        self._meta = msgspec.msgpack.Decoder()
        self._frames: list[Any] = []

    def decode(self, frames: list[Any]) -> Any:
        self._frames = frames
        try:
            return self._dec.decode(frames[0])
        finally:
            self._frames = []

    def _ext(self, code: int, data: memoryview) -> Any:
        if code == EXT_TENSOR:
            dtype, shape, idx = self._meta.decode(data)
            buf = bytearray(self._frames[idx])  # a writable copy the tensor owns
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            return t.view(_torch_dtype(dtype)).reshape(shape) if buf else torch.empty(shape,
                                                                                        dtype=_torch_dtype(dtype))
        if code == EXT_NDARRAY:
            dtype, shape, idx = self._meta.decode(data)
            return np.frombuffer(bytearray(self._frames[idx]), dtype=np.dtype(dtype)).reshape(shape)
        if code == EXT_PICKLE:
            return pickle.loads(data)
        raise ValueError(f"unknown msgpack extension {code} in a message")
