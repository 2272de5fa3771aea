"""What the GPU platforms built on these kernels (cuda, rocm, xpu) share: one choice between Triton's kernels and
torch SDPA, made from ``VLLITE_ATTENTION_BACKEND`` and the device, which their attention backend and model ops
both follow. Importing this module never imports Triton."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllite_core.attention import AttentionBackend
    from vllite_core.config import VlliteConfig
    from vllite_core.model_ops import ModelOps

BACKEND_ENV = "VLLITE_ATTENTION_BACKEND"  # triton | sdpa


def choose_backend(vendor: str, requested: str | None, unfit: str | None = None) -> tuple[str, str]:
    """("triton" | "sdpa", why). ``vendor``: Triton's backend name for the device ("nvidia", "amd", "intel");
    ``requested``: the environment variable's value; ``unfit``: why this device cannot run the kernels even
    where Triton can (a CUDA GPU below compute capability 7.5), or None."""
    from vllite_triton_kernels import triton_status  # looked up at call time: tests replace it

    requested = (requested or "").strip().lower() or None
    if requested not in (None, "triton", "sdpa"):
        raise ValueError(f"{BACKEND_ENV}: expected 'triton' or 'sdpa', got {requested!r}")
    if requested == "sdpa":
        return "sdpa", f"{BACKEND_ENV}=sdpa"
    ok, why = triton_status(vendor)
    if ok and unfit:
        ok, why = False, unfit
    if ok:
        return "triton", why
    if requested == "triton":
        raise RuntimeError(f"{BACKEND_ENV}=triton but Triton cannot be used: {why}")
    return "sdpa", f"Triton unusable ({why}): torch SDPA fallback"


class TritonChoiceMixin:
    """Listed before ``Platform`` in a GPU platform's bases: its attention backend and model ops follow the
    platform's ``attention_choice()``."""

    name: str

    def attention_choice(self) -> tuple[str, str]:
        raise NotImplementedError

    def get_attention_backend(self, config: "VlliteConfig") -> "AttentionBackend":
        kind, why = self.attention_choice()
        logging.getLogger(f"vllite.platforms.{self.name}").info("%s attention: %s (%s)", self.name, kind, why)
        if kind == "triton":
            from vllite_triton_kernels import TritonPagedAttention

            return TritonPagedAttention()
        from vllite_core.attention.sdpa import SdpaPagedAttention

        return SdpaPagedAttention()

    def model_ops(self, config: "VlliteConfig") -> "ModelOps":
        """Triton's kernels (multi-LoRA shrink/expand, fused MoE) where attention runs in Triton; torch otherwise."""
        if self.attention_choice()[0] == "triton":
            from vllite_triton_kernels import TritonModelOps

            return TritonModelOps()
        return super().model_ops(config)  # type: ignore[misc]
