"""Prompt-lookup (ngram) proposer: find the longest suffix of the history, between prompt_lookup_min and
prompt_lookup_max tokens long, that occurred earlier, and propose the tokens that followed it there.

Vectorised over the batch (no loop over positions): for j < prompt_lookup_max, every position of every
row is compared with the row's j-th last token at once, giving the length of the match ending at each
position; the longest match (capped at prompt_lookup_max) wins, then the most recent one.
"""
from __future__ import annotations

import numpy as np
import torch

from vllite_core.config.speculative import SpeculativeConfig
from vllite_core.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, spec_config: SpeculativeConfig, config: object = None) -> None:
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.min_n = int(spec_config.prompt_lookup_min or 1)
        self.max_n = int(spec_config.prompt_lookup_max or self.min_n)

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        num_rows = len(num_tokens)
        if num_rows == 0:
            return []
        # Any match ends at an earlier copy of the last token: rows without one (most rows of a history that
        # never repeats) are answered without building the match tables, the cost when nothing is proposed.
        last = token_ids[np.arange(num_rows), num_tokens - 1]
        earlier = np.arange(token_ids.shape[1])[None, :] < (num_tokens - 1)[:, None]
        keep = np.nonzero(((token_ids == last[:, None]) & earlier).any(axis=1))[0]
        if len(keep) < num_rows:
            drafts: list[list[int]] = [[] for _ in range(num_rows)]
            if len(keep):
                for i, d in zip(keep.tolist(), self._match(token_ids[keep], num_tokens[keep])):
                    drafts[i] = d
            return drafts
        return self._match(token_ids, num_tokens)

    def _match(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        num_rows = len(num_tokens)
        width, max_n = int(num_tokens.max()), self.max_n
        toks = torch.from_numpy(np.ascontiguousarray(token_ids[:, :width]))
        lens = torch.from_numpy(num_tokens.astype(np.int64))
        # Left padding that matches nothing, so a match never runs off the start of a row.
        padded = torch.cat([torch.full((num_rows, max_n), -2, dtype=toks.dtype), toks], dim=1)
        # run[b, e]: how many tokens ending at e equal the row's last tokens (its suffix), up to max_n.
        run = torch.zeros(num_rows, width, dtype=torch.long)
        alive = torch.ones(num_rows, width, dtype=torch.bool)
        for j in range(max_n):
            pos = lens - 1 - j
            last = torch.where(pos >= 0, toks.gather(1, pos.clamp(min=0).unsqueeze(1)).squeeze(1), -1)
            alive &= padded[:, max_n - j:max_n - j + width] == last.unsqueeze(1)
            run += alive
        # A match must end before the last token (so it is not the suffix itself and a token follows it).
        ends = torch.arange(width)
        ok = (run >= self.min_n) & (ends.unsqueeze(0) < (lens - 1).unsqueeze(1))
        # The longest match wins, then the most recent one.
        score = torch.where(ok, run * (width + 1) + ends, -1)
        best = score.argmax(dim=1)
        found = score.gather(1, best.unsqueeze(1)).squeeze(1) >= 0
        first = (best + 1).numpy()
        count = np.where(found.numpy(), np.minimum(num_tokens - first, self.num_speculative_tokens), 0)
        return [token_ids[i, first[i]:first[i] + count[i]].tolist() if count[i] > 0 else [] for i in range(num_rows)]
