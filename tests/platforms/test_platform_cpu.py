"""The CPU platform package (vllite-platform-cpu)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import vllite_platform_cpu.platform as cpu_mod
from vllite_platform_cpu import VLLITE_PLUGIN_API, vllite_register_platforms
from vllite_platform_cpu.platform import CpuPlatform

from vllite_core.attention import AttentionBackend
from vllite_core.config import CacheConfig, ConfigError, DeviceConfig, ModelConfig, VlliteConfig

torch.set_num_threads(1)
GiB = 1 << 30


@pytest.fixture
def cpu() -> CpuPlatform:
    return CpuPlatform()


def test_plugin_module_contract():
    assert VLLITE_PLUGIN_API == (1, 0)
    assert vllite_register_platforms() == [CpuPlatform]


def test_detect_always_available_lowest_priority():
    det = CpuPlatform.detect()
    assert det.available and det.priority == 0
    assert det.devices == [cpu_mod.cpu_model_name()] and det.devices[0]


def test_identity(cpu):
    assert (cpu.name, cpu.device_type, cpu.dist_backend) == ("cpu", "cpu", "gloo")
    assert cpu.device() == torch.device("cpu")
    assert cpu.device_name() == cpu_mod.cpu_model_name()
    assert cpu.total_memory() > 256 * (1 << 20)
    facts = cpu.describe()
    assert facts["name"] == "cpu" and facts["total_memory"] == cpu.total_memory()


@pytest.mark.parametrize("flags, first", [({"avx2", "fma"}, torch.float32),
                                          ({"avx512f", "avx512_bf16"}, torch.bfloat16),
                                          ({"amx_bf16", "amx_tile"}, torch.bfloat16)])
def test_dtypes_follow_bf16_support(cpu, monkeypatch, flags, first):
    monkeypatch.setattr(cpu_mod.pyplatform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda: flags)
    assert cpu.supported_dtypes()[0] == first and cpu.default_dtype() == first
    assert set(cpu.supported_dtypes()) == {torch.float32, torch.bfloat16}


def test_this_machine_defaults_to_float32_without_avx512(cpu):
    if cpu_mod.has_fast_bf16():
        pytest.skip("this CPU has native bf16")
    assert cpu.default_dtype() == torch.float32


def test_kv_cache_dtype_check(cpu):
    cpu.check_and_update_config(VlliteConfig())
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # float8 caches: the C++ kernel and the torch path read them
        cpu.check_and_update_config(VlliteConfig(cache_config=CacheConfig(kv_cache_dtype=name)))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        cpu.check_and_update_config(VlliteConfig(cache_config=CacheConfig(kv_cache_dtype="int8")))
    with pytest.raises(ConfigError, match="num_threads"):
        cpu.check_and_update_config(VlliteConfig(device_config=DeviceConfig(num_threads=0)))


@pytest.mark.parametrize("flags, slow", [({"avx2", "fma"}, True), ({"avx2", "avx_vnni"}, False),
                                         ({"avx512f", "avx512_vnni"}, False), ({"amx_int8", "amx_tile"}, False)])
def test_int8_without_vnni_warns(cpu, monkeypatch, caplog, flags, slow):
    """int8 still runs where the CPU has no int8 dot products, but the user is told it is the slow choice."""
    monkeypatch.setattr(cpu_mod.pyplatform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda: flags)
    with caplog.at_level("WARNING", logger="vllite"):
        cpu.check_and_update_config(VlliteConfig(model_config=ModelConfig(quantization="int8")))
        cpu.check_and_update_config(VlliteConfig(model_config=ModelConfig(quantization="gguf")))
    warned = [r for r in caplog.records if "int8" in r.getMessage()]
    assert len(warned) == (1 if slow else 0)
    if slow:
        assert "VNNI" in warned[0].getMessage() and "gguf" in warned[0].getMessage()


def test_memory_explicit_size_skips_profiling(cpu):
    calls = []
    cfg = VlliteConfig(cache_config=CacheConfig(kv_cache_memory=123 << 20))
    assert cpu.determine_available_memory(cfg, lambda: calls.append(1)) == 123 << 20
    assert calls == []


def test_memory_env_size(cpu, monkeypatch):
    monkeypatch.setenv("VLLITE_CPU_KVCACHE_SPACE", "0.5")
    assert cpu.determine_available_memory(VlliteConfig(), lambda: None) == GiB // 2
    monkeypatch.setenv("VLLITE_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ConfigError, match="VLLITE_CPU_KVCACHE_SPACE"):
        cpu.determine_available_memory(VlliteConfig(), lambda: None)


def test_memory_profiled_budget_is_capped(cpu, monkeypatch):
    monkeypatch.delenv("VLLITE_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu_mod, "current_rss", lambda: GiB)
    calls = []
    # 6 GiB of room: the bound on the profile's peak (2 x 1 GiB held + 2 GiB for 2,048 tokens + 1 GiB) leaves
    # less than the 4 GiB cap, so it runs, and the budget it gives is capped.
    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self, index=0: 7 * GiB)
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=1.0))
    got = cpu.determine_available_memory(cfg, lambda: calls.append(1))
    assert calls == [1] and got == cpu_mod.DEFAULT_KV_CACHE_CAP


def test_memory_profile_is_skipped_when_the_cap_fits_beside_any_peak(cpu, monkeypatch):
    monkeypatch.delenv("VLLITE_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu_mod, "current_rss", lambda: GiB)
    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self, index=0: 9 * GiB)  # 4 + 5 GiB bound
    calls = []
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=1.0))
    assert cpu.determine_available_memory(cfg, lambda: calls.append(1)) == cpu_mod.DEFAULT_KV_CACHE_CAP
    assert calls == []


def test_memory_profile_growth_is_subtracted(cpu, monkeypatch):
    monkeypatch.delenv("VLLITE_CPU_KVCACHE_SPACE", raising=False)
    rss = iter([1 * GiB, 3 * GiB])
    monkeypatch.setattr(cpu_mod, "current_rss", lambda: next(rss))
    peaks = iter([2 * GiB, 5 * GiB])  # peak rose during the profile run: it counts
    monkeypatch.setattr(cpu_mod, "peak_rss", lambda: next(peaks))
    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self, index=0: 10 * GiB)
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=0.8))
    assert cpu.determine_available_memory(cfg, lambda: None) == 3 * GiB  # 8 GiB - 5 GiB peak


def test_memory_with_no_room_is_a_clear_error(cpu, monkeypatch):
    monkeypatch.delenv("VLLITE_CPU_KVCACHE_SPACE", raising=False)
    cfg = VlliteConfig(cache_config=CacheConfig(memory_utilization=1e-6))
    with pytest.raises(ConfigError, match="memory_utilization"):
        cpu.determine_available_memory(cfg, lambda: None)


def test_init_device_sets_threads(cpu):
    before = torch.get_num_threads()
    try:
        cpu.init_device(VlliteConfig(device_config=DeviceConfig(num_threads=1)))
        assert torch.get_num_threads() == 1
        cpu.init_device(VlliteConfig())
        assert torch.get_num_threads() == cpu_mod.usable_cpus()
    finally:
        torch.set_num_threads(before)


def test_graphs_are_eager_for_now(cpu):
    assert cpu.capture_graphs(lambda **kw: None, [1, 2], lambda n: {}, VlliteConfig()) == {}


@pytest.mark.skipif(importlib.util.find_spec("vllite_platform_cpu.attention") is None,
                    reason="TorchPagedAttention not written yet")
def test_attention_backend(cpu):
    assert isinstance(cpu.get_attention_backend(VlliteConfig()), AttentionBackend)


def _smaps_value(addr: int, field: str) -> int:
    """``field`` of the mapping that holds ``addr``, from /proc/self/smaps."""
    inside = False
    for line in filter(None, Path("/proc/self/smaps").read_text().splitlines()):
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == field + ":":
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {addr:#x}")


def test_kv_cache_is_zeroed_writable_and_backed_by_huge_pages_where_the_os_has_them():
    from vllite_platform_cpu.attention import TorchPagedAttention

    backend = TorchPagedAttention()
    shape = backend.get_kv_cache_shape(300, 16, 3, 64)  # 3.5 MiB in bfloat16
    cache = backend.allocate_kv_cache(shape, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    cache[1, 299] = 2.0
    assert float(cache.sum()) == 2.0 * 16 * 3 * 64
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform != "linux" or not mode.exists() or "[never]" in mode.read_text():
        return  # no transparent huge pages on this OS: calloc's memory
    assert cache.data_ptr() % (2 << 20) == 0
    assert _smaps_value(cache.data_ptr(), "THPeligible") == 1  # advised (the OS's usual mode backs only that)
    small = backend.allocate_kv_cache(backend.get_kv_cache_shape(2, 16, 3, 64), torch.float32, torch.device("cpu"))
    assert not small.any()  # under a huge page: plain calloc


_REFAULTS = """
import resource, sys, torch
import vllite_platform_cpu.platform as p
on = p.keep_freed_memory()
def touch(mib):  # an activation, written, then freed
    torch.empty(mib << 18, dtype=torch.float32).fill_(1.0)
touch(64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch(56)
print(on, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
def test_freed_activations_are_reused_not_faulted_in_again(monkeypatch):
    """init_device's keep_freed_memory: a 56 MiB block after a 64 MiB one was freed comes from malloc's heap, already
    mapped, instead of 14,336 freshly zeroed pages (glibc maps blocks above 32 MiB afresh each time);
    VLLITE_CPU_KEEP_FREED=0 keeps glibc's defaults. (Not the same size again: torch's 64-byte-aligned allocation
    asks malloc for a little more than the block it freed, which then may not fit in it.)"""
    import subprocess

    faults = {}
    for env in ("1", "0"):
        monkeypatch.setenv("VLLITE_CPU_KEEP_FREED", env)
        on, count = subprocess.run([sys.executable, "-c", _REFAULTS], capture_output=True, text=True,
                                   check=True).stdout.split()
        assert on == str(env == "1")
        faults[env] = int(count)
    # base pages: ~14,336 faults without, a few with; transparent huge pages fault ~28 times either way
    assert faults["1"] < max(faults["0"] // 8, 64), faults
