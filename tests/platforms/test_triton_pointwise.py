"""The shared Triton pointwise kernels (``TritonModelOps``: RMSNorm with and without the residual add, SiLU-and-mul,
the rotary embedding) against the torch defaults of ``ModelOps``, which round the same way.

No GPU here: Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors. float32 within float32 rounding, float16
within one unit in its last place (the exp/rsqrt differ from torch's). The interpreter truncates float32 to
bfloat16 (a GPU rounds to nearest), so bfloat16 is checked loosely here: the kernels' indexing and dtype flow,
not their rounding.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import (tests/conftest.py sets it for the whole run)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-test.txt)")

from vllite_triton_kernels import TritonModelOps  # noqa: E402

from model_registry.layers.rotary import RotaryEmbedding  # noqa: E402
from vllite_core.model_ops import ModelOps  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    elif want.dtype == torch.float16:  # one unit in the last place
        assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -10 + 1e-6)
    else:  # truncated by the interpreter: a few units in the last place, relative to the row's scale
        err = (got.float() - want.float()).abs()
        assert torch.all(err <= want.float().abs() * 2.0 ** -6 + want.float().abs().max() * 2.0 ** -7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 64), (3, 100)])
def test_rms_norm_and_residual_add(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    ops, ref = TritonModelOps(), ModelOps()
    close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    want_out, want_res = ref.add_rms_norm(x, res, w, 1e-6)
    xin, rin = x.clone(), res.clone()
    got_out, got_res = ops.add_rms_norm(xin, rin, w, 1e-6)
    if dtype == torch.bfloat16:
        close(got_res, want_res)
    else:
        assert torch.equal(got_res, want_res)  # one rounded add: exact
    assert got_out.data_ptr() == xin.data_ptr() and got_res.data_ptr() == rin.data_ptr()  # in place
    close(got_out, want_out)


def test_rms_norm_strided_rows():
    x = torch.randn(4, 2, 64)[:, 1]  # rows 128 apart
    w = torch.rand(64) + 0.5
    close(TritonModelOps().rms_norm(x, w, 1e-5), ModelOps().rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (4, 40)])
def test_silu_and_mul(dtype, rows, n):
    x = (torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype)
    close(TritonModelOps().silu_and_mul(x), ModelOps().silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (4, 4, 128), (3, 1, 16)])
def test_rotary_in_place(dtype, heads, kv_heads, head_size):
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(heads + head_size)
    t = 7
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_size, generator=g).to(dtype).view(t, -1, head_size)
    q, k, _ = qkv.split([heads, kv_heads, kv_heads], dim=1)  # strided views, as the attention layer has them
    cfg = LlamaConfig(hidden_size=heads * head_size, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_size, max_position_embeddings=64)
    cos, sin = RotaryEmbedding(cfg, head_size).lookup(torch.tensor([0, 1, 5, 9, 20, 33, 63]), dtype)
    want_q, want_k = ModelOps().rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = TritonModelOps().rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    close(got_q, want_q)
    close(got_k, want_k)


def test_shapes_the_kernels_do_not_take_fall_back():
    """Head size 80 (halves not a power of two), 3-D norm input, an odd silu width: the torch defaults."""
    ops, ref = TritonModelOps(), ModelOps()
    q, k = torch.randn(2, 4, 80), torch.randn(2, 2, 80)
    cos, sin = torch.randn(2, 80), torch.randn(2, 80)
    for got, want in zip(ops.rotary(q.clone(), k.clone(), cos, sin), ref.rotary(q, k, cos, sin)):
        assert torch.equal(got, want)
    x = torch.randn(2, 3, 64)
    w = torch.rand(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    y = torch.randn(3, 7)
    with pytest.raises(RuntimeError):  # the default's own error for an odd width
        ops.silu_and_mul(y)
