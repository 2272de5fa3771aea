"""FP8 KV caches: the quantising write, and every CPU-side attention path reading float8 caches.

The reference is float64 attention over the *same bytes* the backend left in the cache (dequantised as
``stored * scale``), so what is checked is the read (conversion in registers, scale folding, chunking,
GQA, partial blocks), not fp8 rounding. The write is checked byte for byte against torch's own cast of
``x / scale`` saturated to the format's range.
"""
from __future__ import annotations

import random

import pytest
import torch

from vllite_core.attention.kv_quant import KVScales, fp8_max, kv_scale_name, quantize
from vllite_core.attention.reference import build_metadata
from vllite_core.attention.sdpa import SdpaPagedAttention
from vllite_core.errors import ConfigError

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.37, 1.9


def test_quantize_divides_and_saturates():
    x = torch.tensor([0.0, 1.0, -3.0, 1000.0, -1e9, float("inf")])
    q = quantize(x, torch.float8_e4m3fn, 2.0)
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().tolist() == [0.0, 0.5, -1.5, 448.0, -448.0, 448.0]  # 500 and beyond saturate to 448
    assert quantize(torch.tensor([1e6]), torch.float8_e5m2).float().item() == 57344.0
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert quantize(x[:3], torch.bfloat16, 2.0).tolist() == [0.0, 1.0, -3.0]  # no scaling outside fp8
    # ROCm MI300's fnuz encodings (kv_cache_torch_dtype there) saturate at their own maxima.
    assert quantize(torch.tensor([1e4, -1e4]), torch.float8_e4m3fnuz).float().tolist() == [240.0, -240.0]
    assert quantize(torch.tensor([1e6]), torch.float8_e5m2fnuz).float().item() == 57344.0


def test_checkpoint_scale_names_and_bad_values():
    assert kv_scale_name("model.layers.7.self_attn.k_scale") == ("model.layers.7.self_attn", "k")
    assert kv_scale_name("model.layers.7.self_attn.kv_scale") == ("model.layers.7.self_attn", "kv")
    assert kv_scale_name("model.layers.7.self_attn.v_proj.output_scale") == ("model.layers.7.self_attn", "v")
    assert kv_scale_name("model.layers.7.self_attn.k_proj.weight") is None
    s = KVScales()
    s.set_from_checkpoint("kv", torch.tensor([0.5]), "model.layers.0.self_attn")
    assert (s.k_scale, s.v_scale) == (0.5, 0.5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="model.layers.3.self_attn.*k_scale"):
            KVScales().set_from_checkpoint("k", torch.tensor(bad), "model.layers.3.self_attn")
    with pytest.raises(ConfigError, match="per tensor"):
        KVScales().set_from_checkpoint("v", torch.ones(3), "model.layers.3.self_attn")


# (query_len, seq_len) per request: long decodes (several 256-key chunks of the kernel), a decode ending
# in a partial block, a chunked prefill over a long cached prefix, a prefill with no prefix.
REQUESTS = [(1, 700), (1, 33), (20, 300), (5, 5), (1, 257)]


