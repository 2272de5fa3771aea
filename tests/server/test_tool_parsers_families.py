"""The family tool parsers (mistral, pythonic, qwen3_coder, glm45, deepseek_v3, granite, openai) on outputs
written in each family's documented format (the model cards' and the formats' own documentation: Mistral's
tokenizer v3/v11 tool-call layout, Llama 3.2/4 pythonic calls, Qwen3-Coder's XML, GLM-4.5's arg_key /
arg_value, DeepSeek-V3's fenced calls, Granite 3's tagged array, gpt-oss's harmony messages): whole and
streamed at every split, where the streamed content and call deltas must add up to the whole parse, and
malformed calls left as content."""
from __future__ import annotations

import json

import pytest

from vllite_core.plugins.manager import get_plugin_manager
from vllite_core.tool_parsers import ToolParserStream, load_tool_parsers

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}}
DS = {"B": "<｜tool▁calls▁begin｜>", "E": "<｜tool▁calls▁end｜>", "b": "<｜tool▁call▁begin｜>",
      "e": "<｜tool▁call▁end｜>", "s": "<｜tool▁sep｜>"}
H_CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"

CASES = [
    # (parser, output, content, [(name, arguments as parsed JSON)])
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
     "Sure.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("mistral", "No tools needed [TOOL", "No tools needed [TOOL", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{not json", "[TOOL_CALLS]get_weather[ARGS]{not json", []),
    ("pythonic", '[get_weather(city="San Francisco", days=3, metric=True), get_time()]', "",
     [("get_weather", {"city": "San Francisco", "days": 3, "metric": True}), ("get_time", {})]),
    ("pythonic", "<|python_start|>[get_weather(city='Oslo', hours=[1, 2])]<|python_end|>", "",
     [("get_weather", {"city": "Oslo", "hours": [1, 2]})]),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
    ("pythonic", "[see the docs]", "[see the docs]", []),
    ("pythonic", "[get_weather(city=__import__('os'))]", "[get_weather(city=__import__('os'))]", []),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                    "<parameter=days>\n5\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "Checking.\n", [("get_weather", {"city": "New York", "days": 5, "metric": False}), ("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
                    "<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "42", "hours": [1, 2]})]),  # typed by the schema: city stays text
    ("qwen3_coder", "a < b and <tool_ca", "a < b and <tool_ca", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><tool_call>get_time</tool_call>",
     "", [("get_weather", {"city": "Beijing", "days": 2}), ("get_time", {})]),
    ("deepseek_v3", "Let me check.{B}{b}function{s}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{e}"
                    "{b}function{s}get_time\n```json\n{{}}\n```{e}{E}".format(**DS),
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("deepseek_v3", "{B}{b}get_weather{s}{{\"city\": \"Rome\", \"days\": 1}}{e}{E}".format(**DS), "",
     [("get_weather", {"city": "Rome", "days": 1})]),
    ("deepseek_v3", "plain", "plain", []),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Austin"}}]', "",
     [("get_weather", {"city": "Austin"})]),
    ("granite", 'Calling.<tool_call>[{"name": "get_time", "arguments": {}}]', "Calling.", [("get_time", {})]),
    ("granite", "<tool_call>[oops]", "<tool_call>[oops]", []),
    ("openai", "<|channel|>analysis<|message|>Need weather.<|end|>" + H_CALL.format("get_weather", '{"city": "Lima"}'),
     "", [("get_weather", {"city": "Lima"})]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there",
     "Hi there", []),
    ("openai", "Plain text, no harmony.", "Plain text, no harmony.", []),
]


def _parsers():
    return load_tool_parsers(get_plugin_manager())


def _whole(name, text):
    parsed = _parsers()[name](None, [WEATHER]).parse(text, final=True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls], parsed


def _streamed(name, pieces):
    parser = _parsers()[name](None, [WEATHER])
    stream = ToolParserStream(parser)
    text, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        text += piece
        c, deltas = stream.feed(text, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            slot = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert slot["id"] is None, "a call's header comes once"
                slot["id"], slot["name"] = d["id"], d["function"]["name"]
            slot["arguments"] += d["function"].get("arguments", "")
    return content, [(s["name"], s["arguments"], s["id"]) for _, s in sorted(calls.items())]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_output(name, text, content, calls):
    got_content, got_calls, _ = _whole(name, text)
    assert (got_content, got_calls) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_equals_whole_at_every_split(name, text, content, calls):
    _, _, whole = _whole(name, text)
    want = [(c.name, c.arguments) for c in whole.calls]
    splits = [list(text)] + [[text[:k], text[k:]] for k in range(1, len(text), max(1, len(text) // 40))]
    for pieces in splits:
        got_content, got_calls = _streamed(name, pieces)
        if want:  # the calls' arguments streamed are exactly the whole parse's raw arguments
            assert [(n, a) for n, a, _ in got_calls] == want, pieces
            assert got_content == whole.content, pieces
        else:  # no call after all: the whole text is content (a call header may have gone out first, as
            # from a model that starts a call and never finishes it)
            assert got_content == whole.content, pieces


def test_mistral_ids_are_nine_alphanumerics():
    _, _, whole = _whole("mistral", CASES[1][1])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in whole.calls)
    _, calls = _streamed("mistral", list(CASES[1][1]))
    assert all(len(i) == 9 and i.isalnum() for _, _, i in calls)


def test_the_parsers_that_need_control_tokens_say_so():
    parsers = _parsers()
    assert {n for n, p in parsers.items() if p.keeps_special_tokens} == {"mistral", "openai"}
