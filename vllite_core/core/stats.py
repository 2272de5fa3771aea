"""SchedulerStats: the engine core's numbers as ONE record, from the scheduler to ``/metrics`` and
``LLMEngine.get_stats()``.

The scheduler fills it (requests, KV blocks, prefix cache, preemptions, drafts, jump-forward, encoder
cache); the core adds where its step time went and its compiled-grammar cache. The same record
crosses the process boundary as is (a msgspec Struct, encoded as an array: it rides in every step's
message), AsyncLLM keeps the latest one for readers on other threads, and ``combine`` sums the
records of data-parallel engine cores.
"""
from __future__ import annotations

import msgspec

from vllite_core.multimodal.encoder_cache import EncoderCacheStats
from vllite_core.spec_decode.metrics import SpecDecodingStats


class StepTimes(msgspec.Struct, array_like=True):
    """Where the core's step time went since start; the model's share (``execute``) should dominate."""

    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    steps: int = 0  # steps that ran the model
    tokens: int = 0  # tokens scheduled in them

    def copy(self) -> "StepTimes":
        return StepTimes(self.schedule, self.execute, self.update, self.steps, self.tokens)

    def as_dict(self) -> dict[str, float]:
        total = self.schedule + self.execute + self.update
        return {"steps": self.steps, "tokens": self.tokens, "schedule_s": self.schedule, "execute_s": self.execute,
                "update_s": self.update, "overhead_fraction": (self.schedule + self.update) / total if total else 0.0}


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks held by requests
    num_free_blocks: int = 0  # cached-but-free blocks count as free
    num_total_blocks: int = 0  # usable blocks (the pool less its null block)
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0
    num_jump_forward_tokens: int = 0  # structured output tokens appended without sampling (jump-forward)
    grammar_cache_bytes: int = 0  # compiled grammars held (the core's StructuredOutputManager.cache_bytes)
    grammar_cache_evictions: int = 0  # compiled grammars dropped to stay within grammar_cache_bytes
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding off
    mm_cache: EncoderCacheStats | None = None  # None: not a multimodal model
    step_times: StepTimes = msgspec.field(default_factory=StepTimes)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def combine(records: list[SchedulerStats]) -> SchedulerStats:
    """The records of several engine cores as one: counts summed, KV usage weighted by each one's blocks."""
    if len(records) == 1:
        return records[0]
    total = sum(s.num_total_blocks for s in records)
    used = sum(s.kv_cache_usage * s.num_total_blocks for s in records)
    spec = [s.spec_decoding for s in records if s.spec_decoding is not None]
    mm = [s.mm_cache for s in records if s.mm_cache is not None]
    return SchedulerStats(
        num_running=sum(s.num_running for s in records), num_waiting=sum(s.num_waiting for s in records),
        kv_cache_usage=used / total if total else 0.0, num_free_blocks=sum(s.num_free_blocks for s in records),
        num_total_blocks=total, num_preemptions_total=sum(s.num_preemptions_total for s in records),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in records),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in records),
        num_jump_forward_tokens=sum(s.num_jump_forward_tokens for s in records),
        grammar_cache_bytes=sum(s.grammar_cache_bytes for s in records),
        grammar_cache_evictions=sum(s.grammar_cache_evictions for s in records),
        spec_decoding=_sum_spec(spec) if spec else None,
        mm_cache=EncoderCacheStats(sum(m.queries for m in mm), sum(m.hits for m in mm),
                                   sum(m.evictions for m in mm)) if mm else None,
        step_times=StepTimes(sum(s.step_times.schedule for s in records), sum(s.step_times.execute for s in records),
                             sum(s.step_times.update for s in records), sum(s.step_times.steps for s in records),
                             sum(s.step_times.tokens for s in records)))


def _sum_spec(rows: list[SpecDecodingStats]) -> SpecDecodingStats:
    k = rows[0].num_spec_tokens
    return SpecDecodingStats(k, sum(r.num_drafts for r in rows), sum(r.num_draft_tokens for r in rows),
                             sum(r.num_accepted_tokens for r in rows),
                             [sum(r.num_accepted_tokens_per_pos[i] for r in rows) for i in range(k)])
