"""``quant_method: "awq"``: AutoAWQ checkpoints in the GEMM layout (``version: "gemm"``).

``quantization_config``: ``bits`` 4, ``group_size``, ``zero_point`` true, ``modules_to_not_convert``. Each
quantized linear [N, K] stores ``qweight`` int32 [K, N / 8]: eight output columns a word, column
``8w + AWQ_ORDER[i]`` in bits ``4i`` of word ``w``; ``qzeros`` int32 [groups, N / 8] packed the same way;
``scales`` [groups, N]. Weight: ``(q - zero) * scale``. Repacked once into ``QuantWeight``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_registry.layers.quantization.compressed_tensors import unpack_int32
from model_registry.layers.quantization.prequant import Canonical
from vllite_core.errors import ConfigError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight


def unpack_awq(packed: torch.Tensor, count: int) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's column order -> uint8 [R, count] codes in plain column order."""
    nibbles = unpack_int32(packed, 4, packed.shape[1] * 8).view(packed.shape[0], -1, 8)
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(packed.shape[0], -1)[:, :count]


@dataclass(frozen=True)
class AWQFormat:
    """The layers' AWQ GEMM layout (a ``prequant.LayerFormat``)."""

    group_size: int
    bits: int = 4
    tensors: tuple[str, ...] = ("qweight", "qzeros", "scales")
    zero: int = 0
    act: None = None

    def int8_rows(self) -> bool:
        return False

    def canonical(self, parts: dict[str, torch.Tensor], rows: int, cols: int, name: str) -> Canonical:
        group = cols if self.group_size == -1 else self.group_size
        if cols % group:
            raise ConfigError(f"weight {name}: group size {group} does not divide its {cols} input columns")
        if rows % 8:
            raise ConfigError(f"weight {name}: AWQ packs output columns by 8, {rows} is not a multiple")
        groups = cols // group
        q, z, s = parts["qweight"], parts["qzeros"], parts["scales"]
        for what, t, shape in (("qweight", q, (cols, rows // 8)), ("qzeros", z, (groups, rows // 8)),
                               ("scales", s, (groups, rows))):
            if tuple(t.shape) != shape:
                raise ConfigError(f"weight {name}.{what}: shape {tuple(t.shape)}, expected {shape} for groups of "
                                  f"{group}")
        codes = unpack_awq(q, rows).T.contiguous()  # [N, K]
        zeros = unpack_awq(z, rows).float().T.contiguous()
        return Canonical(codes, s.float().T.contiguous(), zeros, group)


class AWQConfig:
    """The parsed ``quantization_config`` of an AWQ checkpoint."""

    name = "awq"

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("bits", qc.get("w_bit")) != 4:
            raise ConfigError(f"quantization_config.bits: AWQ with {qc.get('bits')} bits is not supported (4)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"quantization_config.version: AWQ {version!r} packing is not supported ('gemm')")
        if not qc.get("zero_point", True):
            raise ConfigError("quantization_config.zero_point: AWQ without zero points is not supported")
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ConfigError(f"quantization_config.group_size: must be positive or -1, got {group!r}")
        self.format = AWQFormat(group)
        self.ignore = list(qc.get("modules_to_not_convert") or [])

    def layer_format(self, hf_name: str) -> AWQFormat | None:
        if hf_name.endswith("lm_head") or any(p in hf_name for p in self.ignore):
            return None
        return self.format
