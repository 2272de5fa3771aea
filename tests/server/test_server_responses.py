"""POST /v1/responses, --reasoning-parser and chat parity through the real ``openai`` client on a
real server (127.0.0.1), on a tiny random Llama whose tokenizer has ``<think>`` / ``</think>`` as
added tokens. References: /v1/chat/completions for the same messages (an independent path) for
the Responses text; the HF tokenizer's own ``apply_chat_template`` / ``decode`` for prompts and
reasoning splits. A test-only global logits processor (think_forcer.py) makes the model write the
tags for prompts holding a trigger word, so the reasoning the server returns is really in the
model's output."""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]  # tests/: the shared helpers
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
MODEL = "tiny-think"
TRIGGER = "zebra"
REASONING, ANSWER = "The user wants a fact about stripes.", "Zebras have stripes."
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory, tiny_path):
    """A tiny Llama with the SmolLM2 tokenizer (the session's tiny_path copy) plus the two tags as plain added
    tokens (as Qwen3's), its vocabulary grown to match."""
    from tiny_models import TINY, save_tiny
    from transformers import AutoTokenizer, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-think")
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.add_tokens(["<think>", "</think>"])
    save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]), tokenizer=tok)
    (path / "template.jinja").write_text(TEMPLATE)
    return str(path), AutoTokenizer.from_pretrained(path)


def template_ids(tok, messages, **kw):
    return list(tok.apply_chat_template(messages, chat_template=TEMPLATE, return_dict=True, **kw)["input_ids"])


@pytest.fixture(scope="module")
def forced(think_model):
    _, tok = think_model
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    reasoning_ids, answer_ids = enc(REASONING), enc(ANSWER)
    ids = [think, *reasoning_ids, end, *answer_ids, tok.eos_token_id]
    trigger = enc(TRIGGER)
    prompt = template_ids(tok, [{"role": "user", "content": TRIGGER}], add_generation_prompt=True)
    assert any(prompt[i:i + len(trigger)] == trigger for i in range(len(prompt))), "trigger not a token run"
    # The reference split: the tokenizer's own decoding of the ids on each side of the tags.
    return {"ids": ids, "trigger": trigger, "reasoning": tok.decode(reasoning_ids), "answer": tok.decode(answer_ids)}


@pytest.fixture(scope="module")
def server(think_model, forced):
    path, _ = think_model
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "VLLITE_TEST_TRIGGER_IDS": ",".join(map(str, forced["trigger"])),
           "VLLITE_TEST_FORCED_IDS": ",".join(map(str, forced["ids"]))}
    srv = ServerProcess(["--model", path, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--num-threads", "1", "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                         "--chat-template", os.path.join(path, "template.jinja"),
                         "--logits-processors", "think_forcer:ForceTokens",
                         # A random model fills JSON with whitespace: the schema test wants the answer itself.
                         "--structured-outputs-config", '{"disable_any_whitespace": true}'], env=env)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def chat_text(client, messages, n=10, **kw):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0, **kw)
    return r


def responses_input(messages):
    return [{"role": m["role"], "content": [{"type": "output_text" if m["role"] == "assistant" else "input_text",
                                             "text": m["content"]}]} for m in messages]


# ---- Responses API ------------------------------------------------------------------------------

def test_response_text_equals_chat(client):
    chat = chat_text(client, MSGS)
    resp = client.responses.create(model=MODEL, input=responses_input(MSGS), max_output_tokens=10, temperature=0,
                                   metadata={"k": "v"}, user="u1")
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert [o.type for o in resp.output] == ["message"]
    assert resp.output[0].content[0].type == "output_text"
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.metadata == {"k": "v"} and resp.user == "u1"
    # instructions are a system message in front; a string input is one user message
    resp2 = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a colour.",
                                    max_output_tokens=10, temperature=0)
    assert resp2.output_text == chat.choices[0].message.content


def test_streamed_events(client):
    whole = client.responses.create(model=MODEL, input="Say something.", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Say something.", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    n_delta = kinds.count("response.output_text.delta")
    assert n_delta >= 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n_delta
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert events[-1].response.status == whole.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_responses_stream_helper(client):
    whole = client.responses.create(model=MODEL, input="Count.", max_output_tokens=6, temperature=0)
    with client.responses.stream(model=MODEL, input="Count.", max_output_tokens=6, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text


def test_previous_response_id_and_retrieve(client):
    first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=6, temperature=0)
    follow = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    conv = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]
    assert follow.output_text == chat_text(client, conv, 6).choices[0].message.content
    assert follow.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    # an image on a text-only model (images on a VLM: tests/server/test_llava_chat.py)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.content.image_url"),
    ({"input": [{"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_file", "file_id": "f"}]}]}, "input[1].content[1]"),
    ({"input": [{"type": "computer_call", "call_id": "c", "action": {}}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "not a schema"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),  # "high" is served: the template gets reasoning_effort
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(server, extra, param):
    body = {"input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(server + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_text_format_json_schema_is_enforced(client):
    """text.format goes through structured output: the answer validates against the schema (jsonschema)
    and equals what chat's response_format gives for the same messages."""
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    msgs = [{"role": "user", "content": "Is water wet?"}]
    r = client.responses.create(model=MODEL, input=responses_input(msgs), max_output_tokens=60, temperature=0,
                                text={"format": fmt})
    jsonschema.validate(json.loads(r.output_text), schema)
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "verdict", "schema": schema}})
    assert r.output_text == chat.choices[0].message.content


