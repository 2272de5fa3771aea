"""Platform resolution through the real entry-point machinery."""
from __future__ import annotations

import importlib
import re

import pluggy
import pytest
import torch
from plugin_fakes import PLATFORM_SRC, REPO, fresh_plugins, platform_module, unique  # noqa: F401

from vllite_core.platforms.resolve import (
    PlatformResolutionError,
    current_platform,
    current_resolution,
    discover_platforms,
    reset_current_platform,
    resolve_platform,
    set_current_platform_for_tests,
)
from vllite_core.plugins import PLATFORMS_GROUP, PluginError, hookimpl, hookspecs

torch.set_num_threads(1)


def add_platform(fresh_plugins, dist: str, name: str, **kw) -> str:
    mod = unique(name)
    fresh_plugins(dist, {PLATFORMS_GROUP: {name: mod}}, {mod: platform_module("P_" + name.title(), name, **kw)})
    return mod


def test_auto_picks_cpu_over_dummy(fresh_plugins):
    res = resolve_platform()
    assert res.platform.name == "cpu"
    assert "highest priority" in res.reason and "dummy" in res.reason
    dummy = next(c for c in res.candidates if c.name == "dummy")
    assert (dummy.distribution, dummy.available, dummy.priority) == ("vllite-dummy-platform", True, -10)
    assert res.chosen.distribution == "vllite-platform-cpu"


