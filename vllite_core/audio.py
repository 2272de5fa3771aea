"""Audio helpers for speech models: WAV decoding (standard library ``wave``) and resampling (numpy).

No audio library is needed: PCM WAV (8/16/24/32-bit integers) goes through
``wave``; IEEE-float WAV (which ``wave`` refuses) through a small RIFF reader.
Other containers (mp3, flac, ogg) are refused with a clear error.
"""
from __future__ import annotations

import io
import os
import struct
import wave
from typing import BinaryIO

import numpy as np


class AudioDecodeError(ValueError):
    """The bytes are not audio this module can decode."""


def load_wav(source: str | os.PathLike | bytes | BinaryIO) -> tuple[np.ndarray, int]:
    """A WAV file (path, bytes or file object) as (float32 mono samples in [-1, 1], sample rate)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            data = f.read()
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        data = source.read()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        kind = _sniff(data)
        raise AudioDecodeError(f"not a WAV file{f' (looks like {kind})' if kind else ''}: send PCM or float WAV")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, sr, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
        samples = _pcm_to_float(raw, width)
    except (wave.Error, EOFError) as e:
        samples, channels, sr = _read_float_wav(data, e)
    if channels > 1:
        samples = samples[: len(samples) // channels * channels].reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(samples, dtype=np.float32), int(sr)


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    if width == 1:  # unsigned 8-bit
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw[: len(raw) // 3 * 3], dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        return v.astype(np.float32) / float(1 << 23)
    if width == 4:
        return (np.frombuffer(raw, dtype="<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    raise AudioDecodeError(f"unsupported WAV sample width: {width} bytes")


def _read_float_wav(data: bytes, cause: Exception) -> tuple[np.ndarray, int, int]:
    """IEEE-float WAV (format 3, or EXTENSIBLE with the float sub-format), which ``wave`` does not read."""
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            payload = body
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None or len(fmt) < 16:
        raise AudioDecodeError(f"unreadable WAV file: {cause}") from None
    tag, channels, sr, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == 0xFFFE and len(fmt) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the real tag opens the sub-format GUID
        tag = struct.unpack("<H", fmt[24:26])[0]
    if tag == 3 and bits in (32, 64):
        samples = np.frombuffer(payload[: len(payload) // (bits // 8) * (bits // 8)],
                                dtype="<f4" if bits == 32 else "<f8").astype(np.float32)
        return samples, channels, sr
    if tag == 1 and bits in (8, 16, 24, 32):
        return _pcm_to_float(payload, bits // 8), channels, sr
    raise AudioDecodeError(f"unsupported WAV encoding (format tag {tag}, {bits} bits): send PCM or float WAV")


def _sniff(data: bytes) -> str | None:
    if data[:3] == b"ID3" or data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "MP3"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "Ogg"
    return None


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Band-limited resampling in the frequency domain (what scipy.signal.resample does)."""
    if orig_sr <= 0 or target_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {target_sr}")
    x = np.asarray(samples, dtype=np.float64)
    if orig_sr == target_sr or x.size == 0:
        return x.astype(np.float32)
    n_out = max(1, int(round(x.size * target_sr / orig_sr)))
    spec = np.fft.rfft(x)
    keep = min(spec.size, n_out // 2 + 1)
    out_spec = np.zeros(n_out // 2 + 1, dtype=spec.dtype)
    out_spec[:keep] = spec[:keep]
    if n_out < x.size and n_out % 2 == 0:
        out_spec[-1] = out_spec[-1].real  # the new Nyquist bin must be real
    y = np.fft.irfft(out_spec, n=n_out) * (n_out / x.size)
    return y.astype(np.float32)


def split_windows(samples: np.ndarray, sample_rate: int, window_s: float) -> list[np.ndarray]:
    """Consecutive windows of at most ``window_s`` seconds (the last one shorter); at least one."""
    n = max(1, int(window_s * sample_rate))
    return [samples[i:i + n] for i in range(0, len(samples), n)] or [samples[:0]]
