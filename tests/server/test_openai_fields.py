"""Every request field the ``openai`` package documents for completions, chat and responses, sent once
through the real client to a real server (127.0.0.1, a tiny random Llama): accepted, and the ignored
ones change nothing (greedy text equal to the same request without them) and are named once in the
server log; values asking for what is not served are 400s naming the field; undocumented names stay
400s. The field lists are read from the installed ``openai`` package's own TypedDicts, so a field it
adds later fails here until the server knows it."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import completion_create_params as cp
from openai.types.chat import completion_create_params as ccp
from openai.types.responses import response_create_params as rcp
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-fields"
TEMPLATE = ("{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n"
            "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "get_colour", "description": "a colour",
                                           "parameters": {"type": "object", "properties": {}}}}]

# One value per documented field (refused ones are in REFUSED_* below, each sent there).
CHAT = dict(
    messages=MSGS, model=MODEL, frequency_penalty=0.0, logit_bias={"1": 0}, logprobs=True, max_completion_tokens=6,
    max_tokens=6, metadata={"k": "v"}, modalities=["text"], moderation={"model": "omni-moderation-latest"}, n=1,
    parallel_tool_calls=True, prediction={"type": "content", "content": "Blue."}, presence_penalty=0.0,
    prompt_cache_key="pck", prompt_cache_options={"mode": "implicit", "ttl": "30m"}, prompt_cache_retention="24h",
    reasoning_effort="low", response_format={"type": "text"}, safety_identifier="sid", seed=7, service_tier="auto",
    stop=["\n\n\n"], store=False, temperature=0.0, tool_choice="none", tools=TOOLS, top_logprobs=2, top_p=1.0,
    user="u1", verbosity="low", web_search_options={"search_context_size": "low"},
)
REFUSED_CHAT = [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"function_call": "auto"}, "function_call"),  # without functions
    ({"functions": [TOOLS[0]["function"]], "tools": TOOLS}, "functions"),
    ({"functions": [TOOLS[0]["function"]], "function_call": {"nme": "get_colour"}}, "function_call"),
]  # functions served: test_responses_tools.py::test_legacy_functions_are_tools
COMPLETION = dict(model=MODEL, prompt="The colour of the sky is", best_of=1, echo=False, frequency_penalty=0.0,
                  logit_bias={"1": 0}, logprobs=1, max_tokens=6, n=1, presence_penalty=0.0, seed=7, stop=["\n\n\n"],
                  temperature=0.0, top_p=1.0, user="u1")
REFUSED_COMPLETION = [({"suffix": " and so on"}, "suffix")]
RESPONSES = dict(
    model=MODEL, input="Name a colour.", instructions="Be terse.", max_output_tokens=6, metadata={"k": "v"},
    parallel_tool_calls=True, reasoning={"effort": "low", "summary": "auto"}, store=True, temperature=0.0,
    text={"format": {"type": "text"}}, tool_choice="none", tools=[], top_logprobs=0, top_p=1.0,
    truncation="disabled", user="u1", include=[], background=False, access_programs={"cyber": "standard"},
    background_options={"completion_window": "soonest"}, context_management=[{"type": "compaction",
                                                                               "compact_threshold": 1000}],
    image={"context_compression": "auto"}, max_tool_calls=1, moderation={"model": "omni-moderation-latest"},
    prompt_cache_key="pck", prompt_cache_options={"mode": "implicit", "ttl": "30m"}, prompt_cache_retention="24h",
    safety_identifier="sid", service_tier="auto",
)
REFUSED_RESPONSES = [({"conversation": "conv_1"}, "conversation"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
                     ({"reasoning": {"effort": "extreme"}}, "reasoning")]
STREAMED = {"stream", "stream_options"}  # sent in the streamed tests


def documented(typed_dict) -> set[str]:
    return set(typed_dict.__annotations__) | {"stream"}  # stream: in the (non-)streaming subclasses


def sent(values: dict, refused: list) -> set[str]:
    return set(values) | {k for extra, _ in refused for k in extra} | STREAMED


@pytest.mark.parametrize("params,values,refused", [
    (ccp.CompletionCreateParamsBase, CHAT, REFUSED_CHAT),
    (cp.CompletionCreateParamsBase, COMPLETION, REFUSED_COMPLETION),
    (rcp.ResponseCreateParamsBase, {**RESPONSES, "previous_response_id": "in the test"}, REFUSED_RESPONSES),
], ids=["chat", "completions", "responses"])
def test_every_documented_field_is_sent(params, values, refused):
    assert sent(values, refused) == documented(params)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny random Llama with the whole SmolLM2 vocabulary (chat markup tokens included)."""
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    path = tmp_path_factory.mktemp("tiny-fields")
    tok = load_tokenizer(resolve_model_source(None))
    save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]), tokenizer=tok)
    (path / "template.jinja").write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(["--model", model_path, "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--num-threads", "1", "--served-model-name", MODEL,
                         "--chat-template", model_path + "/template.jinja"])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def logged_names(server, endpoint: str) -> list[str]:
    """The field names the server's log says it ignored on ``endpoint``, in order, repeats kept."""
    lines = [line for line in server.lines if f"{endpoint} ignoring request field(s) " in line]
    return [n.strip() for line in lines for n in line.split("field(s) ", 1)[1].split(":", 1)[0].split(",")]


