"""``quant_method: "fp8"``: float8 e4m3 weights as Qwen3-FP8 and DeepSeek-V3 publish them (and vLLM's fp8
checkpoints).

``quantization_config``: ``activation_scheme`` ``dynamic`` or ``static``; ``weight_block_size`` [bn, bk]
(128x128 in those models) or none; ``ignored_layers`` / ``modules_to_not_convert`` left in float. Each
quantized linear stores ``weight`` float8_e4m3fn [N, K] and its scales: ``weight_scale_inv`` [ceil(N / bn),
ceil(K / bk)] with a block size (despite the name, the factor the weight is multiplied by), else
``weight_scale`` per tensor ([] or [1]) or per output channel ([N] or [N, 1]); ``input_scale`` with static
activations. Activations: dynamic per token, per token and group of ``bk`` columns with block scales (as the
block-scaled models were trained), or the static per-tensor scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_registry.layers.quantization.prequant import Canonical
from model_registry.layers.quantization.quant_weight import ActQuant
from vllite_core.errors import ConfigError


@dataclass(frozen=True)
class Fp8Format:
    """The layers' fp8 layout (a ``prequant.LayerFormat``)."""

    block: tuple[int, int] | None
    static: bool
    bits: int = 8
    zero: int = 0

    @property
    def tensors(self) -> tuple[str, ...]:
        return ("weight", "weight_scale_inv" if self.block else "weight_scale") + (
            ("input_scale",) if self.static else ())

    @property
    def act(self) -> ActQuant | None:
        if self.static:
            return None  # per layer, from its input_scale (Canonical.act)
        if self.block:
            return ActQuant("fp8", "group", None, self.block[1])
        return ActQuant("fp8", "token")

    def int8_rows(self) -> bool:
        return False

    def canonical(self, parts: dict[str, torch.Tensor], rows: int, cols: int, name: str) -> Canonical:
        w = parts["weight"]
        if w.dtype != torch.float8_e4m3fn:
            raise ConfigError(f"weight {name}.weight: fp8 checkpoints hold float8_e4m3fn weights, got {w.dtype}")
        act = None
        if self.static:
            act = ActQuant("fp8", "tensor", parts["input_scale"].float().reshape(-1)[:1].clone())
        if self.block:
            bn, bk = self.block
            s = parts["weight_scale_inv"].float()
            want = (-(-rows // bn), -(-cols // bk))
            if tuple(s.shape) != want:
                raise ConfigError(f"weight {name}.weight_scale_inv: block scales of {bn}x{bk} must have shape "
                                  f"{want}, got {tuple(s.shape)}")
            if cols % bk:
                raise ConfigError(f"weight {name}: {cols} input columns are not whole blocks of {bk}")
            return Canonical(w, s.repeat_interleave(bn, dim=0)[:rows].contiguous(), None, bk, None, act)
        s = parts["weight_scale"].float().reshape(-1)
        if s.numel() == 1:
            return Canonical(w, s.reshape(1, 1).expand(rows, 1).contiguous(), None, cols, None, act)
        if s.numel() == rows:
            return Canonical(w, s.reshape(rows, 1).contiguous(), None, cols, None, act)
        raise ConfigError(f"weight {name}.weight_scale: expected one scale or {rows} (one per output channel), got "
                          f"{tuple(parts['weight_scale'].shape)}")


class Fp8Config:
    """The parsed ``quantization_config`` of an fp8 checkpoint."""

    name = "fp8"

    def __init__(self, qc: dict[str, Any]) -> None:
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"quantization_config.activation_scheme: must be 'dynamic' or 'static', got {scheme!r}")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"quantization_config.fmt: only e4m3 fp8 weights are supported, got {fmt!r}")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ConfigError(f"quantization_config.weight_block_size: expected [rows, cols], got {block!r}")
        if block is not None and scheme == "static":
            raise ConfigError("quantization_config: block-scaled fp8 weights need dynamic activations")
        self.format = Fp8Format(tuple(block) if block else None, scheme == "static")  # type: ignore[arg-type]
        self.ignore = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])

    def layer_format(self, hf_name: str) -> Fp8Format | None:
        if any(hf_name == p or hf_name.startswith(p + ".") or hf_name.endswith("." + p) for p in self.ignore):
            return None
        return None if hf_name.endswith("lm_head") else self.format
