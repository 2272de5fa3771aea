"""Test-only global logits processor (``--logits-processors think_forcer:ForceTokens``): a request
whose prompt holds the trigger token ids generates exactly the forced ids (the last one EOS), so
a random tiny model's output really contains ``<think>`` ... ``</think>``; every other request
samples the model untouched. Ids come from the environment the test starts the server with."""
from __future__ import annotations

import os


def _ids(var: str) -> list[int]:
    return [int(x) for x in os.environ[var].split(",")]


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


class ForceTokens:
    def __init__(self) -> None:
        self.trigger = _ids("VLLITE_TEST_TRIGGER_IDS")
        self.forced = _ids("VLLITE_TEST_FORCED_IDS")

    def apply(self, logits, batch):
        for row, (prompt, out) in enumerate(zip(batch.prompt_token_ids, batch.output_token_ids)):
            if len(out) < len(self.forced) and _contains(list(prompt), self.trigger):
                logits[row] = float("-inf")
                logits[row, self.forced[len(out)]] = 0.0
        return logits
