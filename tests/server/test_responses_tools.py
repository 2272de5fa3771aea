"""Function tools on /v1/responses through the real ``openai`` client against a real server (127.0.0.1,
a tiny random Llama with the SmolLM2 vocabulary, --tool-call-parser hermes). References: chat completions
for the same conversation and tools (the tool machinery Responses is built on, reached by its own
route), jsonschema for grammar-forced arguments, the non-streamed response for the streamed one."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-rtools"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
            "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }} "
            "{{ c['function']['arguments'] }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|im_end|>\n"
            "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "book_trip", "description": "Book a trip", "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "book_trip", "description": "Book a trip",
                                                "parameters": SCHEMA}}]
USER = [{"role": "user", "content": "Book me a trip."}]
NAMED = {"type": "function", "name": "book_trip"}


@pytest.fixture(scope="module")
def server():
    import tempfile
    from pathlib import Path

    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    with tempfile.TemporaryDirectory() as d:
        path = Path(d)
        tok = load_tokenizer(resolve_model_source(None))
        save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]),
                  tokenizer=tok)
        (path / "template.jinja").write_text(TEMPLATE)
        srv = ServerProcess(["--model", str(path), "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks",
                             "64", "--num-threads", "1", "--served-model-name", MODEL, "--chat-template",
                             str(path / "template.jinja"), "--structured-outputs-config",
                             '{"disable_any_whitespace": true}', "--enable-auto-tool-choice", "--tool-call-parser",
                             "hermes"])
        try:
            yield srv.wait_ready()
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def respond(client, input, **kw):
    return client.responses.create(model=MODEL, input=input, max_output_tokens=60, temperature=0.0, **kw)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0.0,
                                          **kw).choices[0]


@pytest.mark.parametrize("choice,chat_choice", [
    (NAMED, {"type": "function", "function": {"name": "book_trip"}}), ("required", "required")],
    ids=["named", "required"])
def test_forced_call_validates_equals_chat_and_streams(client, choice, chat_choice):
    r = respond(client, USER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "book_trip" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    ref = chat(client, USER, tools=CHAT_TOOLS, tool_choice=chat_choice, parallel_tool_calls=False)
    assert json.loads(ref.message.tool_calls[0].function.arguments) == json.loads(call.arguments)
    events = list(client.responses.create(model=MODEL, input=USER, max_output_tokens=60, temperature=0.0,
                                          tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == json.loads(call.arguments)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas and done.name == "book_trip"
    final = events[-1].response.output
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final] == \
        [("function_call", "book_trip", json.loads(call.arguments))]


def test_results_fed_back_equal_chat_and_previous_response(client):
    first = respond(client, USER, tools=TOOLS, tool_choice=NAMED)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "booked"}
    whole = respond(client, [*USER, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                     "arguments": call.arguments}, result], tools=TOOLS, tool_choice="auto")
    ref = chat(client, [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "booked"}], tools=CHAT_TOOLS, tool_choice="auto")
    assert not ref.message.tool_calls  # the random model writes text: auto parses none
    assert whole.output_text == ref.message.content and [o.type for o in whole.output] == ["message"]
    follow = respond(client, [result], previous_response_id=first.id, tools=TOOLS, tool_choice="auto")
    assert follow.output_text == whole.output_text
    streamed = list(client.responses.create(model=MODEL, input=[result], previous_response_id=first.id,
                                            max_output_tokens=60, temperature=0.0, tools=TOOLS, stream=True))
    assert streamed[-1].response.output_text == whole.output_text


def test_bad_tools_are_400(client):
    for kw, param in (({"tools": [{"type": "web_search"}]}, "tools"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            respond(client, USER, **kw)
        assert e.value.body["param"] == param


def test_legacy_functions_are_tools(client):
    """Chat's deprecated ``functions`` / ``function_call`` through the openai client: the forced call validates
    against its schema and equals the tools form's call (greedy); the answer is ``message.function_call`` with
    finish_reason "function_call", streamed pieces join to it; a legacy history (assistant ``function_call``,
    ``function`` result) renders and answers as the tools history does; "auto" answers as tools' auto."""
    fn = CHAT_TOOLS[0]["function"]
    legacy = chat(client, USER, functions=[fn], function_call={"name": "book_trip"})
    tools = chat(client, USER, tools=CHAT_TOOLS, parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "book_trip"}})
    call = legacy.message.function_call
    assert legacy.message.tool_calls is None and legacy.finish_reason == "function_call"
    assert call.name == "book_trip"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert call.arguments == tools.message.tool_calls[0].function.arguments
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=0.0, stream=True,
                                            functions=[fn], function_call={"name": "book_trip"})
    chunks = [c.choices[0] for c in stream if c.choices]
    pieces = [c.delta.function_call for c in chunks if c.delta.function_call]
    assert pieces[0].name == "book_trip" and all(c.delta.tool_calls is None for c in chunks)
    assert "".join(p.arguments or "" for p in pieces) == call.arguments
    assert chunks[-1].finish_reason == "function_call"

    after_legacy = USER + [{"role": "assistant", "content": None, "function_call": call.model_dump()},
                           {"role": "function", "name": "book_trip", "content": "booked"}]
    after_tools = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": call.model_dump()}]},
        {"role": "tool", "tool_call_id": "c1", "content": "booked"}]
    fed = client.chat.completions.create(model=MODEL, messages=after_legacy, max_tokens=8, temperature=0.0,
                                         functions=[fn])
    ref = client.chat.completions.create(model=MODEL, messages=after_tools, max_tokens=8, temperature=0.0,
                                         tools=CHAT_TOOLS, parallel_tool_calls=False)
    assert fed.usage.prompt_tokens == ref.usage.prompt_tokens
    assert fed.choices[0].message.content == ref.choices[0].message.content
    assert fed.choices[0].finish_reason == {"tool_calls": "function_call"}.get(ref.choices[0].finish_reason,
                                                                                ref.choices[0].finish_reason)


def test_langchain_openai_invoke_stream_and_tools(server, client):
    """langchain-openai's ChatOpenAI against the same server: invoke equals the openai client's chat text
    (greedy), stream's chunks join to it, and bind_tools with a forced tool gives a tool call whose args
    validate against the schema and equal chat's forced call."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server + "/v1", api_key="none", model=MODEL, temperature=0.0, max_tokens=12,
                     max_retries=0, timeout=120)
    want = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12,
                                          temperature=0.0).choices[0].message.content
    got = llm.invoke("Book me a trip.")
    assert want and got.content == want
    assert got.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream("Book me a trip.")) == want

    bound = llm.model_copy(update={"max_tokens": 60}).bind_tools(CHAT_TOOLS, tool_choice="book_trip",
                                                                 parallel_tool_calls=False)
    msg = bound.invoke("Book me a trip.")
    ref = chat(client, USER, tools=CHAT_TOOLS, parallel_tool_calls=False,
               tool_choice={"type": "function", "function": {"name": "book_trip"}})
    (call,) = msg.tool_calls
    assert call["name"] == "book_trip"
    jsonschema.validate(call["args"], SCHEMA)
    assert call["args"] == json.loads(ref.message.tool_calls[0].function.arguments)
