"""Choosing the platform this process runs on.

Explicit (``--device NAME`` / ``VLLITE_PLATFORM``) wins; otherwise the available
platform with the highest priority. Every candidate's detection is kept as a
diagnostic so ``vllite env`` and error messages can say why each one lost.
The engine never selects a platform whose detection says its device is absent.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy

from vllite_core.platforms.interface import Platform
from vllite_core.plugins.errors import PluginError
from vllite_core.plugins.loading import PluginInfo, api_incompatibility, normalize_name, one_line_error
from vllite_core.plugins.manager import get_plugin_manager, platform_plugin_failures

logger = logging.getLogger("vllite.platforms")

AUTO = "auto"


class PlatformResolutionError(RuntimeError):
    """No platform could be chosen; carries the per-platform diagnostics."""

    def __init__(self, message: str, candidates: list["PlatformCandidate"] | None = None) -> None:
        super().__init__(message)
        self.candidates = candidates or []


@dataclass
class DiscoveredPlatform:
    """A Platform class and the plugin that provided it (or the plugin's hook error)."""

    name: str
    cls: type[Platform] | None
    plugin: str
    distribution: str
    version: str
    error: str | None = None


@dataclass
class PlatformCandidate:
    """Detection result for one platform, for diagnostics."""

    name: str
    distribution: str
    version: str
    plugin: str
    available: bool
    priority: int
    reason: str
    devices: list[str] = field(default_factory=list)
    error: str | None = None  # detect() raised (or the plugin handed back something unusable)
    cls: type[Platform] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "cls"}


@dataclass
class ResolvedPlatform:
    platform: Platform
    reason: str  # why this one was chosen
    candidates: list[PlatformCandidate]
    failed_plugins: list[PluginInfo] = field(default_factory=list)

    @property
    def chosen(self) -> PlatformCandidate | None:
        """The winning candidate's diagnostics (None when set directly by tests)."""
        return next((c for c in self.candidates if c.cls is type(self.platform)), None)


def discover_platforms(pm: pluggy.PluginManager) -> list[DiscoveredPlatform]:
    """Ask each plugin's ``vllite_register_platforms`` separately, so a raising hook is
    attributed to its plugin instead of hiding every other platform."""
    found: list[DiscoveredPlatform] = []
    for impl in pm.hook.vllite_register_platforms.get_hookimpls():
        if getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False):
            continue
        info = getattr(pm, "info_for", lambda _n: None)(impl.plugin_name)
        plugin = info.name if info else impl.plugin_name
        dist = info.distribution if info else "<unknown>"
        ver = info.version if info else "?"
        try:
            classes = list(impl.function() or [])
        except Exception as exc:
            found.append(DiscoveredPlatform(plugin, None, plugin, dist, ver,
                                            f"vllite_register_platforms raised {one_line_error(exc)}"))
            continue
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, Platform)):
                found.append(DiscoveredPlatform(plugin, None, plugin, dist, ver,
                                                f"vllite_register_platforms returned {cls!r}, not a Platform subclass"))
                continue
            problem = api_incompatibility(cls.plugin_api)
            found.append(DiscoveredPlatform(cls.name, None if problem else cls, plugin, dist, ver, problem))
    return found


def diagnose(discovered: list[DiscoveredPlatform]) -> list[PlatformCandidate]:
    """Run every platform's ``detect()``; a raising detector becomes an unavailable candidate."""
    out: list[PlatformCandidate] = []
    for d in discovered:
        cand = PlatformCandidate(d.name, d.distribution, d.version, d.plugin, available=False, priority=0,
                                 reason="", error=d.error, cls=d.cls)
        if d.cls is not None:
            try:
                det = d.cls.detect()
                cand.available, cand.priority = bool(det.available), int(det.priority)
                cand.reason, cand.devices = det.reason, list(det.devices)
            except Exception as exc:
                cand.error = f"detect() raised {one_line_error(exc)}"
                logger.warning("platform %r (%s): %s", d.name, d.distribution, cand.error)
        if cand.error and not cand.reason:
            cand.reason = cand.error
        out.append(cand)
    # Best first: available by priority, then the unavailable ones.
    return sorted(out, key=lambda c: (not c.available, -c.priority, c.name))


def diagnose_platforms(pm: pluggy.PluginManager | None = None) -> list[PlatformCandidate]:
    """Detection results of every discovered platform (for ``vllite env``)."""
    return diagnose(discover_platforms(pm or get_plugin_manager()))


def _requested_name(name: str | None) -> tuple[str | None, str]:
    if name and name.strip().lower() != AUTO:
        return name.strip(), f"requested explicitly (--device/device={name.strip()})"
    env = os.environ.get("VLLITE_PLATFORM", "").strip()
    if env and env.lower() != AUTO:
        return env, f"requested by VLLITE_PLATFORM={env}"
    return None, ""


def _summary(candidates: list[PlatformCandidate]) -> str:
    lines = []
    for c in candidates:
        state = "available" if c.available else "unavailable"
        lines.append(f"  - {c.name} ({c.distribution} {c.version}): {state}, priority {c.priority}: "
                     f"{c.error or c.reason or 'no reason given'}")
    return "\n".join(lines) if lines else "  (no platform plugin is installed; try `pip install vllite-platform-cpu`)"


def _failures_text(failed: list[PluginInfo]) -> str:
    if not failed:
        return ""
    return "\nplatform plugins that did not load:\n" + "\n".join(
        f"  - {f.name} ({f.distribution} {f.version}): {f.status}: {f.reason}" for f in failed)


