"""Device-side adapter slots and the per-step token mapping the LoRA layers read.

Every adapted engine layer owns stacked ``lora_a`` [max_loras, R, in] and ``lora_b``
[max_loras, R, out] (B transposed) tensors (R = max_lora_rank times the projections fused in the
layer: 3 for qkv, 2 for gate/up). A slot holds one adapter: its projections' A rows packed one after
another and their B rows placed at each projection's output columns, the rest zero, so one shrink and
one expand per slot cover the fused layer. B is stored transposed so that a slot's first ``r`` rank
rows are contiguous in both tensors and the expand is a row update (axpy) per rank. Slots are handed
out least-recently-used first. Each step the runner says which slot every token uses (-1: the base
model); the step's ``LoRAMapping`` (tokens grouped by slot) is built once and every layer adds
``x[t] A_s^T B_s^T`` to its base output through the platform's ``ModelOps.lora_add``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from vllite_core.lora.adapter import LoRAAdapter
from vllite_core.lora.mapping import LoRAMapping, build_mapping, fill_static, static_mapping
from vllite_core.lora.registry import layer_widths
from vllite_core.model_ops import current_model_ops


class LoRALayer:
    """Attached to one engine linear layer (``module.lora``): adds the active slots' updates to its output."""

    def __init__(self, slots: "LoRASlots", key: str, in_features: int, out_features: int, num_fused: int,
                 ops: Any = None) -> None:
        self.slots = slots
        self.key = key
        cap = num_fused * slots.max_lora_rank
        self.lora_a = torch.zeros(slots.max_loras, cap, in_features, dtype=slots.dtype, device=slots.device)
        self.lora_b = torch.zeros(slots.max_loras, cap, out_features, dtype=slots.dtype, device=slots.device)
        self.rank = [0] * slots.max_loras  # packed rank of each slot in this layer (0: not adapted)
        self.ops = ops or current_model_ops()  # the platform's ops the layer was built with

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = self.slots.mapping
        if m is None or (not m.static and not any(self.rank[s] for s in m.slots)):
            return y
        return self.ops.lora_add(y, x, self.lora_a, self.lora_b, self.rank, m)

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        ups = adapter.modules.get(self.key, [])
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        r0 = 0
        for u in ups:
            r = u.lora_a.shape[0]
            self.lora_a[slot, r0:r0 + r].copy_(u.lora_a)
            self.lora_b[slot, r0:r0 + r, u.out_start:u.out_end].copy_(u.lora_b.T)
            r0 += r
        self.rank[slot] = r0


class LoRASlots:
    """``max_loras`` device slots over the model's adaptable layers, LRU-replaced."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.resident: dict[int, LoRAAdapter] = {}  # what each slot holds (an id loaded again is loaded anew)
        self.mapping: LoRAMapping | None = None  # this step's tokens grouped by slot (None: no adapted token)
        self.layers: list[LoRALayer] = []
        fused: dict[str, int] = {}
        for _, (engine_name, _, _) in model.lora_targets().items():
            fused[engine_name] = fused.get(engine_name, 0) + 1
        modules = dict(model.named_modules())
        for engine_name, n in fused.items():
            mod = modules[engine_name]
            out_f, in_f = layer_widths(mod)
            layer = LoRALayer(self, engine_name, in_f, out_f, n, getattr(mod, "_ops", None))
            mod.lora = layer
            self.layers.append(layer)
        self.loads = 0
        self.static: dict[int, LoRAMapping] = {}  # captured decode batch size -> its graph's mapping buffers

    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Make every adapter of the step resident (at most ``max_loras``); lora_int_id -> slot."""
        wanted = {a.int_id: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras={self.max_loras}")
        for int_id, adapter in wanted.items():
            if int_id in self.slot_of and self.resident[int_id] is adapter:
                self.slot_of.move_to_end(int_id)
        for int_id, adapter in wanted.items():
            if int_id in self.slot_of and self.resident[int_id] is adapter:
                continue
            if int_id in self.slot_of:  # reloaded under the same id: its slot is rewritten
                self.slot_of.pop(int_id)
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slot_of if i not in wanted)
                slot = self.slot_of.pop(victim)
                del self.resident[victim]
            for layer in self.layers:
                layer.load(slot, adapter)
            self.slot_of[int_id] = slot
            self.resident[int_id] = adapter
            self.loads += 1
        return {i: self.slot_of[i] for i in wanted}

    def set_rows(self, adapters: list[LoRAAdapter | None], req_idx: np.ndarray) -> None:
        """The step's requests' adapters (in row order) and each token's request: make the adapters
        resident and group the tokens by slot."""
        slot_of = self.activate([a for a in adapters if a is not None])
        row_slots = np.array([slot_of[a.int_id] if a is not None else -1 for a in adapters], dtype=np.int64)
        self.set_step(row_slots[req_idx])

    def set_step(self, token_slots: np.ndarray) -> None:
        """Group the step's tokens by slot (-1: base model, no update)."""
        self.mapping = build_mapping(token_slots, self.max_loras, self.device)

    def clear_step(self) -> None:
        self.mapping = None

    # ---- decode graphs: only where every layer's op reads the mapping from device tensors alone -------
    @property
    def graph_safe(self) -> bool:
        return all(getattr(layer.ops, "lora_graph_safe", False) for layer in self.layers)

    def _static(self, batch_size: int) -> LoRAMapping:
        if batch_size not in self.static:
            self.static[batch_size] = static_mapping(batch_size, self.max_loras, self.device)
        return self.static[batch_size]

    def use_static(self, batch_size: int) -> None:
        """Point the layers at the buffers of the graph of ``batch_size`` rows (captured or replayed)."""
        self.mapping = self._static(batch_size)

    def fill_static(self, batch_size: int) -> None:
        """Before a replay: copy this step's mapping (set by ``set_rows``) into that graph's buffers."""
        fill_static(self._static(batch_size), self.mapping)

    def describe(self) -> dict[str, Any]:
        return {"max_loras": self.max_loras, "resident": list(self.slot_of), "loads": self.loads}
