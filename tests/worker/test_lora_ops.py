"""The batched multi-LoRA op (``ModelOps.lora_add`` and the CPU platform's C++ kernel) against a per-row
float64 reference computed from the adapters' own A/B matrices, one projection at a time.

The stacked slot tensors are filled by ``LoRALayer.load`` (the engine's packing of fused q/k/v into one
shrink and one expand), so the reference also checks that packing: mixed slots, rows of the base model,
different ranks per projection and per slot, a slot that does not adapt the layer, merged slices."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_fixtures import OP_ADAPTERS, OP_STEPS, op_case

from vllite_core.lora.mapping import build_mapping, static_mapping
from vllite_core.model_ops import ModelOps

torch.set_num_threads(2)


def _ops() -> list:
    ops = [pytest.param(ModelOps(), id="torch")]
    try:
        from vllite_platform_cpu import kernels
        from vllite_platform_cpu.model_ops import CpuModelOps
    except ImportError:
        return ops
    if kernels.available():
        ops.append(pytest.param(CpuModelOps(fused=True, packed_linear=False), id="cpu-kernel"))
    return ops


@pytest.mark.parametrize("ops", _ops())
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("step", OP_STEPS)
def test_lora_add_matches_per_row_reference(ops, dtype, tol, step, monkeypatch):
    if type(ops) is not ModelOps:
        monkeypatch.setattr(ModelOps, "lora_add", None)  # a platform's kernel, never the torch fallback
    layer, x, y, want = op_case(ops, dtype, OP_STEPS[step])
    with torch.inference_mode():  # as the engine runs
        got = layer(x, y.clone())
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item(), step
    base_rows = [t for t, s in enumerate(OP_STEPS[step]) if s in (-1, 2)]
    assert torch.equal(got[base_rows], y[base_rows])  # rows without an update are left bit-identical


def test_no_adapted_rows_is_no_mapping():
    assert build_mapping(np.array([-1, -1, -1]), 4, "cpu") is None


def test_mapping_groups_rows_by_slot():
    m = build_mapping(np.array([2, -1, 0, 2, 0, 3]), 4, "cpu")
    assert m.order.tolist() == [2, 4, 0, 3, 5] and not m.identity
    assert m.segments == [(0, 0, 2), (2, 2, 4), (3, 4, 5)]
    assert m.seg_start.tolist() == [0, 0, 2, 4] and m.seg_len.tolist() == [2, 0, 2, 1]
    assert build_mapping(np.array([1, 1, 3]), 4, "cpu").identity


@pytest.mark.parametrize("ops", _ops())
def test_static_mapping_needs_a_graph_safe_op(ops):
    """These ops read the mapping's host lists: under a captured graph they would replay a stale step, so a
    graph's static mapping is refused (and ModelForward captures nothing for them)."""
    layer, x, y, _ = op_case(ops, torch.float32, OP_STEPS["mixed"])
    layer.slots.mapping = static_mapping(x.shape[0], len(OP_ADAPTERS), "cpu")
    assert not ops.lora_graph_safe
    with torch.inference_mode(), pytest.raises(RuntimeError, match="lora_graph_safe"):
        layer(x, y)
