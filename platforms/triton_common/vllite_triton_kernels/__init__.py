"""Triton paged attention shared by vllite's GPU platforms.

``triton_status()`` says whether Triton can be used here (importable, and with
a backend for the wanted device, or the interpreter); ``TritonPagedAttention``
is the backend; ``kernels`` holds the ``@triton.jit`` kernels themselves and is
imported only when a backend is built, so importing this package never needs
Triton.
"""
from __future__ import annotations

from vllite_triton_kernels.status import interpreter_enabled, triton_backends, triton_status

__all__ = ["TritonPagedAttention", "interpreter_enabled", "triton_backends", "triton_status"]


def __getattr__(name: str):  # lazy: the backend module imports triton
    if name == "TritonPagedAttention":
        from vllite_triton_kernels.backend import TritonPagedAttention

        return TritonPagedAttention
    raise AttributeError(name)
