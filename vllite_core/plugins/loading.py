"""Loading one plugin: allowlist, import, API-version check, registration.

Each plugin ends in a ``PluginInfo`` record whatever happens, so a broken or
refused plugin is reported (``vllite plugins``) instead of silently skipped.
"""
from __future__ import annotations

import logging
import re
import sys
import types
from dataclasses import asdict, dataclass, field
from importlib.metadata import EntryPoint
from typing import Any, Literal

import pluggy

from vllite_core.plugins.hookspecs import VLLITE_PLUGIN_API

logger = logging.getLogger("vllite.plugins")

PLATFORMS_GROUP = "vllite.platforms"
PLUGINS_GROUP = "vllite.plugins"
ENTRY_POINT_GROUPS = (PLATFORMS_GROUP, PLUGINS_GROUP)

PluginStatus = Literal["loaded", "failed", "blocked"]


@dataclass
class PluginInfo:
    """What the core knows about one plugin, for listing and for error messages."""

    name: str  # entry point name (built-ins: a fixed name)
    group: str  # entry point group
    distribution: str  # pip distribution that ships it
    version: str  # that distribution's version
    module: str  # the import target, "pkg.mod" or "pkg.mod:obj"
    hooks: list[str] = field(default_factory=list)  # hook names it implements
    status: PluginStatus = "loaded"
    reason: str = ""  # why failed/blocked (one line); empty when loaded
    builtin: bool = False

    @property
    def key(self) -> str:
        """Name it is registered under in the pluggy manager (unique across groups)."""
        return f"{self.group}:{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def normalize_name(name: str) -> str:
    """PEP 503 normalisation, so ``vllite_platform_cpu`` matches ``vllite-platform-cpu``."""
    return re.sub(r"[-_.]+", "-", name).strip().lower()


@dataclass(frozen=True)
class Allowlist:
    """``VLLITE_PLUGINS``: comma-separated names allowed; ``-name`` denies a name.

    Unset allows everything. An empty value allows nothing (built-ins still load).
    Names match entry point names or distribution names.
    """

    allowed: frozenset[str] | None  # None: no allowlist, everything not denied is allowed
    denied: frozenset[str] = frozenset()
    raw: str | None = None

    @classmethod
    def from_env(cls, value: str | None) -> "Allowlist":
        if value is None:
            return cls(allowed=None, raw=None)
        allowed: set[str] = set()
        denied: set[str] = set()
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            if item[0] in "-!":
                denied.add(normalize_name(item[1:]))
            else:
                allowed.add(normalize_name(item))
        # Only deny entries given ("-foo"): everything else stays allowed.
        only_denials = bool(denied) and not allowed
        return cls(allowed=None if only_denials else frozenset(allowed), denied=frozenset(denied), raw=value)

    def why_blocked(self, ep_name: str, distribution: str) -> str | None:
        names = {normalize_name(ep_name), normalize_name(distribution)}
        if names & self.denied:
            return f"denied by VLLITE_PLUGINS={self.raw!r}"
        if self.allowed is not None and not names & self.allowed:
            return f"not in VLLITE_PLUGINS={self.raw!r}"
        return None


def one_line_error(exc: BaseException) -> str:
    """``"RuntimeError: boom"``: type and first line of the message, no traceback."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def parse_api_version(value: Any) -> tuple[int, int]:
    """Accept ``(1, 0)`` or ``"1.0"``; raise ValueError on anything else."""
    if isinstance(value, str):
        parts = value.strip().split(".")
    elif isinstance(value, (tuple, list)):
        parts = list(value)
    else:
        raise ValueError(f"VLLITE_PLUGIN_API must be (major, minor) or 'major.minor', got {value!r}")
    if len(parts) != 2:
        raise ValueError(f"VLLITE_PLUGIN_API must be (major, minor) or 'major.minor', got {value!r}")
    try:
        major, minor = (int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"VLLITE_PLUGIN_API must be (major, minor) or 'major.minor', got {value!r}") from None
    return major, minor


def api_incompatibility(declared: Any, core: tuple[int, int] = VLLITE_PLUGIN_API) -> str | None:
    """Reason a plugin built for ``declared`` cannot run on ``core``, or None if it can."""
    try:
        major, minor = parse_api_version(declared)
    except ValueError as exc:
        return str(exc)
    if major != core[0] or minor > core[1]:
        return (
            f"incompatible plugin API: it was built for VLLITE_PLUGIN_API {major}.{minor}, "
            f"this vllite provides {core[0]}.{core[1]} (needs major {core[0]} and minor <= {core[1]})"
        )
    return None


def declared_api(obj: Any, module_name: str) -> Any:
    """The plugin's ``VLLITE_PLUGIN_API``: on the loaded object, else on its module."""
    if hasattr(obj, "VLLITE_PLUGIN_API"):
        return obj.VLLITE_PLUGIN_API
    module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(module_name)
    return getattr(module, "VLLITE_PLUGIN_API", None)


def register(pm: pluggy.PluginManager, info: PluginInfo, load: Any) -> PluginInfo:
    """Import via ``load()``, check the API version, register into ``pm``; fill ``info``."""
    try:
        obj = load()
    except Exception as exc:  # a plugin's import error must not take the engine down
        return _fail(info, one_line_error(exc), exc)
    declared = declared_api(obj, info.module.partition(":")[0])
    if declared is None:
        return _fail(info, f"does not declare VLLITE_PLUGIN_API (this vllite provides "
                           f"{VLLITE_PLUGIN_API[0]}.{VLLITE_PLUGIN_API[1]})")
    problem = api_incompatibility(declared)
    if problem:
        return _fail(info, problem)
    if pm.is_registered(obj):
        # Same object behind two entry points (e.g. both groups): hooks run once.
        info.hooks = _hook_names(pm, obj)
        info.reason = f"already registered as {pm.get_name(obj)}"
        return info
    try:
        pm.register(obj, name=info.key)
    except Exception as exc:  # pluggy validation: bad hook signature etc.
        return _fail(info, one_line_error(exc), exc)
    unknown = [h.name for h in pm.get_hookcallers(obj) or [] if not h.has_spec()]
    if unknown:
        pm.unregister(obj)
        return _fail(info, f"implements unknown hook(s) {', '.join(sorted(unknown))} "
                           f"(typo, or written for a newer vllite)")
    info.hooks = _hook_names(pm, obj)
    info.status = "loaded"
    return info


def entry_point_info(ep: EntryPoint) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    return PluginInfo(
        name=ep.name,
        group=ep.group,
        distribution=(dist.name if dist is not None else "") or "<unknown>",
        version=(dist.version if dist is not None else "") or "?",
        module=ep.value,
    )


def _hook_names(pm: pluggy.PluginManager, obj: Any) -> list[str]:
    return sorted(h.name for h in pm.get_hookcallers(obj) or [])


def _fail(info: PluginInfo, reason: str, exc: BaseException | None = None) -> PluginInfo:
    info.status = "failed"
    info.reason = reason
    logger.warning("plugin %r (%s %s) failed to load: %s", info.name, info.distribution, info.version, reason)
    if exc is not None:
        logger.debug("plugin %r traceback", info.name, exc_info=exc)
    return info
