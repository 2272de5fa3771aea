"""The runner's half of the encoder cache: encoder outputs by content hash, and their rows scattered into a
step's input embeddings.

The scheduler decides everything (what to encode, what to drop); this mirrors it. Each step: drop the freed
hashes, run the model's vision encoder on the scheduled images (one batch), then for every scheduled token that
is an image placeholder take the matching row of that image's output.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite_core.multimodal.features import MultiModalFeature


class EncoderRunner:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: dict[str, torch.Tensor] = {}  # content hash -> [rows, hidden] embeddings
        self.features: dict[str, list[MultiModalFeature]] = {}  # request id -> its images
        self.num_encoded = 0  # images run through the encoder (a benchmark counter)

    def add_request(self, req_id: str, features: list[MultiModalFeature]) -> None:
        if features:
            self.features[req_id] = features

    def remove_request(self, req_id: str) -> None:
        self.features.pop(req_id, None)

    def update(self, free_hashes: list[str], to_encode: list[MultiModalFeature]) -> None:
        for h in free_hashes:
            self.cache.pop(h, None)
        if not to_encode:
            return
        outputs = self.model.embed_multimodal([f.data for f in to_encode])
        for f, emb in zip(to_encode, outputs, strict=True):
            if emb.shape[0] != f.length:
                raise RuntimeError(f"the encoder gave {emb.shape[0]} rows for an image with {f.length} placeholders")
            self.cache[f.identifier] = emb
        self.num_encoded += len(to_encode)

    def gather(self, req_ids: list[str], computed: np.ndarray, num_sched: np.ndarray, starts: np.ndarray
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat token indices, embedding rows) of the step's placeholder tokens, None when there are none.
        ``req_ids[i]`` runs tokens [computed[i], computed[i] + num_sched[i]) at flat index starts[i]."""
        index: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for i, rid in enumerate(req_ids):
            feats = self.features.get(rid)
            if not feats:
                continue
            lo, hi = int(computed[i]), int(computed[i] + num_sched[i])
            for f in feats:
                a, b = max(lo, f.offset), min(hi, f.end)
                if a >= b:
                    continue
                emb = self.cache.get(f.identifier)
                if emb is None:
                    raise RuntimeError(f"request {rid}: image {f.identifier[:12]} is not in the encoder cache")
                index.append(np.arange(a, b) - lo + int(starts[i]))
                rows.append(emb[a - f.offset:b - f.offset])
        if not rows:
            return None
        dev = rows[0].device
        return torch.as_tensor(np.concatenate(index), device=dev), torch.cat(rows)
