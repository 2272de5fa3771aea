"""Errors a plugin can cause, named so a user knows which package to blame."""
from __future__ import annotations


class PluginError(RuntimeError):
    """Something required comes from a plugin that did not load (failed or blocked).

    The message always names the plugin, the distribution that ships it and why it
    is unusable, so the fix (upgrade, uninstall, allow it) is obvious.
    """

    def __init__(self, plugin: str, distribution: str, reason: str, hint: str = "") -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.reason = reason
        message = f"plugin {plugin!r} from distribution {distribution!r} is unusable: {reason}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)
