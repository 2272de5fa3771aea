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


# Fault injection (tests/engine/test_fault_isolation.py): a prompt starting with one of these token ids
# triggers the fault in its own row only.
FAIL_TOKEN, NAN_TOKEN, BREAK_TOKEN = 497, 498, 496


class FailFor:
    """Raises for the rows whose prompt starts with FAIL_TOKEN; writes NaN into rows starting with NAN_TOKEN."""

    def apply(self, logits: torch.Tensor, batch) -> torch.Tensor:
        for i, prompt in enumerate(batch.prompt_token_ids):
            if prompt[0] == FAIL_TOKEN:
                raise ValueError(f"FailFor refuses request {batch.req_ids[i]}")
            if prompt[0] == NAN_TOKEN:
                logits[i, 5] = float("nan")
        return logits


class BreakOnce:
    """Raises once, on the first batch holding a prompt that starts with BREAK_TOKEN, and never again
    (not even for that row alone): a fault that belongs to no request."""

    broken = False

    def apply(self, logits: torch.Tensor, batch) -> torch.Tensor:
        if not BreakOnce.broken and any(p[0] == BREAK_TOKEN for p in batch.prompt_token_ids):
            BreakOnce.broken = True
            raise RuntimeError("BreakOnce: injected fault outside any request")
        return logits
