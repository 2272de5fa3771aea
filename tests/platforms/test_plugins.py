"""Plugin loading: entry points, built-ins, API versions, allowlist, error records."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from plugin_fakes import fresh_plugins, unique  # noqa: F401  (fixture)

from vllite_core.plugins import (
    PLATFORMS_GROUP,
    PLUGINS_GROUP,
    VLLITE_PLUGIN_API,
    PluginError,
    get_plugin_manager,
    list_plugins,
    reset_plugin_manager,
)
from vllite_core.plugins.loading import Allowlist, api_incompatibility, one_line_error, parse_api_version

torch.set_num_threads(1)

GOOD_PLUGIN = """
from vllite_core.plugins import hookimpl
VLLITE_PLUGIN_API = {api}

@hookimpl
def vllite_register_logits_processors():
    return []
"""


def by_name(name: str):
    return next(i for i in list_plugins() if i.name == name)


def test_installed_cpu_platform_is_loaded(fresh_plugins):
    info = by_name("cpu")
    assert (info.group, info.distribution, info.status) == (PLATFORMS_GROUP, "vllite-platform-cpu", "loaded")
    assert info.hooks == ["vllite_register_platforms"]
    assert info.version and info.reason == ""


def test_builtin_models_go_through_the_same_manager(fresh_plugins):
    info = by_name("builtin-models")
    assert info.builtin and info.distribution == "vllite" and info.module == "model_registry.builtin"
    if importlib.util.find_spec("model_registry.builtin") is not None:
        assert info.status == "loaded", info.reason
        assert "vllite_register_models" in info.hooks


def test_manager_is_loaded_once_per_process(fresh_plugins):
    pm = get_plugin_manager()
    assert get_plugin_manager() is pm
    reset_plugin_manager()
    assert get_plugin_manager() is not pm


def test_good_plugin_loaded_with_hooks(fresh_plugins):
    mod = unique("goodplug")
    fresh_plugins("good-dist", {PLUGINS_GROUP: {"good": mod}}, {mod: GOOD_PLUGIN.format(api='"1.0"')}, "2.3")
    info = by_name("good")
    assert (info.distribution, info.version, info.status) == ("good-dist", "2.3", "loaded")
    assert info.hooks == ["vllite_register_logits_processors"]
    assert get_plugin_manager().hook.vllite_register_logits_processors() == [[]]


def test_plugin_raising_on_import_is_recorded_not_skipped(fresh_plugins):
    mod = unique("boomplug")
    fresh_plugins("boom-dist", {PLUGINS_GROUP: {"boom": mod}}, {mod: "raise RuntimeError('boom')\n"})
    info = by_name("boom")
    assert info.status == "failed"
    assert info.reason == "RuntimeError: boom"
    assert by_name("cpu").status == "loaded"  # the others still load


def test_plugin_with_missing_import(fresh_plugins):
    mod = unique("missingdep")
    fresh_plugins("needs-dist", {PLUGINS_GROUP: {"needs": mod}}, {mod: "import no_such_module_xyz\n"})
    info = by_name("needs")
    assert info.status == "failed"
    assert info.reason == "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    assert "\n" not in info.reason


@pytest.mark.parametrize("api, ok", [("(2, 0)", False), ("'1.9'", False), ("(0, 9)", False),
                                     ("'1.0'", True), ("[1, 0]", True)])
def test_api_version_check(fresh_plugins, api, ok):
    mod = unique("apiplug")
    fresh_plugins("api-dist", {PLUGINS_GROUP: {"apiplug": mod}}, {mod: GOOD_PLUGIN.format(api=api)})
    info = by_name("apiplug")
    if ok:
        assert info.status == "loaded", info.reason
    else:
        assert info.status == "failed"
        declared = ".".join(str(x) for x in parse_api_version(eval(api)))
        core = ".".join(str(x) for x in VLLITE_PLUGIN_API)
        assert declared in info.reason and core in info.reason and "incompatible" in info.reason


def test_missing_api_version(fresh_plugins):
    mod = unique("noapi")
    source = ("from vllite_core.plugins import hookimpl\n@hookimpl\n"
              "def vllite_register_logits_processors():\n    return []\n")
    fresh_plugins("noapi-dist", {PLUGINS_GROUP: {"noapi": mod}}, {mod: source})
    info = by_name("noapi")
    assert info.status == "failed" and "does not declare VLLITE_PLUGIN_API" in info.reason
    assert not get_plugin_manager().hook.vllite_register_logits_processors()  # not registered


def test_api_version_on_module_of_object_entry_point(fresh_plugins):
    mod = unique("objplug")
    source = GOOD_PLUGIN.format(api="(1, 0)") + "\nclass Obj:\n    pass\n"
    fresh_plugins("obj-dist", {PLUGINS_GROUP: {"objplug": f"{mod}:Obj"}}, {mod: source})
    assert by_name("objplug").status == "loaded"


def test_unknown_hook_name_fails(fresh_plugins):
    mod = unique("typo")
    source = ("from vllite_core.plugins import hookimpl\nVLLITE_PLUGIN_API = (1, 0)\n"
              "@hookimpl\ndef vllite_register_platfroms():\n    return []\n")
    fresh_plugins("typo-dist", {PLATFORMS_GROUP: {"typo": mod}}, {mod: source})
    info = by_name("typo")
    assert info.status == "failed" and "vllite_register_platfroms" in info.reason


def test_allowlist_blocks_without_importing(fresh_plugins, monkeypatch):
    mod = unique("blockedplug")
    fresh_plugins("blocked-dist", {PLUGINS_GROUP: {"blockme": mod}}, {mod: "raise RuntimeError('imported!')\n"})
    monkeypatch.setenv("VLLITE_PLUGINS", "vllite_platform_cpu, other")  # distribution name, normalised
    infos = {i.name: i for i in list_plugins()}
    assert infos["blockme"].status == "blocked" and "VLLITE_PLUGINS" in infos["blockme"].reason
    assert mod not in sys.modules
    assert infos["cpu"].status == "loaded"
    assert infos["dummy"].status == "blocked"
    assert infos["builtin-models"].status != "blocked"  # built-ins always load


def test_denylist(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLITE_PLUGINS", "-dummy")
    infos = {i.name: i for i in list_plugins()}
    assert infos["dummy"].status == "blocked" and "denied" in infos["dummy"].reason
    assert infos["cpu"].status == "loaded"


def test_require_failed_plugin_raises_plugin_error(fresh_plugins):
    mod = unique("reqplug")
    fresh_plugins("req-dist", {PLUGINS_GROUP: {"req": mod}}, {mod: "raise RuntimeError('boom')\n"}, "0.4")
    pm = get_plugin_manager()
    with pytest.raises(PluginError) as err:
        pm.require("req")
    msg = str(err.value)
    assert "'req'" in msg and "req-dist 0.4" in msg and "RuntimeError: boom" in msg
    assert isinstance(err.value, RuntimeError)
    assert pm.require("vllite-platform-cpu").name == "cpu"


def test_allowlist_parsing():
    assert Allowlist.from_env(None).why_blocked("x", "y") is None
    assert Allowlist.from_env("").why_blocked("x", "y")  # empty: nothing external allowed
    allow = Allowlist.from_env("Foo_Bar, -baz")
    assert allow.why_blocked("foo-bar", "d") is None
    assert allow.why_blocked("other", "foo.bar") is None
    assert "denied" in allow.why_blocked("baz", "d")
    assert "not in" in allow.why_blocked("qux", "d")


def test_api_helpers():
    assert parse_api_version("1.2") == (1, 2) and parse_api_version((1, 2)) == (1, 2)
    with pytest.raises(ValueError):
        parse_api_version("one")
    assert api_incompatibility((1, 0), core=(1, 3)) is None
    assert "1.4" in api_incompatibility((1, 4), core=(1, 3))
    assert "must be" in api_incompatibility(object(), core=(1, 0))
    assert one_line_error(RuntimeError("a\nb")) == "RuntimeError: a"
    assert one_line_error(KeyError()) == "KeyError"