def test_server_keeps_serving_after_bad_input(client):
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).status in ("completed", "incomplete")


# ---- reasoning output ---------------------------------------------------------------------------

def test_chat_reasoning_whole_and_streamed(client, forced):
    msgs = [{"role": "user", "content": TRIGGER}]
    r = chat_text(client, msgs, 64)
    msg = r.choices[0].message.model_extra
    assert msg["reasoning"] == msg["reasoning_content"] == forced["reasoning"]
    assert r.choices[0].message.content == forced["answer"]
    assert r.choices[0].finish_reason == "stop"
    reasoning, content = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0, stream=True):
        d = chunk.choices[0].delta
        reasoning.append((d.model_extra or {}).get("reasoning") or "")
        content.append(d.content or "")
    assert "".join(reasoning) == forced["reasoning"] and "".join(content) == forced["answer"]


def test_responses_reasoning_item(client, forced):
    resp = client.responses.create(model=MODEL, input=TRIGGER, max_output_tokens=64, temperature=0)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == forced["reasoning"]
    assert resp.output_text == forced["answer"] and resp.status == "completed"
    assert resp.usage.output_tokens == len(forced["ids"])
    events = list(client.responses.create(model=MODEL, input=TRIGGER, max_output_tokens=64, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == forced["reasoning"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == forced["answer"]
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


# ---- chat parity ------------------------------------------------------------------------------

def prompt_ids(client, messages, **kw):
    """The prompt token ids the server fed the model (prompt_logprobs=0: the prompt token at each
    position; the first position has none)."""
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 0, **kw})
    plp = r.model_extra["prompt_logprobs"]
    assert all(len(p) == 1 for p in plp[1:])
    return [int(next(iter(p))) for p in plp[1:]], r.usage.prompt_tokens


PARITY = [
    ({}, dict(add_generation_prompt=True)),
    ({"chat_template_kwargs": {"enable_thinking": False}}, dict(add_generation_prompt=True, enable_thinking=False)),
    ({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
    ({"add_generation_prompt": False, "continue_final_message": True},
     dict(add_generation_prompt=False, continue_final_message=True)),
]


@pytest.mark.parametrize("body,ref_kw", PARITY, ids=["default", "chat_template_kwargs", "no_generation_prompt",
                                                     "continue_final_message"])
def test_chat_prompt_matches_apply_chat_template(client, think_model, body, ref_kw):
    _, tok = think_model
    msgs = MSGS + [{"role": "assistant", "content": "The colour is"}]
    ref = template_ids(tok, msgs, **ref_kw)  # the server runs with --chat-template TEMPLATE
    got, n = prompt_ids(client, msgs, **body)
    assert n == len(ref) and got == ref[1:]


def test_both_generation_prompt_and_continue_is_400(server):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MSGS + [{"role": "assistant", "content": "a"}],
                                                          "continue_final_message": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_echo_prepends_the_final_message(client):
    msgs = MSGS + [{"role": "assistant", "content": "The colour is"}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat_text(client, msgs, 5, extra_body=kw).choices[0].message.content
    echoed = chat_text(client, msgs, 5, extra_body={**kw, "echo": True}).choices[0].message.content
    assert echoed == "The colour is" + plain
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True, extra_body={**kw, "echo": True})]
    assert "".join(parts) == echoed
    # echo with a user message last: nothing to echo (vLLM)
    assert chat_text(client, MSGS, 3, extra_body={"echo": True}).choices[0].message.content == \
        chat_text(client, MSGS, 3).choices[0].message.content


def test_suffix_is_400_without_fim(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_llm_chat_parity(think_model):
    from vllite_core import LLM, SamplingParams
    from vllite_core.errors import InvalidRequestError

    path, tok = think_model
    llm = LLM(model=path, dtype="float32", max_model_len=256, num_kv_blocks=32, num_threads=1)
    msgs = MSGS + [{"role": "assistant", "content": "The colour is"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=1), add_generation_prompt=False, continue_final_message=True,
                   chat_template=TEMPLATE)[0]
    assert out.prompt == tok.apply_chat_template(msgs, tokenize=False, chat_template=TEMPLATE,
                                                 continue_final_message=True)
    out = llm.chat(MSGS, SamplingParams(max_tokens=1), chat_template=TEMPLATE,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(msgs, continue_final_message=True)
    assert e.value.param == "continue_final_message"


# ---- start-up options ---------------------------------------------------------------------------

@pytest.mark.parametrize("option,expect", [
    ({"reasoning_parser": "nope"},
     "unknown --reasoning-parser 'nope'; known: deepseek_r1, glm45, granite, mistral, openai_gptoss, qwen3"),
    ({"chat_template": "/no/such/template.jinja"}, "no such file"),
])
def test_startup_errors(option, expect):
    """Checked by `vllite serve` before the model loads (cli_serve._frontend_options)."""
    import argparse

    from vllite_core.entrypoints.cli_serve import _frontend_options

    ns = argparse.Namespace(**{"chat_template": None, "reasoning_parser": None, **option})
    with pytest.raises(SystemExit, match=expect):
        _frontend_options(ns)
