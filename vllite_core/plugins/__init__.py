"""Plugin framework: pluggy hookspecs, entry-point loading, listing and errors."""
from vllite_core.plugins.errors import PluginError
from vllite_core.plugins.hookspecs import VLLITE_PLUGIN_API, hookimpl, hookspec
from vllite_core.plugins.loading import PLATFORMS_GROUP, PLUGINS_GROUP, PluginInfo
from vllite_core.plugins.manager import get_plugin_manager, list_plugins, reset_plugin_manager

__all__ = [
    "PLATFORMS_GROUP",
    "PLUGINS_GROUP",
    "PluginError",
    "PluginInfo",
    "VLLITE_PLUGIN_API",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "list_plugins",
    "reset_plugin_manager",
]
