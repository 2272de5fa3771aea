"""The model runner's speculative part: verify the step's drafts, propose the next ones.

Verification turns each request with k drafts into k + 1 sampling rows (one per position, the output
history extended by the drafts before it, see ``build_sampling_metadata``), runs the rejection sampler on
them, and keeps each request's accepted drafts plus the token after them. A fault of one request (a
processor raising on its row, a row with no finite logit) fails that request alone, as in plain sampling.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllite_core.sample.rejection_sampler import rejection_sample
from vllite_core.sample.sampler import RowFaults
from vllite_core.worker.input_batch import InputBatch
from vllite_core.worker.runner_request import RunnerRequest
from vllite_core.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger("vllite.spec_decode")


@dataclass
class VerifiedRow:
    row: int  # batch row
    token_ids: list[int]  # accepted drafts, then the emitted (recovered or bonus) token
    logprobs: list[tuple[list[int], list[float], int]] | None  # per token: (ids, values, rank), uncut
    num_drafts: int


def logits_indices(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Hidden-state rows to compute logits for: the last ``num_drafts + 1`` of each sampling request."""
    counts = num_drafts + 1
    first = np.repeat(ends - num_drafts, counts)
    return first + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def draft_probs(reqs: list[RunnerRequest], drafts: list[list[int]], draft_ids: torch.Tensor, vocab: int
                ) -> torch.Tensor | None:
    """q of every virtual row (request i: its drafts' rows, then its bonus row) from the q the proposer kept
    in the requests' records; None when none has any (q one-hot at each draft, as for ngram). A request
    without kept q (greedy) is one-hot too; bonus rows are zero."""
    if all(r.draft_probs is None for r in reqs):
        return None
    q = torch.zeros(len(draft_ids), vocab, dtype=torch.float32, device=draft_ids.device)
    has = (draft_ids >= 0).nonzero().squeeze(1)
    q[has, draft_ids[has]] = 1.0
    pos = 0
    for req, d in zip(reqs, drafts):
        qr = req.draft_probs
        if d and qr is not None and len(qr) >= len(d):
            q[pos:pos + len(d)] = qr[:len(d)]
        pos += len(d) + 1
    return q


def verify(runner: Any, hidden: torch.Tensor, inp: Any, drafts: list[list[int]], out: Any,
           grammar: Any = None) -> list[VerifiedRow]:
    """Sample every row of ``inp.sample_rows`` (``drafts[i]``: the drafts of sample row i, maybe none)."""
    b: InputBatch = runner.batch
    rows = inp.sample_rows
    counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    alive = np.ones(len(rows), dtype=bool)
    while True:
        live = np.nonzero(alive)[0]
        if len(live) == 0:
            return []
        sel = np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in live])
        owner = np.repeat(live, counts[live])  # virtual row -> sample row
        vrows = rows[owner]
        extra = [drafts[i][:j] for i in live.tolist() for j in range(int(counts[i]))]
        draft_ids = torch.tensor([t for i in live.tolist() for t in (*drafts[i], -1)], dtype=torch.long,
                                 device=runner.device)
        idx = inp.logits_indices[torch.as_tensor(sel, device=inp.logits_indices.device)]
        logits = runner.model.compute_logits(hidden[idx])  # afresh each try: a processor may write into them
        md = build_sampling_metadata(b, vrows, logits.shape[-1], runner.device, runner.logits_processors, grammar,
                                     extra_outputs=extra)
        q = None if md.all_greedy else draft_probs([b.states[rows[i]] for i in live.tolist()],
                                                   [drafts[i] for i in live.tolist()], draft_ids, logits.shape[-1])
        try:
            v = rejection_sample(runner.sampler, logits, md, draft_ids, q)
            break
        except RowFaults as f:
            for vr, msg in f.rows.items():
                i = int(owner[vr])
                if alive[i]:
                    alive[i] = False
                    st = b.states[rows[i]]
                    assert st is not None
                    out.failed[st.req_id] = msg
                    logger.warning("request %s failed: %s", st.req_id, msg)
    accepted_ids = v.accepted.to(torch.int64)
    runner.share_sampled(v.token_ids, accepted_ids)
    accepted = accepted_ids.cpu().numpy().astype(bool)
    tokens = v.token_ids.tolist()
    lp = v.logprobs
    lp_rows = list(zip(lp.token_ids.tolist(), lp.values.tolist(), lp.ranks.tolist())) if lp is not None else None
    result = []
    pos = 0
    for i in live.tolist():
        c = int(counts[i])
        # Accepted drafts: the leading run of accepted rows (the bonus row is never "accepted").
        num_acc = int(np.argmin(accepted[pos:pos + c]))
        result.append(VerifiedRow(int(rows[i]), tokens[pos:pos + num_acc + 1],
                                  lp_rows[pos:pos + num_acc + 1] if lp_rows is not None else None, c - 1))
        pos += c
    return result
