"""The Platform contract and resolution of the current platform."""
from vllite_core.platforms.interface import Detection, Platform

__all__ = ["Detection", "Platform"]
