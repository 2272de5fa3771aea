"""--otlp-traces-endpoint: one OpenTelemetry span per finished engine request, exported over OTLP
(http/protobuf) in batches, with vLLM's span name (``llm_request``, kind SERVER) and attribute names
(``gen_ai.request.*``, ``gen_ai.usage.*``, ``gen_ai.latency.*``, ``gen_ai.response.model``). A request
that carries W3C trace context (``traceparent`` / ``tracestate`` headers) gets its span as a child of
the caller's. The OpenTelemetry SDK is needed only when the option is given (``check_available``)."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllite_core.engine.request_stream import FinishedRequest
from vllite_core.pooling.params import PoolingParams
from vllite_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SPAN_NAME = "llm_request"
TRACER_NAME = "vllite.llm_engine"


class SpanAttributes:
    """vLLM's span attribute names (the OpenTelemetry GenAI conventions plus vLLM's own latencies)."""
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


class TracingUnavailableError(RuntimeError):
    pass


def check_available(endpoint: str) -> None:
    """Refuse --otlp-traces-endpoint at start-up, naming what is missing, when it cannot work."""
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    if protocol != "http/protobuf":
        raise TracingUnavailableError(f"{PROTOCOL_ENV}={protocol!r}: vllite exports traces over http/protobuf only "
                                      "(unset it, and give the receiver's URL, e.g. http://HOST:4318/v1/traces)")
    if not endpoint.startswith(("http://", "https://")):
        raise TracingUnavailableError(f"--otlp-traces-endpoint {endpoint!r}: give the OTLP/HTTP receiver's URL, "
                                      "e.g. http://HOST:4318/v1/traces")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise TracingUnavailableError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter ({e}); install them with "
            "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http (pins in requirements.txt)") from None


@dataclass
class _Pending:
    params: SamplingParams | PoolingParams
    model: str
    trace_headers: dict[str, str]


class RequestTracer:
    """Remembers each added request's params and trace context (``track``); emits its span when the
    engine reports it finished (``observe``, an AsyncLLM observer)."""

    def __init__(self, endpoint: str) -> None:
        check_available(endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider: TracerProvider = TracerProvider(resource=Resource.create({"service.name": "vllite"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def track(self, request_id: str, params: SamplingParams | PoolingParams, model: str,
              headers: Mapping[str, str]) -> None:
        context = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        with self._lock:
            self._pending[request_id] = _Pending(params, model, context)

    def observe(self, rec: FinishedRequest) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        with self._lock:
            pending = self._pending.pop(rec.request_id, None)
        if pending is None:  # not added through the server (or not traced)
            return
        end_ns = time.time_ns()
        context = TraceContextTextMapPropagator().extract(pending.trace_headers)
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=SpanKind.SERVER,
                                      start_time=end_ns - int(rec.e2e_s * 1e9))
        span.set_attributes(_attributes(rec, pending))
        span.end(end_time=end_ns)

    def close(self) -> None:
        self.provider.shutdown()  # exports what is still batched


def _attributes(rec: FinishedRequest, pending: _Pending) -> dict[str, str | int | float]:
    a = SpanAttributes
    out: dict[str, str | int | float] = {
        a.GEN_AI_REQUEST_ID: rec.request_id, a.GEN_AI_RESPONSE_MODEL: pending.model,
        a.GEN_AI_REQUEST_N: rec.n, a.GEN_AI_USAGE_NUM_SEQUENCES: rec.n,
        a.GEN_AI_USAGE_PROMPT_TOKENS: rec.num_prompt_tokens,
        a.GEN_AI_USAGE_COMPLETION_TOKENS: rec.num_generation_tokens,
        a.GEN_AI_LATENCY_E2E: rec.e2e_s}
    params = pending.params
    if isinstance(params, SamplingParams):
        out[a.GEN_AI_REQUEST_TEMPERATURE] = params.temperature
        out[a.GEN_AI_REQUEST_TOP_P] = params.top_p
        if rec.max_tokens is not None:
            out[a.GEN_AI_REQUEST_MAX_TOKENS] = rec.max_tokens
    for name, value in ((a.GEN_AI_LATENCY_TIME_IN_QUEUE, rec.queue_s),
                        (a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, rec.ttft_s),
                        (a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, rec.prefill_s),
                        (a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, rec.decode_s),
                        (a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, rec.inference_s)):
        if value is not None:
            out[name] = value
    return out
