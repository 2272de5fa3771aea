"""The first-use build of the kernels' default variant, as ``load()`` makes it when no installed module is
usable; run ahead of its test by conftest.py (VLLITE_CACHE_ROOT names the folder). It writes ``built`` (the
origin and variant load() reports, or its error) when done."""
import os

from vllite_platform_cpu import kernels

folder = os.environ["VLLITE_CACHE_ROOT"]
try:
    kernels._installed_state = (None, "ImportError: hidden by the test")
    kernels.load()
    result = f"{kernels.origin()} {kernels.variant()} {kernels.error()}"
except BaseException as e:  # noqa: BLE001 - the test reports it
    result = f"failed: {type(e).__name__}: {e}"
with open(os.path.join(folder, "built.tmp"), "w") as f:
    f.write(result)
os.replace(os.path.join(folder, "built.tmp"), os.path.join(folder, "built"))
