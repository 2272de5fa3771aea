"""The Platform contract and resolution of the current platform."""
from vllite_core.platforms.interface import Detection, Platform
from vllite_core.platforms.resolve import (
    PlatformResolutionError,
    ResolvedPlatform,
    current_platform,
    resolve_platform,
)

__all__ = ["Detection", "Platform", "PlatformResolutionError", "ResolvedPlatform", "current_platform",
           "resolve_platform"]
