"""The runner's M-RoPE bookkeeping (models declaring ``SupportsMRoPE``): each request with images keeps its
prompt's [3, n] positions and the delta every later token adds to its index (vLLM's mrope_position_delta).

Kept from the request's first admission until it finishes: a preempted request resumes with the same prompt,
so its positions and delta stand; a chunk takes the slice it covers, wherever it cuts an image.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class MRopePositions:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.reqs: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (prompt positions [3, n], delta)

    def add_request(self, req_id: str, token_ids: Any, num_prompt: int, features: list) -> None:
        """Requests without images need nothing: their positions are their indices."""
        if features and req_id not in self.reqs:
            pos, delta = self.model.get_mrope_input_positions(list(token_ids[:num_prompt]), features)
            self.reqs[req_id] = (np.asarray(pos, dtype=np.int64), int(delta))

    def remove_request(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    def step_positions(self, req_ids: list[str], index: np.ndarray, starts: np.ndarray, num_sched: np.ndarray
                       ) -> np.ndarray:
        """The step's rotary positions from its token indices (``req_ids[i]`` runs index[starts[i]:][:num_sched[i]]):
        [T] when no prompt token of a request with images is in the step (index + delta), else [3, T]."""
        if not self.reqs:
            return index
        flat = index
        prompt_parts: list[tuple[int, np.ndarray]] = []
        for i, rid in enumerate(req_ids):
            state = self.reqs.get(rid)
            if state is None:
                continue
            pos, delta = state
            lo, hi = int(starts[i]), int(starts[i] + num_sched[i])
            idx = index[lo:hi]
            k = int(np.searchsorted(idx, pos.shape[1]))  # tokens still in the prompt (indices ascend)
            if k < hi - lo:
                if flat is index:
                    flat = index.copy()
                flat[lo + k:hi] += delta
            if k:
                prompt_parts.append((lo, pos[:, idx[:k]]))
        if not prompt_parts:
            return flat
        out = np.broadcast_to(flat, (3, flat.shape[0])).copy()
        for lo, part in prompt_parts:
            out[:, lo:lo + part.shape[1]] = part
        return out
