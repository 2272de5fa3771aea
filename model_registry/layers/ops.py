"""Plain torch ops for a model's layers to pin (``ops=TORCH_OPS``) where the model keeps torch's own numerics
(``F.linear``, the order transformers computes in) rather than the platform's kernels: encoders and towers
whose tests match Hugging Face bit for bit, off the decode path."""
from __future__ import annotations

from vllite_core.model_ops import ModelOps

TORCH_OPS = ModelOps()