def _instantiate(cand: PlatformCandidate, candidates: list[PlatformCandidate]) -> Platform:
    assert cand.cls is not None
    try:
        return cand.cls()
    except Exception as exc:
        raise PlatformResolutionError(
            f"platform {cand.name!r} ({cand.distribution}) could not be constructed: {one_line_error(exc)}",
            candidates) from exc


def _resolve_explicit(wanted: str, why: str, candidates: list[PlatformCandidate],
                      failed: list[PluginInfo]) -> ResolvedPlatform:
    key = normalize_name(wanted)
    matches = [c for c in candidates if normalize_name(c.name) == key]
    if not matches:
        for f in failed:  # the platform's own plugin did not load: blame it by name
            if key in (normalize_name(f.name), normalize_name(f.distribution),
                       normalize_name(f.distribution).removeprefix("vllite-platform-")):
                hint = (f"add {f.name!r} to VLLITE_PLUGINS" if f.status == "blocked"
                        else "see `vllite plugins`")
                raise PluginError(f.name, f"{f.distribution} {f.version}", f"{f.status}: {f.reason}",
                                  hint=f"platform {wanted!r} was requested; {hint}")
        known = ", ".join(sorted({c.name for c in candidates})) or "none"
        raise PlatformResolutionError(
            f"unknown platform {wanted!r} ({why}); known platforms: {known} (is its package installed? "
            f"e.g. pip install vllite-platform-{key}){_failures_text(failed)}", candidates)
    if len(matches) > 1:
        raise PlatformResolutionError(
            f"platform name {wanted!r} is provided by several plugins: "
            + ", ".join(f"{c.plugin} ({c.distribution})" for c in matches)
            + "; block all but one with VLLITE_PLUGINS", candidates)
    cand = matches[0]
    if cand.cls is None or cand.error:
        raise PlatformResolutionError(
            f"platform {wanted!r} ({cand.distribution} {cand.version}) was requested but is broken: {cand.error}",
            candidates)
    if not cand.available:
        raise PlatformResolutionError(
            f"platform {wanted!r} ({cand.distribution} {cand.version}) was requested but is not available "
            f"on this machine: {cand.reason or 'no reason given'}", candidates)
    return ResolvedPlatform(_instantiate(cand, candidates), why, candidates, failed)


def _resolve_auto(candidates: list[PlatformCandidate], failed: list[PluginInfo]) -> ResolvedPlatform:
    available = [c for c in candidates if c.available and c.cls is not None and not c.error]
    if not available:
        raise PlatformResolutionError(
            "no available platform; detection results:\n" + _summary(candidates) + _failures_text(failed),
            candidates)
    top = max(c.priority for c in available)
    best = [c for c in available if c.priority == top]
    if len(best) > 1:
        names = ", ".join(f"{c.name} ({c.distribution})" for c in best)
        raise PlatformResolutionError(
            f"several platforms are available with the same top priority {top}: {names}; "
            f"pick one with --device NAME or VLLITE_PLATFORM=NAME", candidates)
    chosen = best[0]
    others = [c for c in candidates if c is not chosen]
    why = f"automatic: highest priority ({top}) among available platforms"
    if others:
        why += "; over " + ", ".join(
            f"{c.name} ({'priority ' + str(c.priority) if c.available else 'unavailable'})" for c in others)
    return ResolvedPlatform(_instantiate(chosen, candidates), why, candidates, failed)


def resolve_platform(name: str | None = None, *, pm: pluggy.PluginManager | None = None) -> ResolvedPlatform:
    """Pick the platform: ``name`` (or ``VLLITE_PLATFORM``) if given, else the best available.

    Raises PlatformResolutionError (unknown name, unavailable device, tie, nothing
    available) or PluginError (the requested platform's plugin failed or is blocked).
    """
    pm = pm or get_plugin_manager()
    candidates = diagnose(discover_platforms(pm))
    failed = platform_plugin_failures(pm) if hasattr(pm, "infos") else []
    wanted, why = _requested_name(name)
    if wanted is not None:
        resolved = _resolve_explicit(wanted, why, candidates, failed)
    else:
        resolved = _resolve_auto(candidates, failed)
    logger.info("platform %s: %s", resolved.platform.name, resolved.reason)
    return resolved


_lock = threading.Lock()
_current: ResolvedPlatform | None = None


def current_resolution(name: str | None = None) -> ResolvedPlatform:
    """The cached resolution for this process (resolving on first use).

    Asking for a different explicit platform than the one already in use raises:
    a process runs on one platform; reset (tests) or use another process.
    """
    global _current
    with _lock:
        if _current is None:
            _current = resolve_platform(name)
        elif name and name.strip().lower() != AUTO and normalize_name(name) != normalize_name(_current.platform.name):
            raise PlatformResolutionError(
                f"this process already runs on platform {_current.platform.name!r}; "
                f"cannot switch to {name!r} (use a new process)", _current.candidates)
        return _current


def current_platform(name: str | None = None) -> Platform:
    """The platform this process runs on (see ``current_resolution``)."""
    return current_resolution(name).platform


def set_current_platform_for_tests(platform: Platform | None) -> None:
    """Force (or with None, forget) the current platform. Tests only."""
    global _current
    with _lock:
        if platform is None:
            _current = None
        else:
            _current = ResolvedPlatform(platform, "set by set_current_platform_for_tests", [])


def reset_current_platform() -> None:
    """Forget the cached platform; the next ``current_platform()`` resolves again."""
    set_current_platform_for_tests(None)
