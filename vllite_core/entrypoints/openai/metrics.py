"""GET /metrics: Prometheus text, from the engine's snapshot and finished-request reports.

Per-request numbers (finish reasons, TTFT, inter-token gaps, time per output
token, end-to-end / queue / prefill / decode / inference time, token counts,
request parameters) are observed when a request ends; engine numbers
(running/waiting, KV usage, prefix-cache hits, preemptions, the engine loop's time
split, CPU seconds per thread role) are read at scrape time. Each server has its
own registry, so several can live in one process (tests).

Every metric vLLM also exports is published twice: under ``vllite:`` (label
``model_name``) and under vLLM's own name and labels (``vllm:``, labels
``model_name`` and ``engine``), so a dashboard made for vLLM reads vllite unchanged.
"""
from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllite_core.core.stats import SchedulerStats
from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.engine.request_stream import FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)
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


_ENGINE = "0"  # vLLM's engine label: the data-parallel rank of the engine core (one engine: "0")


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLM, model: str, api_tid: int | None) -> None:
        self.engine = engine
        self.model = model
        self.api_tid = api_tid
        self.api_cpu_base = 0.0  # what the API thread spent before serving (loading the model)

    def _both(self, family: type, name: str, doc: str, value: float, vllm: bool = True,
              field: str | None = None) -> Iterator[Metric]:
        """``vllite:NAME`` (all engines together) and, where vLLM has the metric, ``vllm:NAME`` with vLLM's
        labels: with data-parallel engine cores, one sample per engine (``field`` of its own numbers)."""
        m = family(f"vllite:{name}", doc, labels=["model_name"])
        m.add_metric([self.model], value)
        yield m
        if vllm:
            m = family(f"vllm:{name}", doc, labels=["model_name", "engine"])
            per_engine = self._per_engine()
            if field is not None and len(per_engine) > 1:
                for index, stats in enumerate(per_engine):
                    m.add_metric([self.model, str(index)], getattr(stats, field))
            else:
                m.add_metric([self.model, _ENGINE], value)
            yield m

    def _per_engine(self) -> list[SchedulerStats]:
        """Each engine core's latest numbers (one SchedulerStats record per data-parallel engine core)."""
        return self.engine.engine_stats()

    def _cache_info(self) -> GaugeMetricFamily:
        cfg = self.engine.engine.config.cache_config
        info = {"block_size": str(cfg.block_size), "cache_dtype": cfg.kv_cache_dtype,
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "num_gpu_blocks": str(self.engine.num_kv_blocks())}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the engine's cache config.",
                              labels=["engine", *info])
        g.add_metric([_ENGINE, *info.values()], 1.0)
        return g

    def _memory(self) -> Iterator[Metric]:
        """What the engine cores will hold (their start-up report, every core's together) and hold now."""
        import psutil

        mem = self.engine.core.info.memory
        n = len(self.engine.engine_stats())  # data-parallel engine cores, each a full copy
        g = GaugeMetricFamily("vllite:engine_memory_bytes", "Engine-core memory at start-up: weights, kv_cache (in "
                              "full), resident (RSS when ready), planned (resident + the KV cache not yet "
                              "committed: what the process will hold with its cache full).",
                              labels=["model_name", "part"])
        for part, v in (("weights", mem.weights_bytes), ("kv_cache", mem.kv_cache_bytes),
                        ("resident", mem.resident_bytes), ("planned", mem.planned_bytes)):
            g.add_metric([self.model, part], v * n)
        yield g
        rss = 0
        for core in self.engine.layout()["engine_cores"]:
            try:
                rss += psutil.Process(core["pid"]).memory_info().rss
            except psutil.Error:  # restarting
                pass
        yield from self._both(GaugeMetricFamily, "engine_resident_bytes", "Resident memory of the engine-core "
                              "process(es) now (this process for an in-process engine).", rss, vllm=False)

    def _spec_decoding(self, sd) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (vllite_core.spec_decode.metrics.SpecDecodingStats)."""
        c = CounterMetricFamily
        yield from self._both(c, "spec_decode_num_drafts", "Verification rounds (requests x steps with drafts).",
                              sd.num_drafts)
        yield from self._both(c, "spec_decode_num_draft_tokens", "Draft tokens verified.", sd.num_draft_tokens)
        yield from self._both(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", sd.num_accepted_tokens)
        for prefix, labels in (("vllite", [self.model]), ("vllm", [self.model, _ENGINE])):
            m = c(f"{prefix}:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                  labels=["model_name", *(["engine"] if prefix == "vllm" else []), "position"])
            for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
                m.add_metric([*labels, str(pos)], n)
            yield m

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        ls = self.engine.loop_stats
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield from self._both(g, "num_requests_running", "Requests in the running batch.", s.num_running,
                              field="num_running")
        yield from self._both(g, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting,
                              field="num_waiting")
        yield from self._both(g, "num_requests_in_flight", "Requests the API is streaming.",
                              self.engine.num_in_flight, vllm=False)
        yield from self._both(g, "kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).",
                              s.kv_cache_usage, field="kv_cache_usage")
        yield from self._both(g, "kv_cache_free_blocks", "KV blocks free (cached-but-free counts as free).",
                              s.num_free_blocks, vllm=False)
        yield from self._both(g, "kv_cache_total_blocks", "Usable KV blocks.", s.num_total_blocks, vllm=False)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield from self._both(g, "prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start.",
                              hit_rate, vllm=False)
        yield from self._both(c, "prefix_cache_queries", "Prefix-cache queries (tokens).", s.prefix_cache_queries,
                              field="prefix_cache_queries")
        yield from self._both(c, "prefix_cache_hits", "Prefix-cache hits (tokens).", s.prefix_cache_hits,
                              field="prefix_cache_hits")
        yield from self._both(c, "num_preemptions", "Preemptions (recompute) since start.", s.num_preemptions_total,
                              field="num_preemptions_total")
        yield from self._both(c, "engine_loop_steps", "Engine loop steps.", ls.steps, vllm=False)
        yield from self._both(c, "engine_core_restarts", "Engine-core processes started again after they died.",
                              self.engine.num_restarts, vllm=False)
        if s.spec_decoding is not None:
            yield from self._spec_decoding(s.spec_decoding)
        if s.mm_cache is not None:  # the encoder cache, counted in images (vLLM's multi-modal cache counters)
            yield from self._both(c, "mm_cache_queries", "Multi-modal (encoder) cache queries, in images.",
                                  s.mm_cache.queries)
            yield from self._both(c, "mm_cache_hits", "Multi-modal (encoder) cache hits, in images.",
                                  s.mm_cache.hits)
            yield from self._both(c, "mm_cache_evictions", "Encoder outputs evicted to make room.",
                                  s.mm_cache.evictions, vllm=False)
        if self.engine.engine.config.structured_outputs_config.jump_forward:
            yield from self._both(c, "jump_forward_tokens", "Structured output tokens appended without a sampling "
                                  "step (the grammar allowed exactly one).", s.num_jump_forward_tokens, vllm=False)
        yield from self._both(g, "grammar_cache_bytes", "Bytes of compiled structured-output grammars cached "
                              "(bounded by grammar_cache_bytes).", s.grammar_cache_bytes, vllm=False)
        yield from self._both(c, "grammar_cache_evictions", "Compiled grammars evicted to stay within the bound.",
                              s.grammar_cache_evictions, vllm=False)
        yield self._cache_info()
        yield from self._memory()
        loop = CounterMetricFamily("vllite:engine_loop_seconds", "Engine loop wall time by phase "
                                   "(step: LLMEngine.step; other: inbox and hand-off; idle: asleep; "
                                   "trim: giving freed heap back to the OS).", labels=["model_name", "phase"])
        for phase, v in (("step", ls.step_s), ("other", ls.other_s), ("idle", ls.idle_s), ("trim", ls.trim_s)):
            loop.add_metric([self.model, phase], v)
        yield loop
        cpu = CounterMetricFamily("vllite:thread_cpu_seconds", "CPU seconds by thread role (api: since serving began).",
                                  labels=["model_name", "role"])
        for role, v in _thread_cpu(ls.thread_id, self.api_tid).items():
            cpu.add_metric([self.model, role], v - self.api_cpu_base if role == "api" else v)
        yield cpu


class _Twin:
    """One request metric under both prefixes (see the module docstring); ``vllm_name`` where vLLM
    spells it differently, None where vLLM has no such metric."""

    def __init__(self, kind: type, name: str, doc: str, registry: CollectorRegistry, model: str,
                 vllm_name: str | None = "", extra: tuple[str, ...] = (), **kw) -> None:
        self.kind, self.model = kind, model
        self.own = kind(f"vllite:{name}", doc, ["model_name", *extra], registry=registry, **kw)
        vllm_name = name if vllm_name == "" else vllm_name
        self.vllm = (kind(f"vllm:{vllm_name}", doc, ["model_name", "engine", *extra], registry=registry, **kw)
                     if vllm_name else None)
        if not extra:  # present (at 0) from the start
            list(self.children())

    def children(self, *extra: str, engine: str = _ENGINE):
        yield self.own.labels(self.model, *extra)
        if self.vllm is not None:
            yield self.vllm.labels(self.model, engine, *extra)

    def add(self, value: float, *extra: str, engine: str = _ENGINE) -> None:
        for m in self.children(*extra, engine=engine):
            if self.kind is Counter:
                m.inc(value)
            else:
                m.observe(value)


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry(auto_describe=False)

        def counter(name: str, doc: str, **kw) -> _Twin:
            return _Twin(Counter, name, doc, r, model, **kw)

        def hist(name: str, doc: str, buckets: tuple = _LATENCY_BUCKETS, **kw) -> _Twin:
            return _Twin(Histogram, name, doc, r, model, buckets=buckets, **kw)

        self.success = counter("request_success", "Finished requests (per completion) by finish reason.",
                               extra=("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token, as the API saw it.")
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first.",
                         buckets=_TPOT_BUCKETS, vllm_name="request_time_per_output_token_seconds")
        self.itl = hist("inter_token_latency_seconds", "Time between two steps that brought a request tokens.",
                        buckets=_TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to finish.")
        self.inference = hist("request_inference_time_seconds", "First scheduled to finish.")
        self.req_prompt = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.req_gen = hist("request_generation_tokens", "Generated tokens per request (all completions).",
                            _TOKEN_BUCKETS)
        self.req_max_gen = hist("request_max_num_generation_tokens", "Tokens of a request's longest completion.",
                                _TOKEN_BUCKETS)
        self.param_n = hist("request_params_n", "The n request parameter.", _N_BUCKETS)
        self.param_max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.",
                                     _TOKEN_BUCKETS)
        for reason in ("stop", "length", "abort"):  # present (at 0) from the start
            list(self.success.children(reason))
        self._collector = _EngineCollector(engine, model, threading.get_native_id())
        r.register(self._collector)
        engine.observers.append(self.observe)

    def set_api_thread(self, native_id: int) -> None:
        """The thread the asyncio loop runs on (the app's start-up tells)."""
        self._collector.api_tid = native_id
        self._collector.api_cpu_base = _one_thread_cpu(native_id)

    def observe(self, rec: FinishedRequest) -> None:
        e = str(rec.engine_index)  # vLLM's engine label: the data-parallel engine core that served it
        for reason in rec.finish_reasons:
            self.success.add(1, reason, engine=e)
        self.prompt_tokens.add(rec.num_prompt_tokens, engine=e)
        self.generation_tokens.add(rec.num_generation_tokens, engine=e)
        self.req_prompt.add(rec.num_prompt_tokens, engine=e)
        self.req_gen.add(rec.num_generation_tokens, engine=e)
        self.req_max_gen.add(rec.max_generation_tokens, engine=e)
        self.param_n.add(rec.n, engine=e)
        if rec.max_tokens is not None:
            self.param_max_tokens.add(rec.max_tokens, engine=e)
        self.e2e.add(rec.e2e_s, engine=e)
        for hist, value in ((self.ttft, rec.ttft_s), (self.tpot, rec.tpot_s), (self.queue, rec.queue_s),
                            (self.prefill, rec.prefill_s), (self.decode, rec.decode_s),
                            (self.inference, rec.inference_s)):
            if value is not None:
                hist.add(value, engine=e)
        for gap in rec.inter_token_s:
            self.itl.add(gap, engine=e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
