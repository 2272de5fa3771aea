"""Non-causal spans (Gemma 3's image tokens): ``token_spans`` finds each request's runs of the span token in a
step, and the backend's default ``forward_spans`` over a paged cache equals a dense softmax written out by
hand with HF's mask rule (a key j is seen by a span row at position p when j is before the span's end and,
with a window W, j > p - W), for a span whose first tokens came from the prefix cache and with GQA."""
from __future__ import annotations

import pytest
import torch

from vllite_core.attention.backend import AttentionMetadata
from vllite_core.attention.reference import ReferenceAttention
from vllite_core.attention.spans import token_spans

IMG = 9

def test_token_spans_per_request_runs():
    # request 0: 6 query rows at context 10..15, image run at rows 2-4; request 1: 4 rows at context 0..3, a run
    # at its first row (a span resumed after a prefix hit) and none after.
    ids = [1, 2, IMG, IMG, IMG, 3] + [IMG, IMG, 4, 5]
    spans = token_spans(ids, IMG, [0, 6, 10], [16, 4])
    assert [(s.req, s.rows, s.first_pos, s.end) for s in spans.spans] == [(0, (2, 5), 12, 15), (1, (6, 8), 0, 2)]
    assert spans.rows.tolist() == [2, 3, 4, 6, 7]
    assert token_spans([1, 2, 3], IMG, [0, 3], [3]) is None

@pytest.mark.parametrize("window", [None, 5])
def test_forward_spans_matches_a_dense_reference(window):
    torch.manual_seed(0)
    h, hkv, d, bs, ctx = 4, 2, 8, 4, 14
    k_all, v_all = torch.randn(ctx, hkv, d), torch.randn(ctx, hkv, d)
    blocks = [3, 0, 5, 1]  # the request's blocks, out of order in a 6-block cache
    cache = torch.zeros(2, 6, bs, hkv, d)
    for pos in range(ctx):
        cache[0, blocks[pos // bs], pos % bs], cache[1, blocks[pos // bs], pos % bs] = k_all[pos], v_all[pos]
    # The step: context positions 8..13 (6 rows); the image spans positions 6..11, its first two tokens cached.
    ids = [IMG] * 4 + [1, 2]
    q = torch.randn(6, h, d)
    md = AttentionMetadata(num_actual_tokens=6, query_start_loc=torch.tensor([0, 6]), seq_lens=torch.tensor([ctx]),
                           block_table=torch.tensor([blocks]), slot_mapping=torch.zeros(6, dtype=torch.long),
                           max_query_len=6, max_seq_len=ctx, block_size=bs, query_start_loc_cpu=[0, 6],
                           seq_lens_cpu=[ctx])
    md.noncausal_spans = token_spans(ids, IMG, [0, 6], [ctx])
    out = ReferenceAttention().forward_spans(q, cache, md, 0.3, window)
    assert out.shape == (4, h, d)
    for r in range(4):
        p = 8 + r
        seen = [j for j in range(12) if window is None or j > p - window]
        for head in range(h):
            kv = head // (h // hkv)
            scores = torch.stack([q[r, head] @ k_all[j, kv] * 0.3 for j in seen])
            want = torch.softmax(scores, 0) @ v_all[seen, kv]
            assert torch.allclose(out[r, head], want, atol=1e-5), (r, head)
