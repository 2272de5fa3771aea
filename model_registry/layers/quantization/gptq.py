"""``quant_method: "gptq"``: AutoGPTQ / GPTQModel checkpoints (``checkpoint_format`` "gptq", the v1 layout).

``quantization_config``: ``bits`` 4 or 8, ``group_size`` (-1: one group per row), ``desc_act``, ``sym``,
``lm_head`` (must be false), ``modules_to_not_convert``. Each quantized linear [N, K] stores ``qweight`` int32
[K * bits / 32, N] (codes packed along K: code k of column n at bit ``bits * (k % (32 / bits))`` of word
``k / (32 / bits)``), ``qzeros`` int32 [groups, N * bits / 32] (packed the same way along N; v1 stores each
zero point minus one), ``scales`` [groups, N] and ``g_idx`` int32 [K], the group of each input column (not
``k / group_size`` when ``desc_act`` quantized the columns in another order). Weight: ``(q - zero) * scale``.
Repacked once into ``QuantWeight`` with the columns sorted by group (``perm``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_registry.layers.quantization.compressed_tensors import unpack_int32
from model_registry.layers.quantization.prequant import Canonical
from vllite_core.errors import ConfigError


@dataclass(frozen=True)
class GPTQFormat:
    """The layers' GPTQ layout (a ``prequant.LayerFormat``)."""

    bits: int
    group_size: int  # -1: the whole row
    tensors: tuple[str, ...] = ("qweight", "qzeros", "scales", "g_idx")
    zero: int = 0
    act: None = None

    def int8_rows(self) -> bool:
        return False

    def canonical(self, parts: dict[str, torch.Tensor], rows: int, cols: int, name: str) -> Canonical:
        per = 32 // self.bits
        group = cols if self.group_size == -1 else self.group_size
        if cols % group:
            raise ConfigError(f"weight {name}: group size {group} does not divide its {cols} input columns")
        groups = cols // group
        q, z, s, g = parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]
        for what, t, shape in (("qweight", q, (-(-cols // per), rows)), ("qzeros", z, (groups, -(-rows // per))),
                               ("scales", s, (groups, rows)), ("g_idx", g, (cols,))):
            if tuple(t.shape) != shape:
                raise ConfigError(f"weight {name}.{what}: shape {tuple(t.shape)}, expected {shape} for {self.bits}-bit "
                                  f"groups of {group}")
        codes = unpack_int32(q.T.contiguous(), self.bits, cols)  # [N, K]
        zeros = (unpack_int32(z, self.bits, rows).float() + 1).T.contiguous()  # v1: stored minus one
        g_idx = g.long()
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ConfigError(f"weight {name}.g_idx: group indices must lie in [0, {groups})")
        return Canonical(codes, s.float().T.contiguous(), zeros, group, g_idx)


class GPTQConfig:
    """The parsed ``quantization_config`` of a GPTQ checkpoint."""

    name = "gptq"

    def __init__(self, qc: dict[str, Any]) -> None:
        bits = qc.get("bits")
        if bits not in (4, 8):
            raise ConfigError(f"quantization_config.bits: GPTQ with {bits} bits is not supported (4 or 8)")
        group = qc.get("group_size", -1)
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ConfigError(f"quantization_config.group_size: must be positive or -1, got {group!r}")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ConfigError(f"quantization_config.checkpoint_format: {fmt!r} GPTQ checkpoints are not supported "
                              "(only 'gptq', the v1 layout)")
        if qc.get("lm_head"):
            raise ConfigError("quantization_config.lm_head: a quantized LM head is not supported")
        self.format = GPTQFormat(bits, group)
        self.ignore = list(qc.get("modules_to_not_convert") or [])

    def layer_format(self, hf_name: str) -> GPTQFormat | None:
        if hf_name.endswith("lm_head") or any(p in hf_name for p in self.ignore):
            return None
        return self.format
