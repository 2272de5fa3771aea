"""Device-neutral helpers the accelerator platforms share: the SDPA paged attention (their fallback, the
TPU's backend), KV-cache sizing from allocator statistics, and the graph-capture plumbing."""
from __future__ import annotations

import types

import pytest
import torch

from vllite_core.attention.reference import build_metadata, reference_paged_attention
from vllite_core.attention.sdpa import SdpaPagedAttention
from vllite_core.config import CacheConfig, ConfigError, VlliteConfig
from vllite_core.conformance.kit import STANDARD_CASES, assert_attention_matches, run_attention_case
from vllite_core.platforms import graphs
from vllite_core.platforms.interface import KV_CACHE_DTYPES
from vllite_core.platforms.memory import available_kv_cache_memory, kv_cache_budget, profile_device_memory

torch.set_num_threads(2)
GiB = 1 << 30


# ---- SDPA paged attention -------------------------------------------------------------------------

@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "pow2-buckets"])
@pytest.mark.parametrize("case", STANDARD_CASES, ids=lambda c: c.name)
def test_sdpa_matches_reference(case, bucketed):
    backend = SdpaPagedAttention(bucket=(lambda n: graphs.pow2_bucket(n, 1)) if bucketed else None)
    assert_attention_matches(run_attention_case(backend, case, "cpu", torch.float32, block_size=8), torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_sdpa_fp8_cache(cache_dtype):
    case = next(c for c in STANDARD_CASES if c.name == "mixed-gqa")
    results = run_attention_case(SdpaPagedAttention(), case, "cpu", torch.float32, cache_dtype=cache_dtype)
    assert_attention_matches(results, torch.float32)


def test_sdpa_bf16():
    case = next(c for c in STANDARD_CASES if c.name == "long-chunks-gqa")
    assert_attention_matches(run_attention_case(SdpaPagedAttention(), case, "cpu", torch.bfloat16), torch.bfloat16)


def test_sdpa_bucket_must_round_up():
    md = build_metadata([3], [3], [[1]], 4)
    with pytest.raises(ValueError, match="round sizes up"):
        SdpaPagedAttention(bucket=lambda n: 1).plan(md)


def test_sdpa_padding_tokens_go_to_the_null_block():
    md = build_metadata([2], [2], [[3]], 4)
    md.slot_mapping = torch.tensor([12, 13, -1, -1])
    cache = torch.zeros(2, 5, 4, 1, 8)
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    ref_cache = cache.clone()
    out = SdpaPagedAttention().forward(q, k, v, cache, md, 0.3)
    ref = reference_paged_attention(q[:2], k[:2], v[:2], ref_cache, md, 0.3)
    torch.testing.assert_close(out[:2], ref)
    assert torch.equal(cache[:, 1:], ref_cache[:, 1:])  # only block 0 (null) took the padding rows
    assert out.shape == q.shape and torch.isfinite(out).all()


# ---- KV cache dtypes --------------------------------------------------------------------------------

def test_kv_cache_torch_dtype_default_mapping():
    from vllite_platform_cpu.platform import CpuPlatform

    p = CpuPlatform()
    assert p.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert p.kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn == KV_CACHE_DTYPES["fp8_e4m3"]
    assert p.kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        p.kv_cache_torch_dtype("int4", torch.float32)


# ---- memory sizing with a fake device module -----------------------------------------------------

class FakeDevice:
    """Stands in for a torch device module's allocator API (what the profile reads), no device behind it."""

    def __init__(self, total=80 * GiB, free=78 * GiB, reserved=10 * GiB, peak=14 * GiB, profile_grows_non_torch=0):
        self.total, self.free, self.reserved, self.peak = total, free, reserved, peak
        self.grow = profile_grows_non_torch
        self.calls: list[str] = []

    def current_device(self):
        return 0

    def synchronize(self, *a):
        self.calls.append("sync")

    def empty_cache(self):
        self.calls.append("empty")

    def reset_peak_memory_stats(self, i):
        self.calls.append("reset")

    def mem_get_info(self, i):
        return self.free, self.total

    def memory_reserved(self, i):
        return self.reserved

    def max_memory_allocated(self, i):
        return self.peak

    def run(self):
        self.calls.append("profile")
        self.free -= self.grow


def test_budget_arithmetic():
    assert kv_cache_budget(100, 0.9, 30, 5) == 55
    assert kv_cache_budget(100, 0.9, 30, -5) == 60  # a shrinking non-torch footprint gives nothing back


def test_profiled_budget_from_allocator_stats():
    dev = FakeDevice(profile_grows_non_torch=1 * GiB)
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=0.5))
    prof = profile_device_memory(dev, cfg, dev.run)
    assert prof.requested == 40 * GiB and prof.torch_peak == 14 * GiB and prof.non_torch_increase == 1 * GiB
    assert prof.kv_cache == 25 * GiB
    assert dev.calls.index("reset") < dev.calls.index("profile") < dev.calls.index("sync", dev.calls.index("profile"))
    assert available_kv_cache_memory(FakeDevice(), cfg, FakeDevice().run) == 26 * GiB


