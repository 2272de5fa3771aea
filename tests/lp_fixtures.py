"""A global logits processor used by the tests (loaded by import path, like a user's would be)."""
from __future__ import annotations

import torch


class BanToken:
    """Bans the token named by each request's extra_args["ban"] (global processor, per-request knob)."""

    def apply(self, logits: torch.Tensor, batch) -> torch.Tensor:
        for i, params in enumerate(batch.params):
            tid = params.extra_args.get("ban")
            if tid is not None:
                logits[i, tid] = float("-inf")
        return logits
