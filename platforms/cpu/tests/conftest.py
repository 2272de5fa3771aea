"""The CPU platform's own tests (``pytest platforms/cpu/tests``)."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Two cores shared by everything: OpenMP threads that spin while waiting starve the other process.
# Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FIRST_USE_TEST = "test_first_use_build_matches_the_installed_variant"
_FIRST_USE_KEY = pytest.StashKey[tuple]()

# What kernels.py does on a machine where the installed module is missing: build the chosen variant from the
# package's sources into the cache (VLLITE_CACHE_ROOT, VLLITE_CPU_ISA from the environment).
_FIRST_USE_SCRIPT = """
from vllite_platform_cpu import kernels
kernels._installed_state = (None, "ImportError: hidden by the test")
mod = kernels.load()
assert mod is not None and kernels.origin() == "jit", (kernels.origin(), kernels.error())
"""


def pytest_collection_finish(session):
    """The first-use build that FIRST_USE_TEST checks compiles one whole variant (minutes on two cores). It
    starts here, in a child process, as soon as the test is selected, and compiles beside the rest of the
    suite (which leaves a core idle much of the time: server start-ups, waits); the test then finds it built."""
    if not any(item.name == FIRST_USE_TEST for item in session.items):
        return
    root = tempfile.mkdtemp(prefix="vllite-first-use-")
    env = dict(os.environ, VLLITE_CACHE_ROOT=root, VLLITE_CPU_ISA="default")
    proc = subprocess.Popen([sys.executable, "-c", _FIRST_USE_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    session.config.stash[_FIRST_USE_KEY] = (proc, root)


def pytest_sessionfinish(session):
    started = session.config.stash.get(_FIRST_USE_KEY, None)
    if started is not None:
        proc, root = started
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def first_use_build(request):
    """(the finished child's exit code and output, the cache root it built into)."""
    proc, root = request.config.stash[_FIRST_USE_KEY]
    out, _ = proc.communicate()
    return proc.returncode, out, root
