"""The shared Triton multi-LoRA shrink/expand kernels (``TritonModelOps.lora_add``) against the per-row
float64 reference of test_lora_ops.py, in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1),
float32 and float16: mixed slots, base rows, different ranks per slot and projection, merged slices."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import (tests/conftest.py sets it for the whole run)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-test.txt)")

from lora_fixtures import OP_STEPS, op_case  # noqa: E402
from vllite_triton_kernels import TritonModelOps  # noqa: E402

from vllite_core.model_ops import ModelOps  # noqa: E402

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
