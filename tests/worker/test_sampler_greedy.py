"""The sampler's greedy-only path (every row greedy, nothing to apply, no logprobs): the argmax of the logits as
the model returned them, with the finite check on the chosen values alone; against torch's argmax over the
float32 logits and the full path's fault messages."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllite_core.model_ops import ModelOps
from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sample.sampler import RowFaults, Sampler


def _ops():
    yield ModelOps()
    try:
        from vllite_platform_cpu import kernels
        from vllite_platform_cpu.model_ops import CpuModelOps
    except ImportError:
        return
    if kernels.available():
        yield CpuModelOps(fused=True, packed_linear=True)


OPS = list(_ops())


def greedy_md(n: int, **kw) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.zeros(n), top_k=None, top_p=None, min_p=None, all_greedy=True,
                            all_random=False, generators={}, max_num_logprobs=None, **kw)


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_only_is_the_float32_argmax(ops, dtype):
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[3, [5, 40000]] = 30.0  # a tie: the first
    out = Sampler(ops=ops).forward(logits, greedy_md(64))
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.name)
def test_greedy_only_names_faulty_rows_as_the_full_path_does(ops):
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits[1, 7] = float("nan")
    logits[3, 999] = float("inf")
    logits[4] = float("-inf")
    with pytest.raises(RowFaults) as fast:
        Sampler(ops=ops).forward(logits, greedy_md(6))
    # The full path (a logprobs request takes it) on the same rows.
    with pytest.raises(RowFaults) as full:
        Sampler(ops=ops).forward(logits, dataclasses.replace(greedy_md(6), max_num_logprobs=0))
    assert fast.value.rows == full.value.rows
    assert sorted(fast.value.rows) == [1, 3, 4]
    assert "NaN" in fast.value.rows[1] and "+inf" in fast.value.rows[3] and "banned" in fast.value.rows[4]


# SamplingMetadata's fields that do not change a greedy row's logits; every other one must make it `constrained`.
_NOT_CONSTRAINTS = {"temperature", "top_k", "top_p", "min_p", "all_greedy", "all_random", "generators",
                    "max_num_logprobs", "grammar_rows", "batch_info"}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(SamplingMetadata)
                                  if f.name not in _NOT_CONSTRAINTS])
def test_every_constraint_field_leaves_the_greedy_only_path(name):
    """A field added to SamplingMetadata for a new constraint must be listed in ``constrained``, or greedy rows
    would skip it."""
    md = greedy_md(2)
    assert not md.constrained
    setattr(md, name, [object()] if name == "processors" else object())
    assert md.constrained


def test_a_constraint_is_applied_to_greedy_rows():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0]])
    bias = (torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([5.0, 5.0]))
    assert Sampler().forward(logits, greedy_md(2, bias=bias)).sampled_token_ids.tolist() == [0, 1]