def test_explicit_kv_cache_memory_skips_profiling():
    dev = FakeDevice()
    cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_memory=7 * GiB))
    assert available_kv_cache_memory(dev, cfg, dev.run) == 7 * GiB and dev.calls == []


def test_other_processes_leave_too_little():
    dev = FakeDevice(free=20 * GiB, reserved=5 * GiB)  # 25 GiB reachable, 72 GiB requested
    with pytest.raises(ConfigError, match="only 25.00 GiB is free to this process"):
        available_kv_cache_memory(dev, VlliteConfig(), dev.run)


def test_no_room_left_is_a_clear_error():
    dev = FakeDevice(peak=75 * GiB)
    with pytest.raises(ConfigError, match="leaves no room for the KV cache"):
        available_kv_cache_memory(dev, VlliteConfig(), dev.run)


# ---- graph plumbing -------------------------------------------------------------------------------

def test_capture_sizes_and_pick():
    assert graphs.capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graphs.capture_sizes(3) == [1, 2, 3]
    assert graphs.capture_sizes(12) == [1, 2, 4, 8, 12]
    assert graphs.capture_sizes(1000)[-1] == 256
    assert graphs.pick_batch_size(3, [1, 2, 4, 8]) == 4
    assert graphs.pick_batch_size(9, [1, 2, 4, 8]) is None
    assert [graphs.pow2_bucket(n) for n in (0, 1, 16, 17)] == [16, 16, 16, 32]


def test_pad_decode_inputs():
    md = build_metadata([1, 1, 1], [5, 9, 2], [[3, 4], [5, 6, 7], [8]], 4)
    out = graphs.pad_decode_inputs(torch.tensor([7, 8, 9]), torch.tensor([4, 8, 1]), md, 5)
    pmd = out["metadata"]
    assert out["input_ids"].tolist() == [7, 8, 9, 0, 0] and out["positions"].tolist() == [4, 8, 1, 0, 0]
    assert pmd.query_start_loc.tolist() == list(range(6)) == pmd.query_start_loc_cpu
    assert pmd.seq_lens.tolist() == [5, 9, 2, 1, 1] == pmd.seq_lens_cpu
    assert pmd.slot_mapping.tolist()[3:] == [-1, -1] and pmd.block_table[3:].eq(0).all()
    assert pmd.num_actual_tokens == 3 and pmd.num_reqs == 5
    with pytest.raises(ValueError, match="decode"):
        graphs.pad_decode_inputs(torch.tensor([1, 2]), torch.tensor([0, 1]), build_metadata([2], [2], [[1]], 4), 4)