def test_chat_every_field(client, server, tok):
    full = client.chat.completions.create(**CHAT)
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0.0, seed=7,
                                           extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert full.choices[0].message.content == plain.choices[0].message.content
    assert full.choices[0].logprobs.content and len(full.choices[0].logprobs.content[0].top_logprobs) == 2
    # reasoning_effort reached the template (the reference: HF's own rendering with it)
    ids = tok.apply_chat_template(MSGS, chat_template=TEMPLATE, add_generation_prompt=True, reasoning_effort="low",
                                  return_dict=True)["input_ids"]
    assert full.usage.prompt_tokens == plain.usage.prompt_tokens == len(ids)
    without = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    assert without.usage.prompt_tokens < len(ids)
    # streamed with stream_options (include_obfuscation is OpenAI's, ignored): the same text, usage at the end
    chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True,
                                                                                     "include_obfuscation": False}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(ids)
    client.chat.completions.create(**CHAT)  # a second time: nothing new in the log
    ignored = {"metadata", "store", "user", "service_tier", "prediction", "web_search_options", "verbosity",
               "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
               "moderation", "stream_options.include_obfuscation"}
    assert sorted(logged_names(server, "/v1/chat/completions:")) == sorted(ignored)  # each once


def test_completions_every_field(client, server):
    full = client.completions.create(**COMPLETION)
    plain = client.completions.create(model=MODEL, prompt=COMPLETION["prompt"], max_tokens=6, temperature=0.0)
    assert full.choices[0].text == plain.choices[0].text and full.choices[0].logprobs.tokens
    streamed = list(client.completions.create(**COMPLETION, stream=True,
                                              stream_options={"include_usage": True, "include_obfuscation": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full.choices[0].text
    assert logged_names(server, "/v1/completions:") == ["user", "stream_options.include_obfuscation"]


def test_responses_every_field(client, server, tok):
    first = client.responses.create(**RESPONSES)
    full = client.responses.create(**{**RESPONSES, "previous_response_id": first.id, "input": "Another."})
    plain = client.responses.create(model=MODEL, instructions="Be terse.", input="Name a colour.",
                                    max_output_tokens=6, temperature=0.0)
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
    ids = tok.apply_chat_template(msgs, chat_template=TEMPLATE, add_generation_prompt=True, reasoning_effort="low",
                                  return_dict=True)["input_ids"]
    assert first.usage.input_tokens == len(ids) > plain.usage.input_tokens
    assert full.previous_response_id == first.id and full.usage.input_tokens > first.usage.input_tokens
    events = list(client.responses.create(**RESPONSES, stream=True, stream_options={"include_obfuscation": False}))
    assert events[-1].response.output_text == first.output_text
    assert sorted(logged_names(server, "/v1/responses:")) == sorted(
        ["metadata", "user", "access_programs", "background_options", "context_management", "image", "max_tool_calls",
         "moderation", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
         "service_tier", "top_logprobs", "stream_options.include_obfuscation"])


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path,base,extra,param", [
    *[("/v1/chat/completions", {"messages": MSGS}, e, p) for e, p in REFUSED_CHAT],
    *[("/v1/completions", {"prompt": "x"}, e, p) for e, p in REFUSED_COMPLETION],
    *[("/v1/responses", {"input": "x"}, e, p) for e, p in REFUSED_RESPONSES],
    ("/v1/chat/completions", {"messages": MSGS}, {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MSGS}, {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x"}, {"metadata": {"k": "v"}}, "metadata"),  # not a completions field
    ("/v1/responses", {"input": "x"}, {"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
])
def test_refused_values_are_400_naming_the_field(server, path, base, extra, param):
    limit = {"max_tokens" if "responses" not in path else "max_output_tokens": 1}
    r = _post(server, path, {**base, **limit, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _post(server, path, {**base, **limit}).status_code == 200  # and the server goes on

