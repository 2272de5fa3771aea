"""Family tool parsers through a real server: `vllite serve --tool-call-parser qwen3_coder` and the real
`openai` client. The small model does not call tools by itself, so the call's text is forced with a regex
(as tests/server/test_structured_output_server.py does for hermes): the output then goes through the parser as a
tool-calling model's would, streamed and not, and its values are typed by the request's tool schema."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENGINE = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "128", "--num-threads", "2",
          "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"},
                                                                      "offset": {"type": "integer"}},
                                       "required": ["zone", "offset"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
FORCED = (r"Checking\.\n<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n"
          r"<parameter=offset>\n[0-9]\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(ENGINE)
    srv.wait_ready()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    srv.stop()


def test_qwen3_coder_calls_streamed_and_not(client):
    kw = dict(model=MODEL, messages=ASK, tools=[TIME], tool_choice="auto", max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": FORCED}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (r.choices[0].finish_reason, msg.content) == ("tool_calls", "Checking.\n"), msg
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TIME["function"]["parameters"])  # offset typed as an integer by the schema
    content, streamed = "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = streamed.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                slot["arguments"] += tc.function.arguments or ""
    assert content == msg.content
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == [("get_time", call.function.arguments)]

