"""KV-cache sizing from a profile run, for devices with torch's caching-allocator API.

torch's cuda module (NVIDIA, and AMD through HIP) and its xpu module expose the same
functions (``mem_get_info``, ``max_memory_allocated``, ``memory_reserved``,
``reset_peak_memory_stats``, ``empty_cache``, ``synchronize``). A platform
passes its device module in; this module never imports one, so the core stays
device-neutral.

The rule (vLLM's): the engine may use ``memory_utilization * total`` bytes of
the device. Out of that come the torch peak during the profile run (weights +
the largest step's activations) and whatever non-torch memory the profile run
added (library workspaces); the rest is the KV cache.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vllite_core.errors import ConfigError

if TYPE_CHECKING:
    from vllite_core.config import VlliteConfig

logger = logging.getLogger("vllite.platforms.memory")

GiB = 1 << 30


@dataclass
class MemoryProfile:
    """What the profile run showed (bytes)."""

    total: int
    free_before: int
    free_after: int
    torch_peak: int  # max_memory_allocated during the run (weights + activations)
    non_torch_increase: int  # device memory torch's allocator does not own, grown during the run
    requested: int  # memory_utilization * total
    kv_cache: int  # what is left for the KV cache

    def describe(self) -> str:
        return (f"total {self.total / GiB:.2f} GiB, requested {self.requested / GiB:.2f} GiB, torch peak "
                f"{self.torch_peak / GiB:.2f} GiB, non-torch +{self.non_torch_increase / GiB:.2f} GiB, "
                f"KV cache {self.kv_cache / GiB:.2f} GiB")


def kv_cache_budget(total: int, utilization: float, torch_peak: int, non_torch_increase: int) -> int:
    """Bytes left for the KV cache out of ``utilization * total``."""
    return int(total * utilization) - int(torch_peak) - max(0, int(non_torch_increase))


def profile_device_memory(mod: Any, config: "VlliteConfig", profile_run: Callable[[], None],
                          index: int | None = None, device_label: str = "device") -> MemoryProfile:
    """Run ``profile_run`` on device ``index`` (default: the current one) of torch device module ``mod`` and
    size the KV cache."""
    cc = config.cache_config
    index = mod.current_device() if index is None else index
    mod.synchronize()
    mod.empty_cache()
    mod.reset_peak_memory_stats(index)
    free_before, total = mod.mem_get_info(index)
    non_torch_before = (total - free_before) - mod.memory_reserved(index)
    requested = int(total * cc.memory_utilization)
    # What this process could still get: the free memory plus what its allocator already holds (weights).
    reachable = free_before + mod.memory_reserved(index)
    if reachable < requested:
        raise ConfigError(
            f"memory_utilization: {cc.memory_utilization} of the {device_label}'s {total / GiB:.2f} GiB is "
            f"{requested / GiB:.2f} GiB, but only {reachable / GiB:.2f} GiB is free to this process (other "
            f"processes hold the rest); lower gpu_memory_utilization or set kv_cache_memory")
    profile_run()
    mod.synchronize()
    torch_peak = int(mod.max_memory_allocated(index))
    free_after, _ = mod.mem_get_info(index)
    non_torch_after = (total - free_after) - mod.memory_reserved(index)
    increase = max(0, non_torch_after - non_torch_before)
    budget = kv_cache_budget(total, cc.memory_utilization, torch_peak, increase)
    prof = MemoryProfile(int(total), int(free_before), int(free_after), torch_peak, increase, requested, budget)
    logger.info("%s memory: %s", device_label, prof.describe())
    mod.empty_cache()
    return prof


def available_kv_cache_memory(mod: Any, config: "VlliteConfig", profile_run: Callable[[], None],
                              index: int | None = None, device_label: str = "device") -> int:
    """``Platform.determine_available_memory`` for caching-allocator devices: the explicit
    ``kv_cache_memory`` when set, else the profiled budget (a ConfigError when nothing is left)."""
    cc = config.cache_config
    if cc.kv_cache_memory is not None:
        return int(cc.kv_cache_memory)
    prof = profile_device_memory(mod, config, profile_run, index, device_label)
    if prof.kv_cache <= 0:
        raise ConfigError(
            f"memory_utilization: {config.cache_config.memory_utilization} of {prof.total / GiB:.2f} GiB leaves no "
            f"room for the KV cache ({prof.describe()}); raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, or set kv_cache_memory")
    return prof.kv_cache
