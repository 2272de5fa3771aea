"""pytest plugin (entry point ``pytest11: vllite_conformance``) for the platform conformance kit.

Without ``--vllite-platform`` it only adds its options: it imports nothing
heavy and collects nothing, so ordinary test runs are untouched. With
``--vllite-platform NAME`` it adds the kit's test folder to the run: alone when
no test paths were given on the command line, beside them otherwise.
"""
from __future__ import annotations

import os

KIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("vllite", "vllite platform conformance kit")
    group.addoption("--vllite-platform", action="store", default=None, metavar="NAME",
                    help="run the vllite platform conformance kit against platform NAME (an installed "
                         "vllite.platforms entry point, e.g. cpu, cuda or your own)")
    group.addoption("--vllite-dtype", action="store", default=None, metavar="DTYPE",
                    help="model dtype for the kit's model checks (default: float32 when the platform supports "
                         "it, else its default dtype)")


def _platform(config) -> str | None:
    value = config.getoption("vllite_platform", None)
    return value.strip() if value and value.strip() else None


def pytest_configure(config) -> None:
    if _platform(config) is None:
        return
    config.addinivalue_line("markers", "vllite_conformance: a check of the vllite platform conformance kit")
    if getattr(config, "args_source", None) == config.ArgsSource.ARGS:
        if KIT_DIR not in config.args:
            config.args.append(KIT_DIR)
    else:  # no paths given: run the kit alone, not the project's testpaths
        config.args[:] = [KIT_DIR]


def pytest_ignore_collect(collection_path, config):
    # The kit's own tests need --vllite-platform; without it they are never collected.
    if _platform(config) is None and str(collection_path).startswith(KIT_DIR):
        return True
    return None


def pytest_report_header(config) -> str | None:
    name = _platform(config)
    return f"vllite conformance kit: platform {name!r}" if name else None
