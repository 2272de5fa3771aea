"""The shared Triton paged-attention kernels (vllite-triton-kernels) against the reference attention.

No GPU here: the kernels run in Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors, float32 and float16 (bfloat16 tl.dot is broken in the interpreter).
Random non-contiguous block tables, partially filled last blocks, GQA, chunked
prefill, mixed batches, sliding windows, padding rows.
"""
from __future__ import annotations

import os

# Must precede triton's import (tests/conftest.py sets it for the whole run): Triton wires its
# interpreter in when it is imported, and @triton.jit picks it at decoration time.
os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements-test.txt)")

from vllite_triton_kernels import TritonPagedAttention, triton_backends, triton_status  # noqa: E402

from vllite_core.attention.reference import build_metadata, reference_paged_attention  # noqa: E402
from vllite_core.conformance.kit import (  # noqa: E402
    STANDARD_CASES,
    AttentionCase,
    assert_attention_matches,
    run_attention_case,
)

torch.set_num_threads(2)
CASES = {c.name: c for c in STANDARD_CASES}


def test_triton_runs_interpreted():
    """Guard: if something imported triton before TRITON_INTERPRET=1, every kernel call here would fail
    with a confusing "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tl.standard.zeros, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set in this process (see tests/conftest.py)")


@pytest.fixture(scope="module")
def backend():
    return TritonPagedAttention()


def run(backend, case, dtype=torch.float32, **kw):
    """The kit's case runner, minus what the interpreter makes slow: the context is stored by the store
    kernel alone and each step runs once (test_forward_reads_no_host_metadata covers re-runs)."""
    return run_attention_case(backend, case, "cpu", dtype, repeat=False, write_context=backend.store_kv, **kw)


@pytest.mark.parametrize("case", STANDARD_CASES, ids=lambda c: c.name)
def test_float32_matches_reference(backend, case):
    assert_attention_matches(run(backend, case), torch.float32)


@pytest.mark.parametrize("name", ["mixed-gqa", "long-decode-gqa", "long-chunks-gqa"])
def test_small_pages(backend, name):
    """block_size 4: every 64-position tile of the kernel spans many pages."""
    assert_attention_matches(run(backend, CASES[name], block_size=4, num_blocks=64), torch.float32)


@pytest.mark.parametrize("name", ["mixed-gqa", "sliding-window", "long-chunks-gqa", "soft-cap",
                                  "per-layer-windows-soft-cap"])
def test_float16_matches_reference(backend, name):
    assert_attention_matches(run(backend, CASES[name], torch.float16, seed=1), torch.float16)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(backend, seed):
    rng = random.Random(100 + seed)
    n = rng.randint(2, 5)
    q_lens = tuple(rng.choice([1, 1, rng.randint(2, 24)]) for _ in range(n))
    ctx = tuple(rng.randint(0, 40) for _ in range(n))
    kv_heads = rng.choice([1, 2, 4])
    case = AttentionCase(f"random-{seed}", q_lens, ctx, num_heads=kv_heads * rng.choice([1, 2, 3]),
                         num_kv_heads=kv_heads, head_size=rng.choice([16, 32, 48]),
                         sliding_window=rng.choice([None, None, 7]))
    results = run(backend, case, block_size=rng.choice([4, 8, 16]), num_blocks=96, seed=seed)
    assert_attention_matches(results, torch.float32)


def _paged_case(seed=0, dtype=torch.float32, heads=4, kv_heads=2, head_size=16, block=4, blocks=32):
    q_lens, seq_lens = [1, 6, 1], [10, 6, 3]
    rng = random.Random(seed)
    free = list(range(1, blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block))] for s in seq_lens]
    md = build_metadata(q_lens, seq_lens, tables, block)
    gen = torch.Generator().manual_seed(seed)
    n = md.num_actual_tokens
    q = torch.randn(n, heads, head_size, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_size, generator=gen)
    v = torch.randn(n, kv_heads, head_size, generator=gen)
    cache = torch.randn(2, blocks, block, kv_heads, head_size, generator=gen)
    return md, q, k, v, cache


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache(backend, cache_dtype):
    """K/V stored as fp8 and read back in the query dtype, like the reference. The values are drawn on the
    fp8 grid: the interpreter's own float->fp8 rounding is wrong near binade edges (1.9997 -> 1.0), which
    real GPUs (hardware conversion) do not share."""
    md, q, k, v, cache = _paged_case()
    k, v, cache = (t.to(cache_dtype).float() for t in (k, v, cache))
    cache = cache.to(cache_dtype)
    ref_cache = cache.clone()
    out = backend.forward(q, k, v, cache, md, 0.25)
    ref = reference_paged_attention(q, k, v, ref_cache, md, 0.25)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_forward_reads_no_host_metadata(backend):
    """What makes the backend graph-safe: only the metadata's tensors matter, never its host copies."""
    md, q, k, v, cache = _paged_case(seed=3)
    expected = backend.forward(q, k, v, cache.clone(), md, 0.3)
    md.query_start_loc_cpu, md.seq_lens_cpu = [0] * 4, [0] * 3
    md.num_actual_tokens, md.max_query_len, md.max_seq_len = 0, 0, 0
    torch.testing.assert_close(backend.forward(q, k, v, cache.clone(), md, 0.3), expected, atol=0, rtol=0)
    assert TritonPagedAttention.supports_graph_capture


def test_cpu_tensors_without_interpreter_are_refused(backend, monkeypatch):
    md, q, k, v, cache = _paged_case()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.forward(q, k, v, cache, md, 0.25)


def test_triton_status(monkeypatch):
    names = triton_backends()
    assert names is not None and "nvidia" in names and "amd" in names  # the PyPI wheel ships both
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_status("nvidia")[0] and triton_status("amd")[0]
    ok, why = triton_status("intel")
    assert not ok and "no 'intel' backend" in why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_status("intel") == (True, "TRITON_INTERPRET=1 (interpreter)")


def test_bad_tile_size():
    with pytest.raises(ValueError, match="tile_n"):
        TritonPagedAttention(tile_n=24)


def test_write_kv_hook_matches_the_default(backend):
    """The encoder-decoder hook (cross-attention K/V) goes through the same store kernel."""
    from vllite_core.attention.backend import AttentionBackend

    k, v = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    slots = torch.tensor([5, 6, 7, 8, 20, 21, 22, 23, 24])
    ours, default = torch.zeros(2, 8, 4, 2, 16), torch.zeros(2, 8, 4, 2, 16)
    backend.write_kv(k, v, ours, slots)
    AttentionBackend.write_kv(backend, k, v, default, slots)
    assert torch.equal(ours, default)
