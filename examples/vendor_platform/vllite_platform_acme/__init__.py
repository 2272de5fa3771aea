"""vllite platform plugin for the Acme accelerator (entry point ``vllite.platforms: acme``).

This module is imported for every process that loads plugins, so it stays
tiny: it declares the plugin API version and hands over the Platform class,
importing the device code only when asked.
"""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 0)  # the vllite plugin API this package was written for


@hookimpl
def vllite_register_platforms() -> list[type]:
    from vllite_platform_acme.platform import AcmePlatform

    return [AcmePlatform]
