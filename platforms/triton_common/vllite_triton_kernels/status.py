"""Can Triton be used here, and for which device? Probes that import nothing heavy."""
from __future__ import annotations

import importlib.util
import os


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1: kernels run in Triton's numpy interpreter on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_backends() -> list[str] | None:
    """Names of the compiler backends this Triton build ships ("nvidia", "amd", "intel"), None without Triton.

    Read from the ``triton/backends`` folder, so asking does not import Triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    found: list[str] = []
    for root in spec.submodule_search_locations:
        folder = os.path.join(root, "backends")
        if os.path.isdir(folder):
            found += [d for d in sorted(os.listdir(folder))
                      if os.path.isfile(os.path.join(folder, d, "compiler.py"))]
    return found


def triton_status(backend: str | None = None) -> tuple[bool, str]:
    """(usable, why). ``backend`` names the Triton backend the device needs (nvidia, amd, intel)."""
    names = triton_backends()
    if names is None:
        return False, "triton is not installed"
    if interpreter_enabled():
        return True, "TRITON_INTERPRET=1 (interpreter)"
    if backend is not None and backend not in names:
        return False, f"this triton build has no {backend!r} backend (it has {', '.join(names) or 'none'})"
    return True, f"triton with backends {', '.join(names)}"
