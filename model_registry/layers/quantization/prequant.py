"""Loading a pre-quantized checkpoint's linear layers: the seam between a format and the layers.

Before the weights stream in, each quantized linear layer drops its float ``weight`` and gets one empty
placeholder parameter per tensor its format stores (``weight_packed``, ``weight_scale``, ``qweight``,
``scales``...): the model's own ``load_weights`` routes checkpoint names to them as to any parameter (fused
q/k/v and gate/up shards included), and their loader keeps each shard's tensor whole. After loading, the format
turns each shard's tensors into a ``Canonical`` (unpacked codes, scales and zero points per output row, full
width), this rank's rows and columns are cut and the shards stacked, then repacked once as the method's
``QuantWeight`` (or, for int8 W8A8 with dynamic per-token activations, the int8 rows of the existing W8A8
kernels). A format only parses its own tensors: slicing for tensor parallelism and fusing shards happen here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import torch
from torch import nn

from model_registry.layers.linear import LinearBase, RowParallelLinear
from model_registry.layers.quantization.base import LinearLike, LinearMethod
from model_registry.layers.quantization.quant_weight import ActQuant, QuantWeight, pack_int4
from vllite_core.errors import ConfigError


@dataclass
class Canonical:
    """One checkpoint tensor's weight [N, K] unpacked: ``codes`` [N, K] (uint8 unsigned, int8 signed or float8),
    ``scales`` float32 [N, groups], ``zeros`` float32 [N, groups] or None, ``g_idx`` int64 [K] (the group of each
    column; None: column // group); ``act``: the static activation scale's ``ActQuant`` (None: the format's)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    g_idx: torch.Tensor | None = None
    act: ActQuant | None = None  # this layer's activations with their static scale, where the format has one


class LayerFormat(Protocol):
    """What a checkpoint format says about one linear layer."""

    tensors: tuple[str, ...]  # the suffixes it stores beside the layer's name (all required)
    bits: int
    zero: int  # the symmetric zero point of its codes
    act: ActQuant | None

    def canonical(self, parts: dict[str, torch.Tensor], rows: int, cols: int, name: str) -> Canonical:
        """One checkpoint tensor's weight (``parts``: suffix -> tensor; [rows, cols] the float weight's shape;
        ``name``: the checkpoint's layer name, for errors) unpacked."""
        ...

    def int8_rows(self) -> bool:
        """True when the layer runs on the int8 W8A8 kernels (int8 codes per row, dynamic per-token int8
        activations) instead of ``QuantWeight``."""
        ...


class PrequantLinearMethod(LinearMethod):
    """A pre-quantized layer: collects its checkpoint tensors while loading, then computes from its
    ``QuantWeight`` through ``ModelOps.quant_linear``."""

    name: ClassVar[str] = "prequantized"

    def __init__(self, fmt: LayerFormat, checkpoint_names: dict[str | None, str], module_name: str = "") -> None:
        self.fmt = fmt
        self.module_name = module_name
        self.checkpoint_names = checkpoint_names  # shard -> the checkpoint's layer name (for errors)
        self.parts: dict[str | None, dict[str, torch.Tensor]] = {}
        self.weight: QuantWeight | None = None
        self.done = False  # repacked (process_weights_after_loading ran)

    # ---- before loading --------------------------------------------------------------------------------

    def create_weights(self, layer: LinearBase) -> None:
        """Replace the float weight by placeholders that keep what the checkpoint gives them."""
        layer.register_parameter("weight", None)  # the repacked codes take its place after loading
        for suffix in self.fmt.tensors:
            p = nn.Parameter(torch.empty(0), requires_grad=False)
            p.weight_loader = self._collector(suffix, layer)  # type: ignore[attr-defined]
            layer.register_parameter(suffix, p)
        layer.quant_method = self

    def _collector(self, suffix: str,
                   layer: LinearBase) -> Callable[[torch.Tensor, torch.Tensor, str | None, str], None]:
        def collect(param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
            if shard is None and len(self.checkpoint_names) > 1:
                raise ConfigError(f"weight {name}: a stacked pre-quantized tensor is not supported; the checkpoint "
                                  f"must hold {', '.join(str(s) for s in self.checkpoint_names)} separately")
            if self.done:
                raise ConfigError(f"weight {name}: the checkpoint gives it twice")
            self.parts.setdefault(shard, {})[suffix] = src
            # Repacked as soon as its last tensor arrives: the checkpoint's copies of one layer at a time are
            # held (the file's pages are let go as loading moves on), not the whole file's until the end.
            if all(set(self.fmt.tensors) <= set(self.parts.get(s, ())) for s in self.checkpoint_names):
                self.process_weights_after_loading(layer)
        return collect

    # ---- after loading ---------------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Unpack each shard, keep this rank's part, repack once; the placeholders go."""
        out_local, in_local = layer.local_features
        segments = getattr(layer, "segments", None) or {None: None}
        pieces: list[Canonical] = []
        for shard, seg in sorted(segments.items(), key=lambda kv: kv[1].dst_start if kv[1] else 0):
            name = self.checkpoint_names[shard]
            parts = self.parts.get(shard, {})
            missing = [s for s in self.fmt.tensors if s not in parts]
            if missing:
                raise ConfigError(f"weight {name}: the checkpoint has no {', '.join(name + '.' + s for s in missing)}")
            rows = seg.full if seg is not None else out_local
            cols = layer.in_features if isinstance(layer, RowParallelLinear) else in_local
            c = self.fmt.canonical(parts, rows, cols, name)
            _check(c, rows, cols, name)
            if seg is not None:
                c = _rows(c, seg.src_start, seg.src_start + seg.length)
            pieces.append(c)
        c = pieces[0] if len(pieces) == 1 else _stack(pieces, self.checkpoint_names)
        if isinstance(layer, RowParallelLinear) and layer.in_range != (0, layer.in_features):
            c = _columns(c, *layer.in_range, self.checkpoint_names[None])
        sources = [t for shard in self.parts.values() for t in shard.values()]
        for suffix in self.fmt.tensors:
            delattr(layer, suffix)
        self.parts = {}
        self.done = True
        if self.fmt.int8_rows():
            from model_registry.layers.quantization.int8 import Int8LinearMethod

            layer.weight = nn.Parameter(_owned(c.codes.to(torch.int8).contiguous(), sources), requires_grad=False)
            layer.set_quant_method(Int8LinearMethod(_owned(c.scales.reshape(-1).float().contiguous(), sources)))
            return
        w = _repack(c, self.fmt)
        self.weight = replace(w, codes=_owned(w.codes, sources), scales=_owned(w.scales, sources),
                              zeros=None if w.zeros is None else _owned(w.zeros, sources))
        layer.weight = nn.Parameter(self.weight.codes, requires_grad=False)
        layer.set_quant_method(self)

    def apply(self, layer: LinearLike, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.weight is not None
        return layer.ops.quant_linear(x, self.weight, bias, layer.state)

    def weight_bytes(self, layer: LinearLike) -> int:
        return 0 if self.weight is None else self.weight.nbytes()


def _owned(t: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """``t``, copied when it shares memory with a checkpoint tensor: safetensors hands out views of the file's
    mapping, and one kept view keeps the whole file mapped (resident pages the process's RSS counts)."""
    ptr = t.untyped_storage().data_ptr()
    return t.clone() if any(s.untyped_storage().data_ptr() == ptr for s in sources) else t


def _check(c: Canonical, rows: int, cols: int, name: str) -> None:
    if tuple(c.codes.shape) != (rows, cols):
        raise ConfigError(f"weight {name}: quantized weight has shape {tuple(c.codes.shape)}, the model expects "
                          f"({rows}, {cols})")
    groups = -(-cols // c.group)
    for what, t in (("scale", c.scales), ("zero point", c.zeros)):
        if t is not None and tuple(t.shape) != (rows, groups):
            raise ConfigError(f"weight {name}: {what} has shape {tuple(t.shape)}, expected ({rows}, {groups}) for "
                              f"groups of {c.group} columns")


def _rows(c: Canonical, lo: int, hi: int) -> Canonical:
    return Canonical(c.codes[lo:hi], c.scales[lo:hi], None if c.zeros is None else c.zeros[lo:hi], c.group, c.g_idx,
                     c.act)


def _stack(pieces: list[Canonical], names: dict[str | None, str]) -> Canonical:
    first = pieces[0]
    same_idx = all((p.g_idx is None) == (first.g_idx is None) and
                   (p.g_idx is None or torch.equal(p.g_idx, first.g_idx)) for p in pieces)
    if not same_idx or any(p.group != first.group for p in pieces) or \
            any((p.zeros is None) != (first.zeros is None) for p in pieces):
        raise ConfigError(f"weights {', '.join(names.values())}: fused into one layer, they must share group size, "
                          "zero points and column order")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in pieces])
    act = first.act
    if act is not None and act.scale is not None:  # one static input scale for the fused input: the largest
        act = replace(act, scale=torch.stack([p.act.scale.reshape(()) for p in pieces if p.act is not None
                                              and p.act.scale is not None]).max().reshape(1))
    return Canonical(torch.cat([p.codes for p in pieces]), torch.cat([p.scales for p in pieces]), zeros,
                     first.group, first.g_idx, act)


def _columns(c: Canonical, lo: int, hi: int, name: str) -> Canonical:
    """Input columns [lo, hi) of a row-parallel rank: whole groups (or any columns with a ``g_idx``)."""
    if c.g_idx is not None:
        return Canonical(c.codes[:, lo:hi], c.scales, c.zeros, c.group, c.g_idx[lo:hi], c.act)
    if lo % c.group or (hi % c.group and hi != c.codes.shape[1]):
        raise ConfigError(f"weight {name}: this rank's columns [{lo}, {hi}) do not fall on groups of {c.group}")
    g0, g1 = lo // c.group, -(-hi // c.group)
    return Canonical(c.codes[:, lo:hi], c.scales[:, g0:g1], None if c.zeros is None else c.zeros[:, g0:g1], c.group,
                     None, c.act)


def _repack(c: Canonical, fmt: LayerFormat) -> QuantWeight:
    """The ``QuantWeight`` of a canonical weight: columns sorted by group when a ``g_idx`` is not plain."""
    codes, scales, zeros, group, perm = c.codes, c.scales, c.zeros, c.group, None
    k = codes.shape[1]
    if c.g_idx is not None:
        g_idx = c.g_idx.long()
        order = torch.argsort(g_idx, stable=True)
        sorted_idx = g_idx[order]
        plain = torch.arange(k) // group
        if not torch.equal(order, torch.arange(k)):
            perm = order
            codes = codes[:, order]
        if not torch.equal(sorted_idx, plain):
            # Groups of unequal sizes: one scale column per stored column (the reference handles any layout).
            scales = scales[:, sorted_idx]
            zeros = None if zeros is None else zeros[:, sorted_idx]
            group = 1
    if fmt.bits == 4:
        if k % 2:
            raise ConfigError(f"4-bit weights need an even number of input columns, got {k}")
        codes = pack_int4(codes)
    return QuantWeight(codes.contiguous(), scales.float().contiguous(),
                       None if zeros is None else zeros.float().contiguous(), fmt.bits, group,
                       c.codes.shape[0], k, fmt.zero, perm, c.act or fmt.act)
