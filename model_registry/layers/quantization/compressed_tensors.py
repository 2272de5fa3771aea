"""``quant_method: "compressed-tensors"``: the checkpoints llm-compressor writes.

``quantization_config.config_groups`` maps layers (``targets``: a class name such as ``Linear``, a module name,
or ``re:`` a regular expression) to a scheme: ``weights`` (and ``input_activations``) ``QuantizationArgs``;
``ignore`` lists layers left in float. Per layer (``format`` of the group, else of the config):

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 [N, K * bits / 32], code i of a row at bits
  ``bits * i`` (little end first) as an unsigned value (the signed code + 2^(bits-1)); ``weight_scale`` [N,
  groups] (``group`` strategy) or [N, 1] (``channel``); with ``symmetric: false`` a ``weight_zero_point``
  packed the same way along the rows (int32 [N * bits / 32, groups]); ``weight_shape`` [2]; ``actorder:
  group`` adds ``weight_g_idx`` [K] (each column's group);
- ``int-quantized`` / ``naive-quantized`` (W8A8 int8): ``weight`` int8 [N, K], ``weight_scale`` [N, 1]
  (channel) or [1] (tensor), ``input_scale`` when activations are static;
- ``float-quantized`` (FP8, FP8_DYNAMIC, FP8_BLOCK): ``weight`` float8_e4m3fn [N, K], ``weight_scale`` per
  tensor, channel or block ([ceil(N / bn), ceil(K / bk)]), ``input_scale`` when activations are static.

Weight value: ``(code - zero_point) * scale``. int8 W8A8 with dynamic per-token activations and per-channel
weights runs on the int8 kernels of ``quantization="int8"`` (their activation scale is ``amax / 127``,
compressed-tensors' ``amax / 127.5``: the logprobs differ within the tests' stated tolerance).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from model_registry.layers.quantization.prequant import Canonical
from model_registry.layers.quantization.quant_weight import ActQuant
from vllite_core.errors import ConfigError

_PACKED = "pack-quantized"
_INT = ("int-quantized", "naive-quantized")
_FLOAT = "float-quantized"


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [R, W] holding ``32 / bits`` codes a word (code i of a row at bit ``bits * i``) -> uint8 [R, count]
    unsigned codes."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :count].to(torch.uint8)


@dataclass(frozen=True)
class CompressedTensorsFormat:
    """One config group's scheme, for the layers it targets (a ``prequant.LayerFormat``)."""

    fmt: str
    bits: int
    strategy: str  # group | channel | tensor | block
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool
    actorder: bool
    act: ActQuant | None
    static_input: bool

    @property
    def tensors(self) -> tuple[str, ...]:
        if self.fmt == _PACKED:
            names = ("weight_packed", "weight_scale", "weight_shape")
            names += () if self.symmetric else ("weight_zero_point",)
            return names + (("weight_g_idx",) if self.actorder else ())
        return ("weight", "weight_scale") + (("input_scale",) if self.static_input else ())

    @property
    def zero(self) -> int:
        return 1 << (self.bits - 1) if self.fmt == _PACKED else 0

    def int8_rows(self) -> bool:
        return (self.fmt in _INT and self.strategy == "channel" and self.act is not None
                and self.act.kind == "int8" and self.act.strategy == "token")

    def with_input_scale(self, parts: dict[str, torch.Tensor]) -> ActQuant | None:
        if self.act is None or not self.static_input:
            return self.act
        return ActQuant(self.act.kind, "tensor", parts["input_scale"].float().reshape(-1)[:1].clone())

    def canonical(self, parts: dict[str, torch.Tensor], rows: int, cols: int, name: str) -> Canonical:
        scale = parts["weight_scale"].float()
        if self.fmt == _PACKED:
            shape = tuple(int(v) for v in parts["weight_shape"].reshape(-1).tolist())
            if shape != (rows, cols):
                raise ConfigError(f"weight {name}.weight_shape: {shape}, the model expects ({rows}, {cols})")
            codes = unpack_int32(parts["weight_packed"], self.bits, cols)
            zeros = None
            if not self.symmetric:
                zp = unpack_int32(parts["weight_zero_point"].T.contiguous(), self.bits, rows).T
                zeros = zp.float()
            group = self.group_size if self.strategy == "group" else cols
            g_idx = parts["weight_g_idx"].long() if self.actorder else None
            return Canonical(codes, scale.reshape(rows, -1), zeros, group or cols, g_idx)
        codes = parts["weight"]
        if self.fmt in _INT and codes.dtype != torch.int8:
            raise ConfigError(f"weight {name}.weight: int-quantized weights must be int8, got {codes.dtype}")
        if self.fmt == _FLOAT and codes.dtype != torch.float8_e4m3fn:
            raise ConfigError(f"weight {name}.weight: float-quantized weights must be float8_e4m3fn, got {codes.dtype}")
        scales, group = _scales(scale, self.strategy, self.group_size, self.block, rows, cols, name)
        return Canonical(codes, scales, None, group, None, self.with_input_scale(parts))


def _scales(scale: torch.Tensor, strategy: str, group_size: int | None, block: tuple[int, int] | None,
            rows: int, cols: int, name: str) -> tuple[torch.Tensor, int]:
    """(scales [rows, groups], group) of an unpacked weight's scale tensor."""
    if strategy == "tensor":
        if scale.numel() != 1:
            raise ConfigError(f"weight {name}.weight_scale: per-tensor scale must hold one value, got "
                              f"{tuple(scale.shape)}")
        return scale.reshape(1, 1).expand(rows, 1).contiguous(), cols
    if strategy == "channel":
        if scale.numel() != rows:
            raise ConfigError(f"weight {name}.weight_scale: per-channel scale must hold {rows} values, got "
                              f"{tuple(scale.shape)}")
        return scale.reshape(rows, 1), cols
    if strategy == "block":
        assert block is not None
        bn, bk = block
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(scale.shape) != want:
            raise ConfigError(f"weight {name}.weight_scale: block scales of {bn}x{bk} must have shape {want}, got "
                              f"{tuple(scale.shape)}")
        return scale.repeat_interleave(bn, dim=0)[:rows].contiguous(), bk
    assert group_size is not None
    return scale.reshape(rows, -1), group_size


