"""Fake installed distributions for plugin tests.

A ``<name>-<version>.dist-info`` directory with METADATA and entry_points.txt on
``sys.path`` is all ``importlib.metadata`` needs, so the tests drive the REAL
entry-point loading path without pip.
"""
from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLATFORM_SRC = {name: REPO / "platforms" / name for name in ("cpu", "cuda", "rocm", "xpu", "tpu")}


def unique(prefix: str) -> str:
    """A module name no other test uses (sys.modules keeps imported plugins)."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def make_dist(root: Path, dist: str, entry_points: dict[str, dict[str, str]],
              modules: dict[str, str] | None = None, version: str = "1.0") -> Path:
    """Write modules ``{name: source}`` and a dist-info for ``dist`` under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for mod, source in (modules or {}).items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in eps.items())
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def platform_module(cls_name: str, name: str, *, available: bool = True, priority: int = 0,
                    reason: str = "fake", detect_raises: str | None = None, api: str = "(1, 0)") -> str:
    """Source of a plugin module providing one fake platform."""
    detect_body = (f"raise RuntimeError({detect_raises!r})" if detect_raises else
                   f"return Detection({available!r}, {priority!r}, {reason!r}, ['{name}0'])")
    return f"""
from vllite_core.platforms.interface import Detection, Platform
from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = {api}

class {cls_name}(Platform):
    name = {name!r}

    @classmethod
    def detect(cls):
        {detect_body}

    def device_name(self, index=0):
        return {name!r}

    def total_memory(self, index=0):
        return 1 << 20

    def get_attention_backend(self, config):
        raise NotImplementedError

    def determine_available_memory(self, config, profile_run):
        return 1 << 20

@hookimpl
def vllite_register_platforms():
    return [{cls_name}]
"""


@pytest.fixture
def fresh_plugins(monkeypatch, tmp_path):
    """Clean env and caches; returns a function adding a fake dist to ``sys.path``."""
    from vllite_core.platforms.resolve import reset_current_platform
    from vllite_core.plugins import reset_plugin_manager

    for var in ("VLLITE_PLUGINS", "VLLITE_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    reset_plugin_manager()
    reset_current_platform()
    counter = iter(range(1000))

    def add(dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str] | None = None,
            version: str = "1.0") -> Path:
        root = make_dist(tmp_path / f"site{next(counter)}", dist, entry_points, modules, version)
        monkeypatch.syspath_prepend(str(root))
        return root

    yield add
    reset_plugin_manager()
    reset_current_platform()