def test_dummy_selected_by_env(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLITE_PLATFORM", "dummy")
    res = resolve_platform()
    assert res.platform.name == "dummy" and type(res.platform).__module__ == "vllite_dummy_platform"
    assert "VLLITE_PLATFORM=dummy" in res.reason
    assert current_platform().name == "dummy"


def test_argument_beats_env_and_auto_means_auto(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLITE_PLATFORM", "dummy")
    assert resolve_platform("cpu").platform.name == "cpu"
    monkeypatch.setenv("VLLITE_PLATFORM", "auto")
    assert resolve_platform().platform.name == "cpu"


def test_unknown_explicit_name(fresh_plugins):
    with pytest.raises(PlatformResolutionError) as err:
        resolve_platform("warp")
    msg = str(err.value)
    assert "unknown platform 'warp'" in msg and "cpu" in msg and "dummy" in msg
    assert {c.name for c in err.value.candidates} >= {"cpu", "dummy"}


def test_explicit_platform_whose_plugin_failed(fresh_plugins):
    mod = unique("fancy")
    fresh_plugins("vllite-platform-fancy", {PLATFORMS_GROUP: {"fancy": mod}},
                  {mod: "raise ImportError('libfancy.so: cannot open shared object file')\n"}, "3.1")
    with pytest.raises(PluginError) as err:
        resolve_platform("fancy")
    msg = str(err.value)
    assert "vllite-platform-fancy 3.1" in msg and "libfancy.so" in msg and "ImportError" in msg
    # Automatic resolution is not disturbed, but the failure is listed.
    res = resolve_platform()
    assert res.platform.name == "cpu" and [f.name for f in res.failed_plugins] == ["fancy"]
    with pytest.raises(PlatformResolutionError, match="fancy.*ImportError"):
        resolve_platform("nosuch")


def test_explicit_platform_blocked_by_allowlist(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLITE_PLUGINS", "cpu")
    with pytest.raises(PluginError, match="VLLITE_PLUGINS"):
        resolve_platform("dummy")


def test_explicit_unavailable_platform_is_refused(fresh_plugins):
    add_platform(fresh_plugins, "fancy-dist", "fancy", available=False, priority=500, reason="no fancy card in slot 0")
    with pytest.raises(PlatformResolutionError) as err:
        resolve_platform("fancy")
    assert "not available" in str(err.value) and "no fancy card in slot 0" in str(err.value)
    assert resolve_platform().platform.name == "cpu"  # never auto-selected either


def test_tie_at_top_priority_names_candidates(fresh_plugins):
    add_platform(fresh_plugins, "alpha-dist", "alpha", priority=50)
    add_platform(fresh_plugins, "beta-dist", "beta", priority=50)
    with pytest.raises(PlatformResolutionError) as err:
        resolve_platform()
    msg = str(err.value)
    assert "alpha (alpha-dist)" in msg and "beta (beta-dist)" in msg
    assert "--device" in msg and "VLLITE_PLATFORM" in msg
    assert resolve_platform("beta").platform.name == "beta"


def test_raising_detector_is_diagnosed_not_fatal(fresh_plugins):
    add_platform(fresh_plugins, "flaky-dist", "flaky", detect_raises="driver exploded")
    res = resolve_platform()
    assert res.platform.name == "cpu"
    flaky = next(c for c in res.candidates if c.name == "flaky")
    assert not flaky.available and flaky.error == "detect() raised RuntimeError: driver exploded"
    with pytest.raises(PlatformResolutionError, match="driver exploded"):
        resolve_platform("flaky")


def test_no_available_platform_lists_diagnostics(fresh_plugins, monkeypatch):
    add_platform(fresh_plugins, "gone-dist", "gone", available=False, reason="unplugged")
    monkeypatch.setenv("VLLITE_PLUGINS", "gone")
    with pytest.raises(PlatformResolutionError) as err:
        resolve_platform()
    msg = str(err.value)
    assert "no available platform" in msg and "gone (gone-dist 1.0): unavailable" in msg and "unplugged" in msg


def test_register_hook_that_raises_is_attributed(fresh_plugins):
    mod = unique("hookboom")
    source = ("from vllite_core.plugins import hookimpl\nVLLITE_PLUGIN_API = (1, 0)\n"
              "@hookimpl\ndef vllite_register_platforms():\n    raise ValueError('bad table')\n")
    fresh_plugins("hookboom-dist", {PLATFORMS_GROUP: {"hookboom": mod}}, {mod: source})
    res = resolve_platform()
    bad = next(c for c in res.candidates if c.plugin == "hookboom")
    assert bad.distribution == "hookboom-dist" and "ValueError: bad table" in bad.error


def test_platform_class_with_incompatible_api(fresh_plugins):
    mod = add_platform(fresh_plugins, "old-dist", "old", priority=99)
    importlib.import_module(mod).P_Old.plugin_api = (0, 1)
    res = resolve_platform()
    old = next(c for c in res.candidates if c.name == "old")
    assert res.platform.name == "cpu" and "incompatible" in old.error


def test_discover_with_plain_pluggy_manager():
    pm = pluggy.PluginManager("vllite")
    pm.add_hookspecs(hookspecs)
    from vllite_platform_cpu.platform import CpuPlatform

    class Plug:
        @hookimpl
        def vllite_register_platforms(self):
            return [CpuPlatform, int]

    pm.register(Plug(), name="plug")
    found = discover_platforms(pm)
    assert found[0].cls is CpuPlatform and found[0].plugin == "plug"
    assert found[1].cls is None and "not a Platform subclass" in found[1].error
    assert resolve_platform(pm=pm).platform.name == "cpu"


def test_current_platform_is_cached(fresh_plugins):
    first = current_platform()
    assert current_platform() is first and current_platform("cpu") is first
    with pytest.raises(PlatformResolutionError, match="cannot switch"):
        current_platform("dummy")
    reset_current_platform()
    assert current_platform("dummy").name == "dummy"
    from vllite_dummy_platform import DummyPlatform

    forced = DummyPlatform()
    set_current_platform_for_tests(forced)
    assert current_platform() is forced and current_resolution().chosen is None


def test_accelerator_platforms_are_never_selected_here(fresh_plugins, monkeypatch):
    """cuda/rocm/xpu/tpu plugins from source: detected unavailable on this CPU-only machine."""
    for name in ("cuda", "rocm", "xpu", "tpu"):
        monkeypatch.syspath_prepend(str(PLATFORM_SRC[name]))
        fresh_plugins(f"vllite-platform-{name}", {PLATFORMS_GROUP: {name: f"vllite_platform_{name}"}}, {}, "0.1.0")
    res = resolve_platform()
    assert res.platform.name == "cpu"
    accel = {c.name: c for c in res.candidates if c.name in ("cuda", "rocm", "xpu", "tpu")}
    assert set(accel) == {"cuda", "rocm", "xpu", "tpu"}
    assert all(not c.available and c.error is None and c.reason for c in accel.values())
    assert [accel[n].priority for n in ("cuda", "rocm", "xpu", "tpu")] == [100, 100, 90, 80]
    for name in accel:
        with pytest.raises(PlatformResolutionError, match="not available"):
            resolve_platform(name)


def test_core_names_no_device_module():
    """DESIGN: the core never touches a device module; only platforms/ may."""
    offenders = []
    for path in (REPO / "vllite_core").rglob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\btorch\.(cuda|xpu|mps)\b|\btorch_xla\b", code):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "device modules used in the core:\n" + "\n".join(offenders)
