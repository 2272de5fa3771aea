"""Deployment options against one real `vllite serve` on 127.0.0.1 (a tiny random Llama with the SmolLM2
vocabulary): HTTPS with a self-signed certificate made here by the ``openssl`` CLI (the real ``openai``
client verifies it), ``--root-path``, ``--enable-log-requests`` (vLLM's log line), SageMaker's ``/ping``
and ``/invocations``, ``/load`` (``--enable-server-load-tracking``) and ``--otlp-traces-endpoint``: spans
with vLLM's attribute names, decoded from OTLP/HTTP protobuf by a receiver started here. References:
the same request through the plain routes, the response's own usage and id, the caller's trace context."""
from __future__ import annotations

import gzip
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-deploy"
ROOT = "/api"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf ExportTraceServiceRequest."""
    spans: list = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                type(self).spans.extend(ss.spans)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver():
    pytest.importorskip("opentelemetry.sdk.trace")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1/traces"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return str(key), str(crt)


@pytest.fixture(scope="module")
def tls(cert):
    return ssl.create_default_context(cafile=cert[1])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    path = tmp_path_factory.mktemp("tiny-deploy")
    tok = load_tokenizer(resolve_model_source(None))
    save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]), tokenizer=tok)
    return str(path)


@pytest.fixture(scope="module")
def launched(model_path, cert, tls, receiver):
    srv = ServerProcess(["--model", model_path, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks",
                         "64", "--num-threads", "1", "--served-model-name", MODEL, "--ssl-keyfile", cert[0],
                         "--ssl-certfile", cert[1], "--root-path", ROOT, "--enable-log-requests",
                         "--otlp-traces-endpoint", receiver, "--enable-server-load-tracking"],
                        env={"VLLITE_LOG_LEVEL": "INFO", "OTEL_BSP_SCHEDULE_DELAY": "100"}, verify=tls)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(launched):
    return launched.url


@pytest.fixture(scope="module")
def http(server, tls):
    with httpx.Client(base_url=server, verify=tls, timeout=120) as c:
        yield c


def _greedy(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0}


def test_https_and_root_path_with_the_openai_client(launched, server, http, tls):
    assert launched.scheme == "https" and f"https://127.0.0.1:{launched.port}{ROOT}/v1" in launched.output
    client = openai.OpenAI(base_url=f"{server}{ROOT}/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(verify=tls, timeout=120))
    got = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0.0)
    # the same request without the prefix (a proxy that strips it) is the same route
    plain = http.post("/v1/completions", json=_greedy("The capital of France is")).json()
    assert got.choices[0].text == plain["choices"][0]["text"] and got.usage.completion_tokens == 6
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http.get(f"{ROOT}/openapi.json").json()["servers"] == [{"url": ROOT}]
    with pytest.raises(httpx.HTTPError):  # TLS only: plain HTTP on the port gets no answer
        httpx.get(f"http://127.0.0.1:{launched.port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError):  # and the certificate is checked: an untrusting client refuses it
        httpx.get(server + "/health", timeout=10)


def test_enable_log_requests_names_request_id_and_params(launched, http):
    r = http.post("/v1/completions", json={**_greedy("Logged prompt"), "max_tokens": 3, "seed": 1234})
    rid = r.json()["id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(rid in line for line in launched.lines):
        time.sleep(0.1)
    line = next(line for line in launched.lines if f"Received request {rid}:" in line)
    assert "params: SamplingParams(" in line and "max_tokens=3" in line and "seed=1234" in line
    assert line.rstrip().endswith("lora_request: None.")


def test_ping_and_invocations_route_by_body_shape(http):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    completion = _greedy("Water boils at")
    via = http.post("/invocations", json=completion).json()
    direct = http.post("/v1/completions", json=completion).json()
    assert via["object"] == "text_completion" and via["choices"][0]["text"] == direct["choices"][0]["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0.0}
    via = http.post("/invocations", json=chat).json()
    direct = http.post("/v1/chat/completions", json=chat).json()
    assert via["object"] == "chat.completion"
    assert via["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    bad = http.post("/invocations", json={"nonsense": 1})
    assert bad.status_code == 400 and "ChatCompletionRequest" in bad.json()["error"]["message"]
    assert http.post("/invocations", content=b"{not json", headers={"Content-Type": "application/json"}
                     ).json()["error"]["code"] == "invalid_json"


def test_load_counts_requests_in_flight(launched, http, tls):
    assert http.get("/load").json() == {"server_load": 0}
    body = json.dumps(_greedy("in flight")).encode()
    raw = socket.create_connection(("127.0.0.1", launched.port))
    conn = tls.wrap_socket(raw, server_hostname="127.0.0.1")
    try:  # a request whose body is still arriving is in flight
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        deadline = time.monotonic() + 30
        while http.get("/load").json()["server_load"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/load").json() == {"server_load": 1}
        conn.sendall(body[5:])
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        conn.close()
    deadline = time.monotonic() + 30
    while http.get("/load").json()["server_load"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/load").json() == {"server_load": 0}


def test_otlp_spans_carry_vllm_attributes_and_the_callers_trace(http):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    body = {**_greedy("Traced prompt"), "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7}
    r = http.post("/v1/completions", json=body, headers=headers).json()
    deadline = time.monotonic() + 60
    span = None
    while span is None and time.monotonic() < deadline:
        span = next((s for s in _Receiver.spans
                     if any(a.key == "gen_ai.request.id" and a.value.string_value == r["id"] for a in s.attributes)),
                    None)
        time.sleep(0.1)
    assert span is not None, "no span for the request reached the receiver"
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    assert span.name == "llm_request" and span.kind == Span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}
    assert attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.usage.prompt_tokens"] == r["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == r["usage"]["completion_tokens"] == 5
    assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    e2e, ttft = attrs["gen_ai.latency.e2e"], attrs["gen_ai.latency.time_to_first_token"]
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= ttft <= e2e
    assert {"gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode",
            "gen_ai.latency.time_in_model_inference"} <= attrs.keys()
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, rel=1e-3, abs=1e6)
    # a request without trace context gets a span of its own trace
    plain = http.post("/v1/completions", json=_greedy("Untraced")).json()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            any(a.key == "gen_ai.request.id" and a.value.string_value == plain["id"] for a in s.attributes)
            for s in _Receiver.spans):
        time.sleep(0.1)
    own = next(s for s in _Receiver.spans
               if any(a.key == "gen_ai.request.id" and a.value.string_value == plain["id"] for a in s.attributes))
    assert own.trace_id.hex() != TRACE_ID and not own.parent_span_id


def _refused(*args: str) -> str:
    """The start-up check of the deployment options (run before the socket is bound or the model loads)."""
    from vllite_core.entrypoints.cli import build_parser
    from vllite_core.entrypoints.cli_serve import _deployment_options

    with pytest.raises(SystemExit) as e:
        _deployment_options(build_parser().parse_args(["serve", *args]))
    return str(e.value)


def test_bad_deployment_options_fail_before_loading_the_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllite_core.entrypoints.cli", "serve", "--port", "0",
                           "--ssl-certfile", "x.pem"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "engine ready" not in proc.stderr
    assert "--ssl-keyfile and --ssl-certfile together" in proc.stderr
    assert "no such file" in _refused("--ssl-keyfile", str(tmp_path / "k"), "--ssl-certfile", str(tmp_path / "c"))
    assert "--root-path" in _refused("--root-path", "api/")
    assert "OTLP/HTTP receiver's URL" in _refused("--otlp-traces-endpoint", "localhost:4317")


def test_tracing_without_the_sdk_is_refused_clearly(monkeypatch):
    from vllite_core.entrypoints.openai.tracing import TracingUnavailableError, check_available

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if opentelemetry-sdk were missing
    with pytest.raises(TracingUnavailableError, match="pip install opentelemetry-sdk"):
        check_available("http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(TracingUnavailableError, match="http/protobuf only"):
        check_available("http://127.0.0.1:4318/v1/traces")
