"""The CPU platform's own tests (``pytest platforms/cpu/tests``).

The first-use build test compiles the kernels' default variant (minutes of compiling on two cores). The build
starts once the test is known to be collected, in a background process at a lower CPU priority (nice 5: about a
quarter of a core beside two busy workers, all of an idle one; at nice 19 it got so little that the suite's last
four minutes waited for it), so it compiles beside the other tests; the test, collected last (pyproject's
testpaths), then loads what it built. The controlling pytest process owns
the build (under pytest-xdist the controller, which outlives the workers) and removes it at the end."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Two cores shared by everything: OpenMP threads that spin while waiting starve the other process.
# Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BUILD_DIR_ENV = "VLLITE_TEST_FIRST_USE_BUILD_DIR"  # set by the controller; workers inherit it
BUILD_TEST = "test_kernel_variants.py::test_first_use_build_matches_the_installed_variant"
BUILD_SCRIPT = os.path.join(os.path.dirname(__file__), "first_use_build.py")
_build: dict[str, subprocess.Popen] = {}


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _start_build(node_ids: list[str]) -> None:
    folder = os.environ.get(BUILD_DIR_ENV)
    if _build or not folder or not any(i.endswith(BUILD_TEST) for i in node_ids):
        return
    env = {**os.environ, "VLLITE_CACHE_ROOT": folder, "VLLITE_CPU_ISA": "default", "MAX_JOBS": "1",
           "OMP_NUM_THREADS": "1"}
    with open(os.path.join(folder, "build.log"), "w") as log:
        _build["proc"] = subprocess.Popen([sys.executable, BUILD_SCRIPT], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=lambda: os.nice(5))
    with open(os.path.join(folder, "pid"), "w") as f:
        f.write(str(_build["proc"].pid))


def pytest_configure(config: pytest.Config) -> None:
    if not _is_worker(config):  # workers are started after this: they inherit the folder's name
        os.environ[BUILD_DIR_ENV] = tempfile.mkdtemp(prefix="vllite-first-use-build-")


@pytest.fixture
def first_use_build_dir() -> str:
    """Where the build started at collection writes (its cache root)."""
    return os.environ[BUILD_DIR_ENV]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _start_build(list(ids))


def pytest_collection_finish(session: pytest.Session) -> None:
    if not _is_worker(session.config):  # pytest without workers
        _start_build([item.nodeid for item in session.items])


def pytest_unconfigure(config: pytest.Config) -> None:
    if _is_worker(config):
        return
    proc = _build.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(os.environ.pop(BUILD_DIR_ENV, ""), ignore_errors=True)
