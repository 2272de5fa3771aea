"""GET /metrics: Prometheus text, from the engine's snapshot and finished-request reports.

Per-request numbers (finish reasons, TTFT, time per output token, end-to-end
latency, queue time, token counts) are observed when a request ends; engine
numbers (running/waiting, KV usage, prefix-cache hits, preemptions, the engine
loop's time split, CPU seconds per thread role) are read at scrape time. Each
server has its own registry, so several can live in one process (tests).
"""
from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllite_core.engine.async_llm import AsyncLLM, FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _thread_cpu(engine_tid: int | None, api_tid: int | None) -> dict[str, float]:
    """CPU seconds by role: the engine loop thread, the API (asyncio) thread, and the rest
    (torch's compute threads, the tokenizer's, ...)."""
    import psutil

    out = {"engine_loop": 0.0, "api": 0.0, "other": 0.0}
    for t in psutil.Process().threads():
        role = "engine_loop" if t.id == engine_tid else "api" if t.id == api_tid else "other"
        out[role] += t.user_time + t.system_time
    return out


def _one_thread_cpu(tid: int) -> float:
    import psutil

    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == tid)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLM, model: str, api_tid: int | None) -> None:
        self.engine = engine
        self.model = model
        self.api_tid = api_tid
        self.api_cpu_base = 0.0  # what the API thread spent before serving (loading the model)

    def _g(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model], value)
        return g

    def _c(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model], value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        ls = self.engine.loop_stats
        yield self._g("vllite:num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._g("vllite:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._g("vllite:num_requests_in_flight", "Requests the API is streaming.", self.engine.num_in_flight)
        yield self._g("vllite:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).", s.kv_cache_usage)
        yield self._g("vllite:kv_cache_free_blocks", "KV blocks free (cached-but-free counts as free).",
                      s.num_free_blocks)
        yield self._g("vllite:kv_cache_total_blocks", "Usable KV blocks.", s.num_total_blocks)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield self._g("vllite:prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start.", hit_rate)
        yield self._c("vllite:prefix_cache_queries", "Prefix-cache queries (tokens).", s.prefix_cache_queries)
        yield self._c("vllite:prefix_cache_hits", "Prefix-cache hits (tokens).", s.prefix_cache_hits)
        yield self._c("vllite:num_preemptions", "Preemptions (recompute) since start.", s.num_preemptions_total)
        yield self._c("vllite:engine_loop_steps", "Engine loop steps.", ls.steps)
        loop = CounterMetricFamily("vllite:engine_loop_seconds", "Engine loop wall time by phase "
                                   "(step: LLMEngine.step; other: inbox and hand-off; idle: asleep).",
                                   labels=["model_name", "phase"])
        for phase, v in (("step", ls.step_s), ("other", ls.other_s), ("idle", ls.idle_s)):
            loop.add_metric([self.model, phase], v)
        yield loop
        cpu = CounterMetricFamily("vllite:thread_cpu_seconds", "CPU seconds by thread role (api: since serving began).",
                                  labels=["model_name", "role"])
        for role, v in _thread_cpu(ls.thread_id, self.api_tid).items():
            cpu.add_metric([self.model, role], v - self.api_cpu_base if role == "api" else v)
        yield cpu


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        self.success = Counter("vllite:request_success", "Finished requests (per completion) by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllite:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllite:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r)
        self.ttft = Histogram("vllite:time_to_first_token_seconds", "Arrival to first token, as the API saw it.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllite:time_per_output_token_seconds", "Mean time per output token after the first.",
                              labels, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllite:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllite:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort"):  # present (at 0) from the start
            self.success.labels(model, reason)
        self._collector = _EngineCollector(engine, model, threading.get_native_id())
        r.register(self._collector)
        engine.observers.append(self.observe)

    def set_api_thread(self, native_id: int) -> None:
        """The thread the asyncio loop runs on (the app's start-up tells)."""
        self._collector.api_tid = native_id
        self._collector.api_cpu_base = _one_thread_cpu(native_id)

    def observe(self, rec: FinishedRequest) -> None:
        m = self.model
        for reason in rec.finish_reasons:
            self.success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(rec.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(rec.num_generation_tokens)
        self.e2e.labels(m).observe(rec.e2e_s)
        if rec.ttft_s is not None:
            self.ttft.labels(m).observe(rec.ttft_s)
        if rec.tpot_s is not None:
            self.tpot.labels(m).observe(rec.tpot_s)
        if rec.queue_s is not None:
            self.queue.labels(m).observe(rec.queue_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
