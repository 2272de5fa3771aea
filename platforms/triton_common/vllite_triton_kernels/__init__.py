"""Triton paged attention and multi-LoRA kernels shared by vllite's GPU platforms.

``triton_status()`` says whether Triton can be used here (importable, and with
a backend for the wanted device, or the interpreter); ``TritonPagedAttention``
is the backend; ``TritonModelOps`` the model ops (multi-LoRA's shrink/expand);
``kernels`` and ``lora_kernels`` hold the ``@triton.jit`` kernels themselves and
are imported only when used, so importing this package never needs Triton.
"""
from __future__ import annotations

from vllite_triton_kernels.status import interpreter_enabled, triton_backends, triton_status

__all__ = ["TritonModelOps", "TritonPagedAttention", "interpreter_enabled", "triton_backends", "triton_status"]


def __getattr__(name: str):  # lazy: the backend module imports triton
    if name == "TritonPagedAttention":
        from vllite_triton_kernels.backend import TritonPagedAttention

        return TritonPagedAttention
    if name == "TritonModelOps":
        from vllite_triton_kernels.model_ops import TritonModelOps

        return TritonModelOps
    raise AttributeError(name)
