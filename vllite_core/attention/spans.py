"""Non-causal spans in a step: runs of query rows that also see the keys after them up to their span's end
(Gemma 3's image tokens attend to every token of their own image).

The backend's causal ``forward`` runs first (it writes the step's K/V into the cache); the rows of each span are
then recomputed over their request's context up to the span's end (``AttentionBackend.forward_spans``). The
scheduler never cuts a span (``HasBidirectionalMMItems``), so a span's last key is always in this step; its
first tokens may come from the prefix cache, whose K/V were computed with the whole span.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    req: int  # the request's index in the step (its block table row)
    rows: tuple[int, int]  # flat query rows [lo, hi) of this step
    first_pos: int  # the context position of row ``lo``
    end: int  # the span's end in the context: every row sees keys [.., end)


@dataclass(frozen=True)
class NonCausalSpans:
    spans: tuple[Span, ...]
    rows: torch.Tensor  # int64, every span's rows in order (where the outputs go)


def token_spans(token_ids: list[int], span_token: int, query_start_loc: list[int], seq_lens: list[int]
                ) -> NonCausalSpans | None:
    """Each run of ``span_token`` among a request's query rows is a span ending at its run's last token
    (``token_ids`` is the step's flat ids); None when the step has none."""
    spans: list[Span] = []
    for i, seq_len in enumerate(seq_lens):
        q0, q1 = query_start_loc[i], query_start_loc[i + 1]
        first = seq_len - (q1 - q0)  # context position of row q0
        r = q0
        while r < q1:
            if token_ids[r] != span_token:
                r += 1
                continue
            lo = r
            while r < q1 and token_ids[r] == span_token:
                r += 1
            spans.append(Span(i, (lo, r), first + lo - q0, first + r - q0))
    if not spans:
        return None
    rows = torch.cat([torch.arange(*s.rows) for s in spans])
    return NonCausalSpans(tuple(spans), rows)


def span_mask(span: Span, key_start: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[rows, keys] True where a span row at position p may see key j in [key_start, span.end): every key
    before the span's end, within the window (j > p - window) when there is one."""
    n = span.rows[1] - span.rows[0]
    pos = torch.arange(span.first_pos, span.first_pos + n, device=device)[:, None]
    keys = torch.arange(key_start, span.end, device=device)[None, :]
    if sliding_window is None:
        return torch.ones(n, span.end - key_start, dtype=torch.bool, device=device)
    return keys > pos - sliding_window
