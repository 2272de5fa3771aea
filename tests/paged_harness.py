"""Drive an engine model step by step over a paged KV cache, without the engine.

Used by the model tests: requests get random, non-contiguous blocks; each step
schedules some tokens per request (whole prompt, prompt chunks, decode tokens,
several requests mixed) and records the logits of every computed position so
they can be compared with Hugging Face's full-sequence logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from vllite_core.attention.reference import build_metadata


@dataclass
class _Req:
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one [V] row per computed position


class PagedHarness:
    def __init__(self, model, backend, num_blocks: int = 96, block_size: int = 4, seed: int = 0,
                 cache_dtype: torch.dtype | None = None) -> None:
        self.model, self.backend, self.block_size = model, backend, block_size
        shape = backend.get_kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_size)
        dtype = cache_dtype or model.dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        self.free = list(range(1, num_blocks))  # block 0 stays unused, like a null block
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}

    def add(self, rid: str, prompt: list[int]) -> None:
        self.reqs[rid] = _Req(list(prompt))

    @torch.inference_mode()
    def step(self, schedule: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run ``{request: num_new_tokens}``; returns each request's logits for its new tokens."""
        ids, pos, q_lens, s_lens, tables = [], [], [], [], []
        for rid, n in schedule.items():
            r = self.reqs[rid]
            end = r.computed + n
            assert end <= len(r.tokens), f"{rid}: scheduled past its known tokens"
            while len(r.blocks) * self.block_size < end:
                r.blocks.append(self.free.pop())
            ids += r.tokens[r.computed:end]
            pos += list(range(r.computed, end))
            q_lens.append(n)
            s_lens.append(end)
            tables.append(r.blocks)
        md = build_metadata(q_lens, s_lens, tables, self.block_size)
        self.backend.prepare(md)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, [md] * len(self.kv_caches))
        logits = self.model.compute_logits(hidden)
        out, row = {}, 0
        for rid, n in schedule.items():
            r = self.reqs[rid]
            out[rid] = logits[row:row + n]
            r.logits.extend(out[rid])
            r.computed += n
            row += n
        return out

    def decode(self, rids: list[str], extra: dict[str, int] | None = None) -> None:
        """One step: every request in ``rids`` appends its greedy token and computes it (plus ``extra``)."""
        for rid in rids:
            r = self.reqs[rid]
            r.tokens.append(int(r.logits[-1].argmax()))
        self.step({**{rid: 1 for rid in rids}, **(extra or {})})

    def logits(self, rid: str) -> torch.Tensor:
        return torch.stack(self.reqs[rid].logits)

    def tokens(self, rid: str) -> list[int]:
        return self.reqs[rid].tokens


def run_standard_schedule(harness: PagedHarness, prompts: dict[str, list[int]], decode_steps: int = 4) -> None:
    """Cover the cases the engine produces: a whole prompt in one step, a prompt in two chunks, a later
    request prefilling while others decode (mixed batch), then batched decodes.

    ``prompts`` needs keys "a", "b" and "c".
    """
    for rid, p in prompts.items():
        harness.add(rid, p)
    a, b, c = prompts["a"], prompts["b"], prompts["c"]
    harness.step({"a": len(a)})  # one full prefill
    half = len(b) // 2
    harness.step({"b": half})  # first chunk of b ...
    harness.decode(["a"], extra={"b": len(b) - half})  # ... second chunk, mixed with a decode
    harness.decode(["a", "b"], extra={"c": len(c)})  # c prefills while a and b decode
    for _ in range(decode_steps):
        harness.decode(["a", "b", "c"])


def assert_matches_hf(harness: PagedHarness, hf_model, atol: float, rtol: float = 1e-4) -> None:
    """Every computed position's logits close to HF's; greedy tokens identical."""
    for rid in harness.reqs:
        tokens = harness.tokens(rid)
        ours = harness.logits(rid)
        with torch.inference_mode():
            ref = hf_model(input_ids=torch.tensor([tokens[: ours.shape[0]]])).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol, msg=lambda m: f"request {rid}: {m}")
        assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist(), f"request {rid}: greedy tokens differ"
