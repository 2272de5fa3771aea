"""Structured output and tool calling through the real `openai` client against `vllite serve`
(a subprocess on 127.0.0.1, the real SmolLM2): outputs checked with `jsonschema`, tool calls parsed
by the client's own types; the bad-input table answered with 400s naming the field while the
server keeps serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENGINE = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "128", "--num-threads", "2",
          "--structured-outputs-backend", "auto", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
          "--jump-forward"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Give a person as JSON."}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(ENGINE)
    yield srv.wait_ready()
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=180)
    yield c
    c.close()


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_response_format_json_object_and_completions_fields(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object with one key, answer."}],
        max_tokens=100, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=0.7, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert c.choices[0].text in ("red", "green", "blue")
    c = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", c.choices[0].text)


def test_tool_choice_required(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
              temperature=0, parallel_tool_calls=False)  # at most one call: the small model repeats calls
    calls = _calls_streamed_and_not(client, kw)
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    for name, args in calls:
        schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(args, schema)


def test_tool_choice_named(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = _calls_streamed_and_not(client, kw)
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER["function"]["parameters"])


def test_tool_choice_auto_hermes(client):
    # The small model does not call tools on its own: the hermes format is forced with a regex, so the
    # output goes through the serve-time parser exactly as a tool-calling model's would.
    forced = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=100, temperature=0,
              extra_body={"structured_outputs": {"regex": forced}})
    calls = _calls_streamed_and_not(client, kw)
    assert len(calls) == 1 and calls[0][0] == "get_time" and calls[0][1]["zone"] in ("UTC", "CET")


def _calls_streamed_and_not(client, kw) -> list[tuple[str, dict]]:
    """The tool calls of a greedy request, asked plainly and streamed: the streamed call's first delta
    has id, type and name, its arguments then come in several fragments whose concatenation is exactly
    the plain response's arguments (the same greedy text). Returns (name, parsed arguments) per call."""
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert all(c.id and c.type == "function" for c in r.choices[0].message.tool_calls)
    plain = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    acc: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.index not in acc:  # the call's first delta: its header
                    assert tc.id and tc.type == "function" and tc.function.name
                    acc[tc.index] = {"name": tc.function.name, "arguments": "", "fragments": 0}
                else:
                    assert tc.id is None and not tc.function.name
                slot = acc[tc.index]
                if tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
                    slot["fragments"] += 1
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(s["name"], s["arguments"]) for _, s in sorted(acc.items())]
    assert streamed == plain
    assert all(s["fragments"] > 1 for s in acc.values()), acc
    return [(name, json.loads(args)) for name, args in plain]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, "structured_outputs.backend"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a+"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(server, extra, param):
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err


def test_invalid_schema_names_each_backend_and_server_still_serves(client, server):
    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 4, "structured_outputs": {"json": {"type": "bogus"}}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "xgrammar:" in msg and "guidance:" in msg and "outlines:" in msg
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def _jumped(server) -> float:
    text = httpx.get(server + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllite:jump_forward_tokens"))


def test_jump_forward_tokens_are_counted_in_metrics(client, server):
    """The server runs with --jump-forward (so every structured test above runs through it); a schema with a
    long constant key forces tokens, and /metrics counts them."""
    before = _jumped(server)
    schema = {"type": "object", "properties": {"temperature_in_degrees_celsius": {"type": "integer"}},
              "required": ["temperature_in_degrees_celsius"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert _jumped(server) > before


def test_auto_tool_choice_needs_the_flags():
    from vllite_core.entrypoints.openai.structured import plan_tools

    assert plan_tools([WEATHER], None).mode == "auto"
    assert plan_tools(None, None).mode == "none"
