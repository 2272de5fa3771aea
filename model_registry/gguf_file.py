"""A fast, read-only GGUF parser: metadata and tensor directory.

``gguf.GGUFReader`` builds a numpy view per string, which takes seconds for a
49k-token vocabulary; start-up reads the header several times (config,
tokenizer cache key, weights), so this parser walks it with ``struct`` instead
(tens of milliseconds) and memory-maps tensor data only when asked. Only
little-endian files (what llama.cpp writes on every common host) are accepted.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from model_registry.gguf_dequant import dequantize_blocks

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType) -> struct format for scalars.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Tensor types stored as plain numpy arrays (everything else is a byte array of blocks).
_PLAIN_TENSOR_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this parser understands."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF dims reversed): [rows, cols] = [out, in] for weights
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class GGUFFile:
    """Metadata (``metadata``) and tensor directory (``tensors``) of one GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, self.tensors = _parse(buf, self.path)
        finally:
            buf.close()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored data of one tensor, shaped the way ``gguf.quants.dequantize`` expects (read-only memmap)."""
        info = self.tensors[name]
        plain = _PLAIN_TENSOR_TYPES.get(info.ggml_type)
        if plain is not None:
            count, dtype, shape = int(np.prod(info.shape)), plain, info.shape
        else:
            count, dtype, shape = info.nbytes, np.uint8, quant_shape_to_byte_shape(info.shape, info.ggml_type)
        data = np.memmap(self.path, dtype=dtype, mode="r", offset=info.offset, shape=(count,))
        return data.reshape(shape)

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as a float32 array of shape ``tensors[name].shape`` (a fresh, writable copy)."""
        info = self.tensors[name]
        fast = dequantize_blocks(self.raw(name), info.ggml_type, info.shape)
        if fast is not None:
            return fast.numpy()
        out = dequantize(self.raw(name), info.ggml_type)
        out = np.array(out, dtype=np.float32, copy=True) if out.dtype != np.float32 or not out.flags.writeable \
            else out
        return out.reshape(info.shape)


def _parse(buf: mmap.mmap, path: str) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (bad magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:
        raise GGUFFormatError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    metadata: dict[str, Any] = {}
    try:
        for _ in range(n_kv):
            key, pos = _read_str(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _read_value(buf, pos + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _read_str(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            raw_type, rel_offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(raw_type), rel_offset))
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path}: invalid general.alignment {alignment}")
    data_start = pos + (-pos) % alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, qtype, rel_offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"{path}: duplicate tensor {name!r}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        tensors[name] = GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype,
                                       data_start + rel_offset, n_elems * type_size // block)
    return metadata, tensors


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    start = pos + 8
    return buf[start:start + n].decode("utf-8", errors="replace"), start + n


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _read_str(buf, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[etype]).newbyteorder("<")
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
            return arr, pos + count * dtype.itemsize
        items = []
        for _ in range(count):
            item, pos = _read_value(buf, pos, etype)
            items.append(item)
        return items, pos
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")
    (value,) = struct.unpack_from(fmt, buf, pos)
    return value, pos + struct.calcsize(fmt)
