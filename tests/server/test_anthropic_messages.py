"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the real ``anthropic``
client against a real server (127.0.0.1, a tiny random Llama with the SmolLM2 vocabulary, an API key).
References: /v1/chat/completions for the same conversation (the path Messages is built on, reached
through the ``openai`` client), HF's ``apply_chat_template`` for token counts, jsonschema for forced
tool inputs, and the non-streamed Message for the streamed one."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-messages"
API_KEY = "anthropic-test-key"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
            "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }} "
            "{{ c['function']['arguments'] }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|im_end|>\n"
            "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GREEDY = {"temperature": 0.0}  # the anthropic package no longer lists temperature; the API takes it
SYSTEM = "You are terse."
USER = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOL = {"name": "book_trip", "description": "Book a trip", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    path = tmp_path_factory.mktemp("tiny-messages")
    tok = load_tokenizer(resolve_model_source(None))
    save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]), tokenizer=tok)
    (path / "template.jinja").write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(["--model", model_path, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--num-threads", "1", "--served-model-name", MODEL, "--chat-template",
                         model_path + "/template.jinja",
                         "--structured-outputs-config", '{"disable_any_whitespace": true}',
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        env={"VLLITE_API_KEY": API_KEY})
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def claude(server):
    c = anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def oai(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def chat(oai, messages, **kw):
    return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, **kw).choices[0]


def test_text_equals_chat_and_stream_equals_whole(claude, oai, server):
    msg = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=USER, extra_body=GREEDY)
    ref = chat(oai, [{"role": "system", "content": SYSTEM}, *USER], max_tokens=8)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.message.content
    assert msg.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert msg.usage.output_tokens == 8 or msg.stop_reason == "end_turn"
    with claude.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, messages=USER, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.input_tokens == msg.usage.input_tokens and final.usage.output_tokens == msg.usage.output_tokens
    # Anthropic's event sequence, raw (the client drops pings)
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=60, json={
        "model": MODEL, "max_tokens": 8, "system": SYSTEM, "messages": USER, "stream": True, **GREEDY})
    events = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in data] == events
    assert events[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta") == msg.content[0].text
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY).content[0].text
    stop = whole.strip()[2:5]
    cut = claude.messages.create(model=MODEL, max_tokens=12, messages=USER, stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[:whole.index(stop)]


def test_forced_tool_use_validates_and_equals_chat(claude, oai):
    msg = claude.messages.create(model=MODEL, max_tokens=60, messages=USER, tools=[TOOL],
                                 tool_choice={"type": "tool", "name": "book_trip"}, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    use = msg.content[0]
    assert use.name == "book_trip"
    jsonschema.validate(use.input, SCHEMA)
    ref = chat(oai, USER, max_tokens=60, tools=[{"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip", "parameters": SCHEMA}}],
        tool_choice={"type": "function", "function": {"name": "book_trip"}})
    assert json.loads(ref.message.tool_calls[0].function.arguments) == use.input
    # streamed: input_json_delta pieces add up to the same input
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=USER, tools=[TOOL],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    anyone = claude.messages.create(model=MODEL, max_tokens=60, messages=USER, tools=[TOOL],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in anyone.content]
    jsonschema.validate(final.content[0].input, SCHEMA)
    # the tool's result fed back: the same as chat with the OpenAI form of the conversation
    turns = [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                       "input": use.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "booked"},
                                          {"type": "text", "text": "Thanks."}]}]
    after = claude.messages.create(model=MODEL, max_tokens=8, messages=turns, tools=[TOOL], extra_body=GREEDY)
    ref = chat(oai, [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "booked"}, {"role": "user", "content": "Thanks."}],
        max_tokens=8, tools=[{"type": "function", "function": {"name": "book_trip", "description": "Book a trip",
                                                               "parameters": SCHEMA}}])
    assert after.content[0].text == ref.message.content


def test_count_tokens(claude, model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    got = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=USER)
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *USER], chat_template=TEMPLATE,
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    assert got.input_tokens == len(ids)
    msg = claude.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=USER, extra_body=GREEDY)
    assert msg.usage.input_tokens == len(ids)


def test_errors_in_anthropic_shape(claude, server):
    with pytest.raises(anthropic.BadRequestError) as e:  # a text-only model: images are a clear 400
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            {"type": "text", "text": "What is this?"}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "text-only" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=USER, extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    bad.close()
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 2},
                   headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(server + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                   headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and "error" in r.json() and r.json()["error"]["code"] == "invalid_api_key"
