"""scripts/uv_pip_args.py hands pip's package sources to uv (scripts/setup.sh): a pip that prints a known
`pip config list` stands in for the real one."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "uv_pip_args.py")

CONFIG = """\
global.cert='/etc/ssl/certs/global.pem'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/wheels'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
:env:.cert='/etc/ssl/certs/env.pem'
:env:.find-links='/env/wheels\\n/env/more'
:env:.no-index='true'
:env:.default-timeout='180'
site.find-links='/ignored'
"""


def _fake_pip(tmp_path, config: str) -> str:
    pip = tmp_path / "pip"
    pip.write_text(f"#!{sys.executable}\nimport sys\nassert sys.argv[1:] == ['config', 'list']\n"
                   f"sys.stdout.write({config!r})\n")
    pip.chmod(pip.stat().st_mode | stat.S_IXUSR)
    return str(pip)


def _run(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_sources_map_to_uv_options_with_pip_precedence(tmp_path):
    cert, *args = _run(_fake_pip(tmp_path, CONFIG))
    assert cert == "/etc/ssl/certs/env.pem"
    pairs = list(zip(args[0::2], args[1::2]))
    assert args[-2:] == ["--index-strategy", "unsafe-best-match"]
    assert ("--index-url", "https://install.example/simple") in pairs  # [install] over [global]
    assert ("--index-url", "https://global.example/simple") not in pairs
    assert [v for k, v in pairs if k == "--extra-index-url"] == ["file:///opt/a/simple", "file:///opt/b/simple"]
    assert [v for k, v in pairs if k == "--find-links"] == ["/env/wheels", "/env/more"]  # the environment wins
    assert ("--constraint", "/etc/pip/constraints.txt") in pairs
    assert "--no-index" in args and "/ignored" not in args and "180" not in args


def test_no_configuration_leaves_uv_its_defaults(tmp_path):
    assert _run(_fake_pip(tmp_path, "")) == ["", "--index-strategy", "unsafe-best-match"]


def test_a_failing_pip_fails_the_script(tmp_path):
    pip = tmp_path / "pip"
    pip.write_text("#!/bin/sh\nexit 3\n")
    pip.chmod(pip.stat().st_mode | stat.S_IXUSR)
    proc = subprocess.run([sys.executable, SCRIPT, str(pip)], capture_output=True, text=True)
    assert proc.returncode != 0
