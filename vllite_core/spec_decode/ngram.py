"""Prompt-lookup (ngram) proposer: find the longest suffix of the history, between prompt_lookup_min and
prompt_lookup_max tokens long, that occurred earlier, and propose the tokens that followed it there.

Vectorised over the batch with one tensor comparison per suffix length (no loop over positions): the
windows of every row are compared with that row's suffix at once; the most recent match wins.
"""
from __future__ import annotations

import numpy as np
import torch

from vllite_core.config.speculative import SpeculativeConfig


class NgramProposer:
    def __init__(self, spec_config: SpeculativeConfig, config: object = None) -> None:
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.min_n = int(spec_config.prompt_lookup_min or 1)
        self.max_n = int(spec_config.prompt_lookup_max or self.min_n)

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        num_rows = len(num_tokens)
        if num_rows == 0:
            return []
        width = int(num_tokens.max())
        toks = torch.from_numpy(np.ascontiguousarray(token_ids[:, :width]))
        lens = torch.from_numpy(num_tokens.astype(np.int64))
        best_start = torch.full((num_rows,), -1, dtype=torch.long)
        best_n = torch.zeros(num_rows, dtype=torch.long)
        for n in range(self.max_n, self.min_n - 1, -1):
            if width < n + 1:
                continue
            suffix = toks.gather(1, (lens - n).clamp(min=0).unsqueeze(1) + torch.arange(n))  # [B, n]
            windows = toks.unfold(1, n, 1)  # [B, width - n + 1, n]: the window starting at each position
            starts = torch.arange(windows.shape[1])
            # A window must end before the last token (so it is not the suffix itself and a token follows it).
            match = (windows == suffix.unsqueeze(1)).all(dim=-1) & (starts.unsqueeze(0) + n < lens.unsqueeze(1))
            latest = torch.where(match, starts, -1).amax(dim=1)
            take = (best_start < 0) & (latest >= 0)
            best_start = torch.where(take, latest, best_start)
            best_n = torch.where(take, torch.full_like(best_n, n), best_n)
        first = (best_start + best_n).numpy()
        count = np.where(best_start.numpy() >= 0, np.minimum(num_tokens - first, self.num_speculative_tokens), 0)
        return [token_ids[i, first[i]:first[i] + count[i]].tolist() if count[i] > 0 else [] for i in range(num_rows)]
