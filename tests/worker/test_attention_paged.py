"""TorchPagedAttention (CPU platform) against the reference paged attention."""
from __future__ import annotations

import random

import pytest
import torch
from vllite_platform_cpu.attention import TorchPagedAttention

from vllite_core.attention.reference import build_metadata, reference_paged_attention

torch.set_num_threads(2)

BLOCK = 4
NUM_BLOCKS = 64


def _case(query_lens, seq_lens, heads, kv_heads, head_size=16, seed=0, dtype=torch.float32, block=BLOCK,
          num_blocks=NUM_BLOCKS):
    """Random q/k/v for the new tokens, a cache pre-filled with random context, random non-contiguous blocks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block))] for s in seq_lens]
    md = build_metadata(query_lens, seq_lens, tables, block)
    n = md.num_actual_tokens
    shape = TorchPagedAttention.get_kv_cache_shape(num_blocks, block, kv_heads, head_size)
    cache = torch.randn(shape, generator=gen).to(dtype)  # old context (and garbage in unused slots)
    q = torch.randn(n, heads, head_size, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
    return q, k, v, cache, md


def _compare(query_lens, seq_lens, heads=4, kv_heads=4, window=None, prepare=True, seed=0):
    q, k, v, cache, md = _case(query_lens, seq_lens, heads, kv_heads, seed=seed)
    ref_cache = cache.clone()
    scale = 0.25
    backend = TorchPagedAttention()
    if prepare:
        backend.prepare(md)
    out = backend.forward(q, k, v, cache, md, scale, window)
    ref = reference_paged_attention(q, k, v, ref_cache, md, scale, window)
    assert torch.equal(cache, ref_cache), "cache writes differ"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # Every layer reuses the step's plan: a second call (as the next layer would) gives the same answer.
    out2 = backend.forward(q, k, v, cache, md, scale, window)
    torch.testing.assert_close(out2, ref, atol=2e-5, rtol=2e-5)


def test_prefill_only():
    _compare([5, 8, 3], [5, 8, 3])


def test_chunked_prefill_with_cached_prefix():
    # Second chunks of prompts: the context holds earlier tokens, partially filled last blocks.
    _compare([3, 6, 2], [9, 13, 7])


def test_decode_batched():
    _compare([1, 1, 1, 1], [1, 6, 13, 17])


def test_mixed_batch_gqa():
    _compare([1, 7, 1, 4, 1], [11, 7, 2, 10, 5], heads=8, kv_heads=2)


def test_gqa_multi_query_heads():
    _compare([1, 1, 6], [30, 3, 6], heads=6, kv_heads=1)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(window):
    _compare([1, 6, 1, 5], [12, 6, 4, 14], heads=4, kv_heads=2, window=window)


def test_without_prepare():
    _compare([1, 4, 1], [9, 4, 3], heads=4, kv_heads=2, prepare=False)


def test_random_batches():
    rng = random.Random(7)
    for seed in range(6):
        n = rng.randint(1, 6)
        q_lens = [rng.choice([1, 1, rng.randint(1, 9)]) for _ in range(n)]
        s_lens = [q + rng.randint(0, 20) for q in q_lens]
        _compare(q_lens, s_lens, heads=4, kv_heads=rng.choice([1, 2, 4]), seed=seed,
                 window=rng.choice([None, None, 5]))


def test_padded_rows_are_ignored():
    q, k, v, cache, md = _case([1, 3], [4, 3], heads=2, kv_heads=2)
    pad = 2
    qp = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    kp = torch.cat([k, torch.randn(pad, *k.shape[1:])])
    vp = torch.cat([v, torch.randn(pad, *v.shape[1:])])
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    ref_cache = cache.clone()
    out = TorchPagedAttention().forward(qp, kp, vp, cache, md, 0.3)
    ref = reference_paged_attention(q, k, v, ref_cache, md, 0.3)
    assert out.shape == qp.shape
    torch.testing.assert_close(out[: md.num_actual_tokens], ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(cache, ref_cache)


def test_bf16_cache_and_queries():
    q, k, v, cache, md = _case([1, 5], [9, 5], heads=4, kv_heads=2, dtype=torch.bfloat16)
    ref_cache = cache.clone()
    out = TorchPagedAttention().forward(q, k, v, cache, md, 0.25)
    ref = reference_paged_attention(q, k, v, ref_cache, md, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache(cache_dtype):
    """K/V are stored rounded to fp8 and read back in the query dtype, exactly like the reference."""
    q, k, v, cache, md = _case([1, 6, 1], [10, 6, 3], heads=4, kv_heads=2)
    cache = cache.to(cache_dtype)
    ref_cache = cache.clone()
    out = TorchPagedAttention().forward(q, k, v, cache, md, 0.25)
    ref = reference_paged_attention(q, k, v, ref_cache, md, 0.25)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# The C++ kernel's own paths: vector head sizes (64, 128) and a scalar one (80); contexts longer than a
# key chunk (online softmax across chunks); many tiles (one task spans all KV heads) and few (a task per
# KV head); query tiles of 16 rows with causal edges and a sliding window. Decode rows (one query row) take
# their own streaming path: blocks of 4 and 16, contexts that end mid-block, 1-7 query heads per KV head (their
# value accumulators taken 4 or 2 heads at a time).
@pytest.mark.parametrize("head_size,heads,kv_heads,q_lens,s_lens,window,dtype,block", [
    (64, 9, 3, [1] * 12 + [40], [300] * 12 + [340], None, torch.float32, 16),
    (64, 8, 2, [1, 1, 1], [77, 5, 130], None, torch.float32, 4),
    (64, 4, 4, [1] * 10, [19 + 23 * i for i in range(10)], 40, torch.float32, 4),
    (128, 12, 3, [1] * 9, [513] * 9, None, torch.float32, 16),
    (64, 9, 3, [1] * 12 + [40], [300] * 12 + [340], 100, torch.float32, 16),
    (128, 8, 2, [1, 33], [700, 33], None, torch.float32, 16),
    (128, 8, 2, [1, 33], [700, 60], 50, torch.float32, 16),
    (80, 4, 2, [3, 20], [200, 20], None, torch.float32, 16),
    (64, 9, 3, [1] * 9 + [17], [400] * 9 + [300], None, torch.bfloat16, 16),
    (128, 8, 2, [1, 20], [300, 20], None, torch.bfloat16, 16),
    (64, 8, 2, [1, 1, 1], [77, 5, 130], 40, torch.bfloat16, 4),
    (64, 14, 2, [1, 1, 1, 5], [70, 33, 150, 20], None, torch.bfloat16, 16),  # 7 query heads per KV head
    (128, 10, 2, [1, 1, 3], [90, 300, 40], None, torch.float32, 16),  # 5 per KV head
    (64, 9, 3, [1, 17], [200, 40], 30, torch.float16, 16),
])
def test_cpu_kernel_paths(head_size, heads, kv_heads, q_lens, s_lens, window, dtype, block):
    from vllite_platform_cpu import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels not built here: {kernels.error()}")
    q, k, v, cache, md = _case(q_lens, s_lens, heads, kv_heads, head_size=head_size, dtype=dtype, block=block,
                               num_blocks=sum(-(-s // block) for s in s_lens) + 4)
    ref_cache = cache.clone()
    backend = TorchPagedAttention()
    backend.prepare(md)
    out = backend.forward(q, k, v, cache, md, 0.125, window)
    ref = reference_paged_attention(q.float(), k.float(), v.float(), ref_cache.float(), md, 0.125, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(9, 3, None), (14, 2, 70)])
def test_cpu_kernel_decode_rows_every_variant(dtype, heads, kv_heads, window):
    """Many decode rows (each thread then fetches its next row's keys while summing values, csrc/attention.cpp's
    NextRows) and a prefill chunk after them, on every ISA variant this CPU runs (default: scalar loops; AVX2:
    one query head's values at a time; AVX-512: 4; AVX512-BF16: bf16 dot products), against the reference."""
    from vllite_platform_cpu import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels not built here: {kernels.error()}")
    q_lens, s_lens = [1] * 14 + [9], [5 + 37 * i for i in range(14)] + [300]
    q, k, v, cache, md = _case(q_lens, s_lens, heads, kv_heads, head_size=64, dtype=dtype, block=16,
                               num_blocks=sum(-(-s // 16) for s in s_lens) + 4)
    from vllite_core.attention.kv_quant import store_scaled

    for i, t in enumerate((k, v)):  # the step's own rows, as the backend's store puts them
        store_scaled(cache[i].flatten(0, 1), md.slot_mapping[:md.num_actual_tokens].long(), t)
    ref = reference_paged_attention(q.float(), k.float(), v.float(), cache.float(), md, 0.125, window)
    args = (md.block_table.int(), md.seq_lens.int(), md.query_start_loc.int(),
            torch.arange(len(q_lens), dtype=torch.int32))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    runnable = kernels.host_variants() if kernels.origin() == "installed" else [kernels.variant()]
    for name in runnable:
        out = torch.zeros_like(q)
        kernels.load_variant(name).paged_attention(out, q, cache[0], cache[1], *args, 0.125, window or 0, 1.0, 1.0, 0.0)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
