"""Graph capture (Platform.capture_graphs) gives the same logits as eager execution."""
from __future__ import annotations

import pytest
import torch

from vllite_core.config import VlliteConfig
from vllite_core.conformance.kit import StepDriver, build_engine_model, run_model, tolerance
from vllite_core.platforms.graphs import decode_inputs, pad_decode_inputs, pick_batch_size

SIZES = [1, 2, 4]


def _forward(model):
    def forward(input_ids, positions, kv_caches, metadata):
        return model(input_ids, positions, kv_caches, [metadata] * len(kv_caches))

    return forward


def test_graphs_match_eager(platform, backend, device, model_dtype):
    model = build_engine_model(backend, model_dtype, device, seed=3)
    drv = StepDriver(model, backend, device, model_dtype, seed=3)
    runners = platform.capture_graphs(
        _forward(model), SIZES,
        lambda bs: decode_inputs(bs, drv.max_blocks, drv.kv_caches, drv.block_size, device), VlliteConfig())
    if not runners:
        pytest.skip(f"platform {platform.name!r} captures no graphs (it runs eagerly)")
    assert set(runners) <= set(SIZES) and runners, f"captured {sorted(runners)} for {SIZES}"
    gen = torch.Generator().manual_seed(5)
    prompts = {"a": 7, "b": 20, "c": 33}
    for rid, n in prompts.items():
        drv.add(rid, torch.randint(0, 512, (n,), generator=gen).tolist())
        last = drv.step({rid: n})[-1]
        drv.append_greedy(rid, last)
    atol, rtol = tolerance(model_dtype)
    for step in range(3):
        rids = ["a", "b", "c"][: 3 - step % 2]  # 3 requests (padded to 4), then 2 (exact size)
        sched = {rid: 1 for rid in rids}
        bs = pick_batch_size(len(rids), list(runners))
        assert bs is not None
        inp = drv.inputs(sched)
        with torch.inference_mode():
            eager = model.compute_logits(run_model(model, inp)).float().cpu()
            padded = pad_decode_inputs(inp["input_ids"], inp["positions"], inp["metadata"], bs)
            backend.prepare(padded["metadata"])
            hidden = runners[bs](kv_caches=drv.kv_caches, **padded)
            graph = model.compute_logits(hidden[: len(rids)]).float().cpu()
        drv.advance(sched)
        torch.testing.assert_close(graph, eager, atol=atol, rtol=rtol, msg=lambda m: f"decode step {step}: {m}")
        assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
        for i, rid in enumerate(rids):
            drv.append_greedy(rid, eager[i])