def _args(d: dict | None, what: str, group: str) -> dict | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"quantization_config.config_groups.{group}.{what}: expected an object")
    return d


def _act(args: dict | None, group: str) -> tuple[ActQuant | None, bool]:
    if args is None:
        return None, False
    kind = {("int", 8): "int8", ("float", 8): "fp8"}.get((args.get("type"), args.get("num_bits")))
    strategy = args.get("strategy")
    if kind is None or not args.get("symmetric", True) or strategy not in ("token", "tensor", "group"):
        raise ConfigError(f"quantization_config.config_groups.{group}.input_activations: unsupported scheme "
                          f"(type {args.get('type')!r}, {args.get('num_bits')} bits, strategy {strategy!r}, symmetric "
                          f"{args.get('symmetric', True)}); supported: int8 or fp8, symmetric, per token, group or "
                          "tensor")
    dynamic = bool(args.get("dynamic"))
    if strategy == "tensor" and dynamic:
        raise ConfigError(f"quantization_config.config_groups.{group}.input_activations: dynamic per-tensor "
                          "activations are not supported")
    if strategy in ("token", "group") and not dynamic:
        raise ConfigError(f"quantization_config.config_groups.{group}.input_activations: static per-{strategy} "
                          "activation scales are not supported")
    return ActQuant(kind, strategy, None, args.get("group_size")), strategy == "tensor"  # type: ignore[arg-type]


def _scheme(group: str, spec: dict, default_format: str | None) -> CompressedTensorsFormat:
    fmt = spec.get("format") or default_format
    w = _args(spec.get("weights"), "weights", group)
    if w is None:
        raise ConfigError(f"quantization_config.config_groups.{group}: no weights scheme (activation-only "
                          "quantization is not supported)")
    if spec.get("output_activations"):
        raise ConfigError(f"quantization_config.config_groups.{group}.output_activations: not supported")
    bits, wtype, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    name = f"{wtype} {bits}-bit {strategy} weights in format {fmt!r}"
    act, static = _act(_args(spec.get("input_activations"), "input_activations", group), group)
    actorder = w.get("actorder") == "group"
    block = tuple(w["block_structure"]) if w.get("block_structure") else None
    ok = ((fmt == _PACKED and wtype == "int" and bits in (4, 8) and strategy in ("group", "channel") and act is None)
          or (fmt in _INT and wtype == "int" and bits == 8 and strategy in ("channel", "tensor")
              and w.get("symmetric", True))
          or (fmt == _FLOAT and wtype == "float" and bits == 8 and strategy in ("channel", "tensor", "block")
              and w.get("symmetric", True)))
    if not ok:
        raise ConfigError(f"quantization_config.config_groups.{group}: unsupported compressed-tensors scheme ({name}"
                          f"{', with activations' if act else ''}); supported: pack-quantized int4/int8 weight-only "
                          "(group or channel), int-quantized int8 W8A8 (channel or tensor), float-quantized fp8 "
                          "(tensor, channel or block)")
    if strategy == "group" and not w.get("group_size"):
        raise ConfigError(f"quantization_config.config_groups.{group}.weights: group strategy without group_size")
    if strategy == "block" and (block is None or len(block) != 2):
        raise ConfigError(f"quantization_config.config_groups.{group}.weights: block strategy needs "
                          "block_structure [rows, cols]")
    if actorder and fmt != _PACKED:
        raise ConfigError(f"quantization_config.config_groups.{group}.weights: actorder 'group' only with "
                          "pack-quantized weights")
    return CompressedTensorsFormat(fmt, bits, strategy, w.get("group_size"), block,  # type: ignore[arg-type]
                                   bool(w.get("symmetric", True)), actorder, act, static)


def _matches(patterns: list[str], hf_name: str, cls_name: str) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], hf_name):
                return True
        elif p in (cls_name, hf_name) or hf_name.endswith("." + p):
            return True
    return False


class CompressedTensorsConfig:
    """The parsed ``quantization_config``: which scheme each checkpoint layer has."""

    name = "compressed-tensors"

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("sparsity_config"):
            raise ConfigError("quantization_config.sparsity_config: sparse compressed-tensors checkpoints are not "
                              "supported")
        if qc.get("transform_config"):
            raise ConfigError("quantization_config.transform_config: transformed (rotated) checkpoints are not "
                              "supported")
        status = qc.get("quantization_status")
        if status not in (None, "compressed", "frozen"):
            raise ConfigError(f"quantization_config.quantization_status: {status!r} checkpoints are not supported "
                              "(save them compressed)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ConfigError("quantization_config.config_groups: empty")
        self.groups = [(list(spec.get("targets") or []), _scheme(g, spec, qc.get("format")))
                       for g, spec in groups.items()]
        self.ignore: list[str] = list(qc.get("ignore") or [])
        if qc.get("kv_cache_scheme"):
            raise ConfigError("quantization_config.kv_cache_scheme: quantized KV caches from the checkpoint are not "
                              "supported (use kv_cache_dtype)")

    def layer_format(self, hf_name: str) -> CompressedTensorsFormat | None:
        if _matches(self.ignore, hf_name, "Linear"):
            return None
        for targets, scheme in self.groups:
            if _matches(targets, hf_name, "Linear"):
                return scheme
        return None
