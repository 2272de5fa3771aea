"""vllite ROCM platform plugin (entry point ``vllite.platforms: rocm``)."""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 0)


@hookimpl
def vllite_register_platforms() -> list[type]:
    from vllite_platform_rocm.platform import RocmPlatform

    return [RocmPlatform]
