"""The XPU platform (Intel GPUs through PyTorch's native ``torch.xpu``).

Memory, device facts, synchronisation and graphs (``torch.xpu.XPUGraph``) all
come from torch itself. Attention is the shared Triton paged attention when
the installed Triton has the Intel backend (torch's XPU wheels ship it as
pytorch-triton-xpu), else torch SDPA. intel-extension-for-pytorch is optional:
it is imported only when installed *and* built for this torch's major.minor
(a mismatched IPEX fails or misbehaves on import), and nothing depends on it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from vllite_triton_kernels.platform_choice import BACKEND_ENV, TritonChoiceMixin, choose_backend

from vllite_core.platforms.interface import Detection, Platform

if TYPE_CHECKING:
    from vllite_core.config import VlliteConfig

logger = logging.getLogger("vllite.platforms.xpu")

PRIORITY = 90


def _major_minor(version: str) -> tuple[int, ...]:
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


def ipex_status(torch_version: str | None = None) -> tuple[bool, str]:
    """(usable, why) for intel-extension-for-pytorch, without importing it."""
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return False, "intel-extension-for-pytorch is not installed"
    try:
        ipex_version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return False, "intel-extension-for-pytorch has no distribution metadata"
    torch_version = torch_version or torch.__version__
    if _major_minor(ipex_version) != _major_minor(torch_version):
        return False, f"intel-extension-for-pytorch {ipex_version} does not match torch {torch_version}"
    return True, f"intel-extension-for-pytorch {ipex_version}"


class XpuPlatform(TritonChoiceMixin, Platform):
    name: ClassVar[str] = "xpu"
    device_type: ClassVar[str] = "xpu"
    dist_backend: ClassVar[str] = "xccl"  # torch.distributed's Intel GPU backend (oneCCL)

    @classmethod
    def detect(cls) -> Detection:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return Detection(False, PRIORITY, "this torch has no torch.xpu module")
        if not xpu.is_available():
            return Detection(False, PRIORITY, "torch.xpu.is_available() is False "
                                              "(no Intel GPU, or torch built without XPU support)")
        names = [f"Intel XPU {i}" for i in range(xpu.device_count())]
        return Detection(True, PRIORITY, f"{len(names)} Intel GPU(s) through torch.xpu", names)

    def device_name(self, index: int = 0) -> str:
        return torch.xpu.get_device_name(index)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.xpu.get_device_properties(index).total_memory)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def supported_kv_cache_dtypes(self) -> list[str]:
        return ["auto"]  # fp8 KV is not validated on Intel GPUs yet

    # ---- attention -----------------------------------------------------------------------
    def attention_choice(self) -> tuple[str, str]:
        return choose_backend("intel", os.environ.get(BACKEND_ENV))

    # ---- memory and graphs ---------------------------------------------------------------
    def determine_available_memory(self, config: "VlliteConfig", profile_run: Callable[[], None]) -> int:
        from vllite_core.platforms.memory import available_kv_cache_memory

        return available_kv_cache_memory(torch.xpu, config, profile_run, device_label="XPU")

    def capture_graphs(self, forward: Callable[..., Any], batch_sizes: list[int],
                       make_inputs: Callable[[int], dict[str, Any]],
                       config: "VlliteConfig") -> dict[int, Callable[..., Any]]:
        if config.enforce_eager or not batch_sizes or not hasattr(torch.xpu, "XPUGraph"):
            return {}
        if self.attention_choice()[0] != "triton":
            return {}
        from vllite_core.platforms.graphs import capture_runners, stream_graph_capture

        runners = capture_runners(forward, batch_sizes, make_inputs,
                                  stream_graph_capture(torch.xpu, torch.xpu.XPUGraph))
        torch.xpu.synchronize()
        return dict(runners)

    # ---- lifecycle -----------------------------------------------------------------------
    def check_and_update_config(self, config: "VlliteConfig") -> None:
        self.check_kv_cache_dtype(config)

    def init_device(self, config: "VlliteConfig") -> None:
        torch.xpu.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        ok, why = ipex_status()
        if ok:
            import intel_extension_for_pytorch  # noqa: F401  (registers its XPU kernels with torch)

            logger.info("xpu: %s loaded", why)
        else:
            logger.info("xpu: not using IPEX: %s", why)

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def empty_cache(self) -> None:
        torch.xpu.empty_cache()

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["attention"] = "%s (%s)" % self.attention_choice()
        facts["ipex"] = ipex_status()[1]
        return facts
