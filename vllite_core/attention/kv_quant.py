"""FP8 KV caches: each attention layer's ``k_scale`` / ``v_scale`` and the quantising write / scaled read.

A float8 cache stores ``x / scale`` saturated to the format's largest finite value (e4m3fn: 448,
e5m2: 57344; the fnuz variants: 240 and 57344), and attention reads ``stored * scale``. Scales are per
layer and per tensor, as vLLM and llm-compressor checkpoints carry them
(``self_attn.k_scale`` / ``v_scale``, the older single ``kv_scale`` for both, or compressed-tensors'
``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``); without them they are 1.0, or measured
on the first batch that reaches the cache when ``calculate_kv_scales`` is set. Caches in the model
dtype ignore scales.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import torch

from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.attention.kv_quant")

E4M3_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (writes saturate to it)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the cache stores it: divided by ``scale`` and saturated for a float8 cache, else cast."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    y = x.float()
    if scale != 1.0:
        y = y / scale
    limit = fp8_max(cache_dtype)
    return y.clamp_(-limit, limit).to(cache_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache contents back in ``dtype``: multiplied by ``scale`` when the cache is float8."""
    y = x.to(dtype)
    return y * scale if is_fp8(x.dtype) and scale != 1.0 else y


# Checkpoint names of per-layer KV scales -> which scale(s) they set.
_SCALE_NAME = re.compile(r"^(?P<layer>.*\.self_attn)\."
                         r"(?:(?P<kv>[kv])_scale|kv_scale|(?P<proj>[kv])_proj\.output_scale)$")


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """``(attention module name, "k" | "v" | "kv")`` for a checkpoint tensor holding a KV cache scale."""
    m = _SCALE_NAME.match(name)
    if m is None:
        return None
    return m.group("layer"), m.group("kv") or m.group("proj") or "kv"


@dataclass
class KVScales:
    """One attention layer's cache scales. ``active`` (set by ``configure_kv_scales``) only for float8
    caches; ``calculate`` while the first batch is still to be measured."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    from_checkpoint: bool = False
    active: bool = False
    calculate: bool = False
    cache_dtype: torch.dtype | None = None

    def set_from_checkpoint(self, which: str, tensor: torch.Tensor, layer: str) -> None:

        if tensor.numel() != 1:
            raise ConfigError(f"{layer}: KV cache scales must be per tensor (one value), got shape "
                              f"{tuple(tensor.shape)}")
        value = float(tensor.reshape(()).float())
        if not math.isfinite(value) or value <= 0.0:
            raise ConfigError(f"{layer}: KV cache scale {which}_scale must be positive and finite, got {value}")
        if "k" in which:
            self.k_scale = value
        if "v" in which:
            self.v_scale = value
        self.from_checkpoint = True

    def kwargs(self) -> dict[str, float]:
        """What the attention backend gets: nothing unless the cache is float8 with a scale other than 1."""
        if not self.active or (self.k_scale == 1.0 and self.v_scale == 1.0):
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def maybe_calculate(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None) -> None:
        """With ``calculate_kv_scales``: on the first batch written to a real cache, scale = amax / fp8 max
        (so that batch uses the whole range without saturating); fixed afterwards."""
        if not self.calculate or kv_cache is None or kv_cache.numel() == 0 or key.numel() == 0:
            return
        assert self.cache_dtype is not None
        limit = fp8_max(self.cache_dtype)
        tiny = torch.finfo(torch.float32).tiny
        self.k_scale = max(float(key.abs().amax()) / limit, tiny)
        self.v_scale = max(float(value.abs().amax()) / limit, tiny)
        self.calculate = False


def configure_kv_scales(model: torch.nn.Module, kv_cache_dtype: torch.dtype, calculate: bool) -> int:
    """Turn every layer's scales on for a float8 cache (measured on the first batch if ``calculate``);
    warn once when an e4m3 cache runs with the default 1.0 scales. Returns the number of layers."""
    layers = [m.kv_scales for m in model.modules() if isinstance(getattr(m, "kv_scales", None), KVScales)]
    fp8 = is_fp8(kv_cache_dtype)
    for s in layers:
        s.active, s.cache_dtype = fp8, kv_cache_dtype
        s.calculate = fp8 and calculate
    if fp8 and not calculate and kv_cache_dtype in E4M3_DTYPES and layers and not any(
            s.from_checkpoint for s in layers):
        logger.warning("kv_cache_dtype %s: the checkpoint has no k_scale/v_scale; using 1.0 (values beyond "
                       "+-%g saturate; set calculate_kv_scales=True to measure them on the first batch)",
                       str(kv_cache_dtype).replace("torch.", ""), fp8_max(kv_cache_dtype))
    return len(layers)


def store_scaled(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """``cache`` viewed as [slots, heads, dim]: ``cache[slots] = quantize(x)``. float8 caches are written
    through a uint8 view (CPU ``index_copy_`` has no float8 kernel)."""
    q = quantize(x, cache.dtype, scale)
    if is_fp8(cache.dtype):
        cache, q = cache.view(torch.uint8), q.view(torch.uint8)
    cache.index_copy_(0, slots, q)

