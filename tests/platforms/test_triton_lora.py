"""The shared Triton multi-LoRA shrink/expand kernels (``TritonModelOps.lora_add``) against the per-row
float64 reference of test_lora_ops.py, in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1),
float32 and float16: mixed slots, base rows, different ranks per slot and projection, merged slices; and
decode graphs with LoRA (the mapping's buffers refilled before each replay)."""
from __future__ import annotations

import os
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import (tests/conftest.py sets it for the whole run)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-test.txt)")

from lora_fixtures import IN, MAX_RANK, OP_ADAPTERS, OP_STEPS, OUT, SLICES, op_case, op_reference  # noqa: E402
from vllite_triton_kernels import TritonModelOps  # noqa: E402

from vllite_core.lora.mapping import build_mapping, fill_static, static_mapping  # noqa: E402
from vllite_core.lora.slots import LoRASlots  # noqa: E402
from vllite_core.model_ops import ModelOps  # noqa: E402
from vllite_core.platforms.graphs import capture_runners, decode_inputs, eager_capture  # noqa: E402
from vllite_core.worker.graph_runner import ModelForward  # noqa: E402

torch.set_num_threads(2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 4e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("step", OP_STEPS)
def test_triton_lora_add_matches_per_row_reference(dtype, tol, step, monkeypatch):
    monkeypatch.setattr(ModelOps, "lora_add", None)  # the kernels, never the torch fallback
    layer, x, y, want = op_case(TritonModelOps(block_n=16, block_k=16), dtype, OP_STEPS[step])
    got = layer(x, y.clone())
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item(), step
    base_rows = [t for t, s in enumerate(OP_STEPS[step]) if s in (-1, 2)]
    assert torch.equal(got[base_rows], y[base_rows])


def test_triton_lora_add_strided_input():
    """x as a column slice of a wider tensor (rows not contiguous): the kernel reads it through its stride."""
    layer, x, y, want = op_case(TritonModelOps(), torch.float32, OP_STEPS["mixed"])
    wide = torch.zeros(x.shape[0], x.shape[1] + 7)
    wide[:, 3:3 + x.shape[1]] = x
    got = layer(wide[:, 3:3 + x.shape[1]], y.clone())
    assert (got.double() - want).abs().max().item() <= 2e-5 * want.abs().max().item()


def test_static_mapping_is_refilled_in_place():
    """A captured graph calls the op with the host arguments of its capture and the same buffers: refilled
    in place with other steps' mappings (fewer rows, other slots, no adapted row), the kernels follow."""
    layer, _, _, _ = op_case(TritonModelOps(), torch.float32, OP_STEPS["mixed"])
    n = len(OP_STEPS["mixed"])
    layer.slots.mapping = static = static_mapping(n, len(OP_ADAPTERS), "cpu")
    x_buf, y_buf = torch.zeros(n, IN), torch.zeros(n, OUT)
    gen = torch.Generator().manual_seed(5)
    for slots in (OP_STEPS["mixed"], [1, 3, -1, 0] + [-1] * (n - 4), [2, -1] * (n // 2) + [-1], [-1] * n):
        fill_static(static, build_mapping(np.array(slots), len(OP_ADAPTERS), "cpu"))
        x_buf.copy_(torch.randn(n, IN, generator=gen))
        y_buf.copy_(torch.randn(n, OUT, generator=gen))
        want = op_reference(x_buf, y_buf, slots)
        got = layer(x_buf, y_buf)
        assert (got.double() - want).abs().max().item() <= 2e-5 * want.abs().max().item(), slots


class _OneLayerModel(torch.nn.Module):
    """A decode step through one adapted fused layer: token ids pick input rows, the base product is zero."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(IN, OUT, bias=False)
        self.qkv._ops = TritonModelOps()
        self.table = torch.randn(50, IN, generator=torch.Generator().manual_seed(9))

    def lora_targets(self):
        return {f"p{i}": ("qkv", s, e) for i, (s, e) in enumerate(SLICES)}

    def forward(self, input_ids, positions, kv_caches, metadata):
        x = self.table[input_ids]
        return self.qkv.lora(x, torch.zeros(x.shape[0], OUT))


def test_decode_graphs_with_lora_read_each_steps_adapters():
    """ModelForward captures decode sizes with LoRA on when the op is graph-safe, and before each replay
    writes the step's mapping into that size's buffers (eager_capture: replays re-run the step on the
    captured static buffers). Steps padded to a larger size, with different adapters, match the reference."""
    model = _OneLayerModel()
    slots = LoRASlots(model, len(OP_ADAPTERS), MAX_RANK, torch.float32, torch.device("cpu"))
    slots.activate(list(OP_ADAPTERS.values()))  # lora_int_id 1..4 -> slots 0..3 (the fixtures' slot keys)
    assert slots.graph_safe
    forward = ModelForward(model, SimpleNamespace(prepare=lambda md: None), 1)
    forward.lora = slots
    config = SimpleNamespace(enforce_eager=False, lora_config=object(),
                             scheduler_config=SimpleNamespace(max_num_seqs=8),
                             cache_config=SimpleNamespace(calculate_kv_scales=False),
                             model_config=SimpleNamespace(capabilities=SimpleNamespace(is_stateful=False)))
    platform = SimpleNamespace(capture_graphs=lambda fwd, sizes, make_inputs, cfg: capture_runners(
        fwd, sizes, make_inputs, eager_capture))
    kv = [torch.zeros(2, 4, 16, 1, 8)]
    forward.capture(platform, config, kv, 1, 16, 64, torch.device("cpu"))
    assert forward.sizes == [1, 2, 4, 8] and slots.mapping is None
    for token_slots in ([3, -1, 0, 1, 3], [1, 1, 2, -1, 0, 3, 0], [-1, -1, -1]):
        n = len(token_slots)
        ids = torch.arange(n) * 3 + 1
        slots.set_step(np.array(token_slots))
        md = decode_inputs(n, 4, kv, 16, "cpu")["metadata"]
        got = forward(ids, torch.zeros(n, dtype=torch.long), kv, [md])
        want = op_reference(model.table[ids], torch.zeros(n, OUT), token_slots)
        assert (got.double() - want).abs().max().item() <= 2e-5 * want.abs().max().clamp(min=1).item(), token_slots
    assert forward.graph_steps == 3 and forward.eager_steps == 0