def test_copy_into_static_buffers():
    static = graphs.decode_inputs(4, 6, [torch.zeros(3)], 4, "cpu")
    caches = static["kv_caches"]
    md = build_metadata([1, 1], [5, 2], [[3, 4], [5]], 4)
    new = graphs.pad_decode_inputs(torch.tensor([7, 8]), torch.tensor([4, 1]), md, 4)
    graphs.copy_into(static, {**new, "kv_caches": caches})
    smd = static["metadata"]
    assert static["input_ids"].tolist() == [7, 8, 0, 0] and static["kv_caches"][0] is caches[0]
    assert smd.block_table[:, :2].tolist() == [[3, 4], [5, 0], [0, 0], [0, 0]]  # narrower table: leading slice
    assert smd.seq_lens_cpu == [5, 2, 1, 1] and smd.num_actual_tokens == 2  # host copies replaced
    with pytest.raises(ValueError, match="does not fit"):
        graphs.copy_into(torch.zeros(2), torch.zeros(3))


def test_capture_runners_replay_static_buffers():
    seen = []

    def forward(x, scale):
        seen.append(x.data_ptr())
        return x * scale

    runners = graphs.capture_runners(forward, [1, 4, 2, 4], lambda bs: {"x": torch.zeros(bs), "scale": 2.0},
                                     graphs.eager_capture)
    assert sorted(runners) == [1, 2, 4]
    out = runners[4](x=torch.tensor([1.0, 2.0, 3.0, 4.0]), scale=3.0)
    assert out.tolist() == [3.0, 6.0, 9.0, 12.0]
    assert seen[-1] == runners[4].static_inputs["x"].data_ptr()  # replays read the static buffer


def test_stream_graph_capture_protocol():
    """The capture sequence on a fake CUDA-style module: warm-up on a side stream, then one capture, replay."""
    log = []

    class Graph:
        def replay(self):
            log.append("replay")

    class Ctx:
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            log.append(f"enter {self.what}")

        def __exit__(self, *a):
            log.append(f"exit {self.what}")

    class Stream:
        def wait_stream(self, other):
            log.append("wait")

    mod = types.SimpleNamespace(
        graph_pool_handle=lambda: "pool", Stream=Stream, current_stream=lambda: Stream(), synchronize=lambda: None,
        stream=lambda s: Ctx("stream"), graph=lambda g, pool: Ctx(f"graph pool={pool}"))
    capture = graphs.stream_graph_capture(mod, Graph, warmup=2)
    replay = capture(lambda: log.append("step") or "out")
    assert log == ["wait", "enter stream", "step", "step", "exit stream", "wait",
                   "enter graph pool=pool", "step", "exit graph pool=pool"]
    assert replay() == "out" and log[-1] == "replay"


def test_capture_memory_is_measured_per_size_from_the_device_view():
    """Each size's runner records the device memory its capture took (mem_get_info: free falls as graphs
    and their pool grow), largest size first; the model runner sums them."""
    free = [10_000]

    class Graph:
        def replay(self):
            pass

    class Ctx:
        def __enter__(self):
            pass

        def __exit__(self, *a):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

    mod = types.SimpleNamespace(
        graph_pool_handle=lambda: "pool", Stream=Stream, current_stream=lambda: Stream(), synchronize=lambda: None,
        stream=lambda s: Ctx(), graph=lambda g, pool: Ctx(), mem_get_info=lambda: (free[0], 10_000))

    def forward(x):
        free[0] -= 100 * x.numel()  # a capture of batch size bs takes 100 * bs bytes
        return x

    capture = graphs.stream_graph_capture(mod, Graph, warmup=0)
    runners = graphs.capture_runners(forward, [1, 4], lambda bs: {"x": torch.zeros(bs)}, capture)
    assert {bs: r.memory_bytes for bs, r in runners.items()} == {4: 400, 1: 100}
    assert graphs.capture_runners(forward, [2], lambda bs: {"x": torch.zeros(bs)},
                                  graphs.eager_capture)[2].memory_bytes == 0  # nothing to measure with
