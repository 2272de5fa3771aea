"""Plugin framework: pluggy hookspecs, entry-point loading, listing and errors."""
from vllite_core.plugins.hookspecs import VLLITE_PLUGIN_API, hookimpl, hookspec

__all__ = ["VLLITE_PLUGIN_API", "hookimpl", "hookspec"]