def _case(head_size: int, num_heads: int = 6, num_kv_heads: int = 2, block_size: int = 16, seed: int = 0,
          cache_dtype: torch.dtype = torch.float8_e4m3fn, dtype: torch.dtype = torch.float32,
          requests: list[tuple[int, int]] = REQUESTS):
    """A step over a random (non-contiguous) block table whose cached context is random fp8 values."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for _, s in requests]
    num_blocks = sum(need) + 8
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    md = build_metadata([q for q, _ in requests], [s for _, s in requests], tables, block_size)
    t = md.num_actual_tokens
    q = torch.randn(t, num_heads, head_size, generator=gen).to(dtype)
    k = (torch.randn(t, num_kv_heads, head_size, generator=gen) * 2).to(dtype)
    v = (torch.randn(t, num_kv_heads, head_size, generator=gen) * 2).to(dtype)
    cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen) * 3).to(cache_dtype)
    return md, q, k, v, cache


def _reference(q: torch.Tensor, cache: torch.Tensor, md, scale: float, k_scale: float, v_scale: float):
    """float64 causal attention over the cache's bytes read as ``stored * scale``."""
    kc, vc = cache[0].double() * k_scale, cache[1].double() * v_scale
    bs, hkv = cache.shape[2], cache.shape[3]
    g = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, seq_len in enumerate(md.seq_lens_cpu):
        q0, q1 = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1]
        blocks = md.block_table[r, :-(-seq_len // bs)].long()
        k = kc[blocks].reshape(-1, hkv, q.shape[2])[:seq_len].repeat_interleave(g, dim=1)  # [L, H, D]
        v = vc[blocks].reshape(-1, hkv, q.shape[2])[:seq_len].repeat_interleave(g, dim=1)
        for j in range(q1 - q0):
            pos = seq_len - (q1 - q0) + j
            s = torch.einsum("hd,lhd->hl", q[q0 + j].double(), k[:pos + 1]) * scale
            out[q0 + j] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v[:pos + 1])
    return out


def _check_written(cache: torch.Tensor, md, k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float):
    flat_k = cache[0].reshape(-1, *cache.shape[-2:]).view(torch.uint8)
    flat_v = cache[1].reshape(-1, *cache.shape[-2:]).view(torch.uint8)
    slots = md.slot_mapping
    limit = fp8_max(cache.dtype)
    want_k = (k.double() / k_scale).clamp(-limit, limit).to(cache.dtype).view(torch.uint8)
    want_v = (v.double() / v_scale).clamp(-limit, limit).to(cache.dtype).view(torch.uint8)
    assert torch.equal(flat_k[slots], want_k) and torch.equal(flat_v[slots], want_v)


def _tolerance(dtype: torch.dtype) -> dict:
    # float32 queries: float32 sums over up to 700 keys; bfloat16: the output is rounded to bfloat16
    # (8 bits of mantissa) and so is the query the kernel reads.
    return dict(atol=2e-5, rtol=2e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _cpu_backend():
    attention = pytest.importorskip("vllite_platform_cpu.attention")
    return attention


@pytest.mark.parametrize("cache_dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_size", [64, 40], ids=["d64-vector", "d40-scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_kernel_reads_fp8_cache(cache_dtype, head_size, dtype):
    """The C++ kernel through the CPU backend: decode rows (streaming path), prefill tiles, both formats."""
    attention = _cpu_backend()
    from vllite_platform_cpu import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels unavailable: {kernels.error()}")
    md, q, k, v, cache = _case(head_size, cache_dtype=cache_dtype, dtype=dtype)
    backend = attention.TorchPagedAttention()
    backend.prepare(md)
    assert md.extra.kernel_args is not None
    out = backend.forward(q, k, v, cache, md, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    _check_written(cache, md, k, v, K_SCALE, V_SCALE)
    ref = _reference(q, cache, md, 0.125, K_SCALE, V_SCALE)
    torch.testing.assert_close(out.double(), ref, **_tolerance(dtype))


@pytest.mark.parametrize("cache_dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_cpu_kernel_every_variant(cache_dtype):
    """Each ISA variant this CPU runs (the default one converts lane by lane, AVX2 / AVX-512 through
    float16 bit patterns): same answer as the float64 reference."""
    from vllite_platform_cpu import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels unavailable: {kernels.error()}")
    md, q, k, v, cache = _case(64, cache_dtype=cache_dtype, seed=1)
    attention = _cpu_backend()
    attention.TorchPagedAttention().forward(q, k, v, cache, md, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = _reference(q, cache, md, 0.125, K_SCALE, V_SCALE)
    args = (md.block_table.int(), md.seq_lens.int(), md.query_start_loc.int(),
            torch.arange(md.num_reqs, dtype=torch.int32))
    for name in kernels.host_variants():
        out = torch.zeros_like(q)
        kernels.load_variant(name).paged_attention(out, q, cache[0], cache[1], *args, 0.125, 0, K_SCALE, V_SCALE, 0.0)
        torch.testing.assert_close(out.double(), ref, **_tolerance(torch.float32), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("cache_dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_cpu_torch_fallback_reads_fp8_cache(cache_dtype, monkeypatch):
    attention = _cpu_backend()
    monkeypatch.setattr(attention._kernels, "available", lambda: False)
    md, q, k, v, cache = _case(64, cache_dtype=cache_dtype, seed=2)
    out = attention.TorchPagedAttention().forward(q, k, v, cache, md, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    _check_written(cache, md, k, v, K_SCALE, V_SCALE)
    torch.testing.assert_close(out.double(), _reference(q, cache, md, 0.125, K_SCALE, V_SCALE),
                               **_tolerance(torch.float32))


@pytest.mark.parametrize("cache_dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_sdpa_backend_reads_fp8_cache(cache_dtype):
    """The portable SDPA backend (CUDA without Triton, XPU, TPU) on the CPU."""
    md, q, k, v, cache = _case(64, cache_dtype=cache_dtype, seed=3)
    out = SdpaPagedAttention().forward(q, k, v, cache, md, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    _check_written(cache, md, k, v, K_SCALE, V_SCALE)
    torch.testing.assert_close(out.double(), _reference(q, cache, md, 0.125, K_SCALE, V_SCALE),
                               **_tolerance(torch.float32))


@pytest.mark.parametrize("cache_dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_kernels_scale_fp8_cache(cache_dtype, dtype):
    """The shared Triton kernels (CUDA, ROCm, XPU) in Triton's interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1; float16, not bfloat16: the interpreter's bf16 tl.dot is wrong). New K/V are
    fp8 grid values times power-of-two scales, so ``x / scale`` is exact and the interpreter's own
    float->fp8 rounding (wrong near binade edges) does not enter the byte check."""
    pytest.importorskip("triton")
    from vllite_triton_kernels import TritonPagedAttention

    k_scale, v_scale = 0.5, 4.0
    # Smaller than REQUESTS (the interpreter is slow), still several 64-key tiles and partial blocks.
    md, q, k, v, cache = _case(64, cache_dtype=cache_dtype, dtype=dtype, seed=4,
                               requests=[(1, 150), (1, 33), (12, 90), (5, 5)])
    k = (k.float().to(cache_dtype).float() * k_scale).to(dtype)
    v = (v.float().to(cache_dtype).float() * v_scale).to(dtype)
    out = TritonPagedAttention().forward(q, k, v, cache, md, 0.125, k_scale=k_scale, v_scale=v_scale)
    _check_written(cache, md, k, v, k_scale, v_scale)
    tol = _tolerance(torch.float32) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.double(), _reference(q, cache, md, 0.125, k_scale, v_scale), **tol)


@pytest.mark.parametrize("cache_dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_example_vendor_backend_scales_fp8_cache(cache_dtype):
    """The example vendor platform (acme, which lists fp8) follows the scaled-cache contract too."""
    acme = pytest.importorskip("vllite_platform_acme.attention")
    md, q, k, v, cache = _case(64, cache_dtype=cache_dtype, seed=5)
    out = acme.AcmePagedAttention().forward(q, k, v, cache, md, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    _check_written(cache, md, k, v, K_SCALE, V_SCALE)
    torch.testing.assert_close(out.double(), _reference(q, cache, md, 0.125, K_SCALE, V_SCALE),
                               **_tolerance(torch.float32))
