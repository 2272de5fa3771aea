"""vllite TPU platform plugin (entry point ``vllite.platforms: tpu``)."""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 0)


@hookimpl
def vllite_register_platforms() -> list[type]:
    from vllite_platform_tpu.platform import TpuPlatform

    return [TpuPlatform]
