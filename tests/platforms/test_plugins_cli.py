"""`vllite plugins` and `vllite env`, as a user runs them (subprocess) and in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plugin_fakes import REPO, fresh_plugins, platform_module, unique  # noqa: F401

from vllite_core.entrypoints.cli import main
from vllite_core.plugins import PLATFORMS_GROUP, VLLITE_PLUGIN_API

torch.set_num_threads(1)


def run_cli(*args: str, console_script: bool = False, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLITE_PLATFORM", "VLLITE_PLUGINS")}
    full_env.update(env, OMP_NUM_THREADS="1")
    script = Path(sys.executable).with_name("vllite")
    cmd = [str(script)] if console_script else [sys.executable, "-m", "vllite_core.entrypoints.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=full_env, cwd=REPO, timeout=120)


def test_plugins_json_console_script():
    proc = run_cli("plugins", "--json", console_script=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    cpu = next(p for p in data["plugins"] if p["name"] == "cpu")
    assert cpu["status"] == "loaded" and cpu["distribution"] == "vllite-platform-cpu"
    assert cpu["hooks"] == ["vllite_register_platforms"] and data["plugin_api"] == "%d.%d" % VLLITE_PLUGIN_API


def test_env_json_resolves_cpu():
    proc = run_cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["platform"]["name"] == "cpu" and data["platform"]["distribution"] == "vllite-platform-cpu"
    assert data["error"] is None and "highest priority" in data["reason"]
    assert data["torch"] == torch.__version__
    lost = {c["name"]: c for c in data["candidates"]}
    assert lost["dummy"]["priority"] == -10 and lost["dummy"]["reason"]


def test_env_failure_still_prints_diagnostics():
    proc = run_cli("env", "--json", VLLITE_PLATFORM="nosuchdevice")
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["platform"] is None and "unknown platform 'nosuchdevice'" in data["error"]
    assert {c["name"] for c in data["candidates"]} >= {"cpu", "dummy"}
    assert "unknown platform" in proc.stderr


def test_env_text_with_device(fresh_plugins, capsys):
    assert main(["env", "--device", "dummy"]) == 0
    out = capsys.readouterr().out
    assert "platform:      dummy (vllite-dummy-platform" in out and "--device/device=dummy" in out
    assert "cpu" in out and "available" in out


def test_plugins_text_shows_failures(fresh_plugins, capsys):
    mod = unique("clibroken")
    fresh_plugins("broken-platform-dist", {PLATFORMS_GROUP: {"brk": mod}}, {mod: "raise RuntimeError('boom')\n"})
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("brk "))
    assert "broken-platform-dist" in line and "failed: RuntimeError: boom" in line
    assert main(["env"]) == 0  # cpu still resolves
    out = capsys.readouterr().out
    assert "brk" in out and "RuntimeError: boom" in out


def test_env_text_unavailable_device_exits_nonzero(fresh_plugins, capsys):
    mod = unique("absent")
    fresh_plugins("absent-dist", {PLATFORMS_GROUP: {"absent": mod}},
                  {mod: platform_module("Absent", "absent", available=False, reason="no card")})
    assert main(["env", "--device", "absent"]) == 1
    captured = capsys.readouterr()
    assert "platform:      none resolved" in captured.out and "no card" in captured.out
    assert "not available" in captured.err


def test_cli_requires_a_command():
    with pytest.raises(SystemExit):
        main([])
