"""The process-wide plugin manager: entry points and built-ins, loaded once.

Every process that needs plugins (engine, workers, server, CLI) calls
``get_plugin_manager()``; the first call imports the plugins, later calls reuse
the result. Built-in plugins go through the same registration path as
third-party ones, so they obey the same contract.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from importlib.metadata import PackageNotFoundError, entry_points, version

import pluggy

from vllite_core.plugins import hookspecs
from vllite_core.plugins.errors import PluginError
from vllite_core.plugins.loading import (
    ENTRY_POINT_GROUPS,
    PLATFORMS_GROUP,
    PLUGINS_GROUP,
    Allowlist,
    PluginInfo,
    entry_point_info,
    normalize_name,
    register,
)

logger = logging.getLogger("vllite.plugins")

CORE_DISTRIBUTION = "vllite"
# (name, group, module): plugins shipped inside the core distribution.
BUILTIN_PLUGINS: tuple[tuple[str, str, str], ...] = (
    ("builtin-models", PLUGINS_GROUP, "model_registry.builtin"),
    ("builtin-reasoning", PLUGINS_GROUP, "vllite_core.reasoning.builtin"),
    ("builtin-structured-output", PLUGINS_GROUP, "vllite_core.structured_output.builtin"),
    ("builtin-tool-parsers", PLUGINS_GROUP, "vllite_core.tool_parsers.builtin"),
    ("builtin-spec-proposers", PLUGINS_GROUP, "vllite_core.spec_decode.builtin"),
)


class VllitePluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers a ``PluginInfo`` for every plugin it saw."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.infos: list[PluginInfo] = []

    def info_for(self, plugin_name: str) -> PluginInfo | None:
        """The record of a registered plugin, by its pluggy name (``group:name``)."""
        return next((i for i in self.infos if i.key == plugin_name), None)

    def require(self, name: str, group: str | None = None) -> PluginInfo:
        """The loaded plugin called ``name`` (entry point or distribution); PluginError if it did not load."""
        wanted = normalize_name(name)
        matches = [i for i in self.infos
                   if (group is None or i.group == group)
                   and wanted in (normalize_name(i.name), normalize_name(i.distribution))]
        for info in matches:
            if info.status == "loaded":
                return info
        if matches:
            info = matches[0]
            raise PluginError(info.name, f"{info.distribution} {info.version}", f"{info.status}: {info.reason}",
                              hint=_hint(info))
        raise PluginError(name, "<not installed>", "no plugin by that name is installed",
                          hint="see `vllite plugins`")


def _hint(info: PluginInfo) -> str:
    if info.status == "blocked":
        return f"add {info.name!r} to VLLITE_PLUGINS to allow it"
    return "see `vllite plugins`; fix or uninstall that distribution"


def _core_version() -> str:
    try:
        return version(CORE_DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def load_plugins(allowlist: Allowlist | None = None) -> VllitePluginManager:
    """Build a fresh manager: built-ins first, then every entry point of both groups."""
    if allowlist is None:
        allowlist = Allowlist.from_env(os.environ.get("VLLITE_PLUGINS"))
    pm = VllitePluginManager()
    core_version = _core_version()
    for name, group, module in BUILTIN_PLUGINS:
        info = PluginInfo(name=name, group=group, distribution=CORE_DISTRIBUTION, version=core_version,
                          module=module, builtin=True)
        pm.infos.append(register(pm, info, lambda module=module: importlib.import_module(module)))
    for group in ENTRY_POINT_GROUPS:
        eps = sorted(entry_points(group=group), key=lambda e: (normalize_name(e.dist.name if e.dist else ""), e.name))
        for ep in eps:
            info = entry_point_info(ep)
            blocked = allowlist.why_blocked(info.name, info.distribution)
            if blocked:
                info.status, info.reason = "blocked", blocked
                logger.info("plugin %r (%s) blocked: %s", info.name, info.distribution, blocked)
            else:
                register(pm, info, ep.load)
            pm.infos.append(info)
    return pm


_lock = threading.Lock()
_manager: VllitePluginManager | None = None


def get_plugin_manager() -> VllitePluginManager:
    """The process-wide manager, loading all plugins on first use."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                _manager = load_plugins()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the loaded plugins (tests): the next ``get_plugin_manager()`` reloads them.

    Already-imported plugin modules stay in ``sys.modules``.
    """
    global _manager
    with _lock:
        _manager = None


def list_plugins() -> list[PluginInfo]:
    """Every plugin seen in this process: loaded, failed or blocked."""
    return list(get_plugin_manager().infos)


def platform_plugin_failures(pm: VllitePluginManager | None = None) -> list[PluginInfo]:
    """Platform plugins that failed or were blocked (named in resolution errors)."""
    pm = pm or get_plugin_manager()
    return [i for i in getattr(pm, "infos", []) if i.group == PLATFORMS_GROUP and i.status != "loaded"]
