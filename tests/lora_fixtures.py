"""PEFT adapters for the LoRA tests: made with peft itself (the reference), saved in its format; and the
cases of the batched op's tests (test_lora_ops.py, test_triton_lora.py)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import torch

from vllite_core.lora.adapter import LoRAAdapter, ModuleUpdate
from vllite_core.lora.mapping import build_mapping
from vllite_core.lora.slots import LoRALayer

# Three adapters: different ranks, different target sets, one rslora.
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-ko-r2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"]),
}


def make_adapter(base, path, seed: int, scale: float = 1.0, **config):
    """A non-trivial random adapter on a copy of ``base`` (peft's init_lora_weights=False), saved to ``path``;
    returns the peft model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.save_pretrained(str(path))
    return model.eval()


# ---- the batched op: a fused "qkv" layer, four slots, steps mixing them with base rows -----------------
# Sizes that are not multiples of the kernels' vector width (tails), odd ranks.
IN, SLICES = 44, [(0, 24), (24, 32), (32, 44)]  # a fused "qkv" layer of 44 outputs: q 24, k 8, v 12
OUT = SLICES[-1][1]
MAX_RANK = 8


def _op_adapter(int_id: int, ranks: list[int], seed: int) -> LoRAAdapter:
    """Updates for the slices with a nonzero rank (scaling already folded into B, as the loader does)."""
    gen = torch.Generator().manual_seed(seed)
    ups = [ModuleUpdate(s, e, torch.randn(r, IN, generator=gen), torch.randn(e - s, r, generator=gen) * 0.5)
           for (s, e), r in zip(SLICES, ranks) if r]
    return LoRAAdapter(f"a{int_id}", int_id, "", max(ranks), "", {"qkv": ups} if ups else {})


# slot -> adapter: different ranks per slice, one adapting only q and v, one not adapting this layer at all.
OP_ADAPTERS = {0: _op_adapter(1, [8, 8, 8], 1), 1: _op_adapter(2, [4, 0, 2], 2),
               2: _op_adapter(3, [0, 0, 0], 3), 3: _op_adapter(4, [1, 3, 5], 4)}


def _op_layer(ops, dtype) -> LoRALayer:
    slots = SimpleNamespace(max_loras=len(OP_ADAPTERS), max_lora_rank=MAX_RANK, dtype=dtype,
                            device=torch.device("cpu"))
    layer = LoRALayer(slots, "qkv", IN, OUT, len(SLICES), ops)
    for slot, adapter in OP_ADAPTERS.items():
        layer.load(slot, adapter)
    return layer


def op_reference(x: torch.Tensor, y: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    want = y.double().clone()
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        for u in OP_ADAPTERS[s].modules.get("qkv", []):
            want[t, u.out_start:u.out_end] += u.lora_b.double() @ (u.lora_a.double() @ x[t].double())
    return want


OP_STEPS = {
    "mixed": [0, 3, -1, 1, 0, 0, -1, 3, 3, 2, 1, 0, -1, 3, 0, 1, 1, 0, 3],  # decode-like: rows interleaved
    "one-slot-all-rows": [3] * 11,  # every row one slot: no gather
    "grouped-prefills": [1] * 9 + [-1] * 5 + [0] * 7,  # chunked prefills side by side
    "base-and-unadapted": [-1, 2, 2, -1],  # slot 2 does not adapt this layer: y unchanged
}


def op_case(ops, dtype: torch.dtype, token_slots: list[int]):
    """(layer with every slot loaded and the step's mapping set, x, y, float64 reference of the updated y)."""
    gen = torch.Generator().manual_seed(len(token_slots))
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    y = torch.randn(len(token_slots), OUT, generator=gen).to(dtype)
    layer = _op_layer(ops, dtype)
    layer.slots.mapping = build_mapping(np.array(token_slots), len(OP_ADAPTERS), "cpu")
    return layer, x, y, op_reference(x, y, token_slots)
