"""The deepseek_r1 and qwen3 reasoning parsers on whole outputs and on deltas (tags split across
deltas, no end tag, no tags), looked up through the plugin hook. The expected splits are written
out by hand from the parsers' documented semantics (vLLM's)."""
from __future__ import annotations

import pytest
from plugin_fakes import fresh_plugins, unique  # noqa: F401  (fixture)

from vllite_core.plugins import PLUGINS_GROUP
from vllite_core.reasoning import ReasoningParserError, get_reasoning_parser, reasoning_parser_names


class _NoAddedTokens:
    added_tokens_decoder: dict = {}


def parser(name):
    return get_reasoning_parser(name, _NoAddedTokens())


def streamed(name, pieces, ids=None):
    s = parser(name).stream()
    r, c = [], []
    for i, piece in enumerate(pieces):
        dr, dc = s.feed(piece, ids[i] if ids else ())
        r.append(dr or "")
        c.append(dc or "")
    fr, fc = s.finish()
    r.append(fr or "")
    c.append(fc or "")
    return "".join(r) or None, "".join(c) or None


def every_split(text):
    """The text cut into one-character deltas, and cut at every single position."""
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


WHOLE = [
    # (parser, output, reasoning, content)
    ("deepseek_r1", "<think>I think.</think>The answer.", "I think.", "The answer."),
    ("deepseek_r1", "I think.</think>The answer.", "I think.", "The answer."),
    ("deepseek_r1", "still thinking <th", "still thinking <th", None),  # no end tag: all reasoning
    ("deepseek_r1", "</think>just the answer", None, "just the answer"),
    ("deepseek_r1", "a < b </think> c </think> d", "a < b ", " c </think> d"),
    ("qwen3", "<think>I think.</think>The answer.", "I think.", "The answer."),
    ("qwen3", "No tags at all.", None, "No tags at all."),
    ("qwen3", "I think.</think>The answer.", None, "I think.</think>The answer."),  # no start tag: all content
    ("qwen3", "<think>cut off", None, "<think>cut off"),  # no end tag, whole output: all content (vLLM)
    ("qwen3", "<think></think>answer", None, "answer"),
    ("granite", "Here is my thought process: 2+2 is 4. Here is my response: 4", " 2+2 is 4. ", " 4"),
    ("granite", "Here's my thought process:a Here's my response:b", "a ", "b"),
    ("granite", "Just an answer.", None, "Just an answer."),
    ("mistral", "[THINK]Plan it.[/THINK]Done.", "Plan it.", "Done."),
    ("mistral", "Straight answer.", None, "Straight answer."),
    ("mistral", "[THINK]cut short", "cut short", None),
    ("glm45", "<think>hmm</think>ok", "hmm", "ok"),
    ("glm45", "no tags", None, "no tags"),
    ("openai_gptoss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi",
     "Think.", "Hi"),
    ("openai_gptoss", "<|channel|>analysis<|message|>Look up.<|end|><|start|>assistant<|channel|>commentary "
                      "to=functions.f <|constrain|>json<|message|>{}<|call|>",
     "Look up.", "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"),
    ("openai_gptoss", "plain words", None, "plain words"),
]


@pytest.mark.parametrize("name,text,reasoning,content", WHOLE)
def test_whole_output(name, text, reasoning, content):
    assert parser(name).extract(text) == (reasoning, content)


STREAMED = [
    ("deepseek_r1", "<think>I think.</think>The answer.", "I think.", "The answer."),
    ("deepseek_r1", "I think.</think>The answer.", "I think.", "The answer."),
    ("deepseek_r1", "<thinking aloud", "<thinking aloud", None),
    ("deepseek_r1", "still thinking <th", "still thinking <th", None),
    ("qwen3", "<think>I think.</think>The answer.", "I think.", "The answer."),
    ("qwen3", "No tags at all. a<b", None, "No tags at all. a<b"),
    ("qwen3", "<think>cut off", "cut off", None),  # streamed: reasoning as it comes
    ("qwen3", "pre <think>r</think> post", "r", "pre  post"),
    ("granite", "Here is my thought process: 2+2 is 4. Here is my response: 4", " 2+2 is 4. ", " 4"),
    ("granite", "Here's my thought process:a Here's my response:b", "a ", "b"),
    ("mistral", "[THINK]Plan it.[/THINK]Done.", "Plan it.", "Done."),
    ("openai_gptoss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi",
     "Think.", "Hi"),
    ("openai_gptoss", "<|channel|>analysis<|message|>Look up.<|end|><|start|>assistant<|channel|>commentary "
                      "to=functions.f <|constrain|>json<|message|>{}<|call|>",
     "Look up.", "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"),
]


@pytest.mark.parametrize("name,text,reasoning,content", STREAMED)
def test_streamed_any_split(name, text, reasoning, content):
    for pieces in every_split(text):
        assert streamed(name, pieces) == (reasoning, content), pieces


def test_partial_tag_is_held_back_until_decided():
    s = parser("qwen3").stream()
    assert s.feed("<thi") == (None, None)  # could be <think>: nothing yet
    assert s.feed("nk>abc</") == ("abc", None)
    assert s.feed("thin") == (None, None)
    assert s.feed("k>x") == (None, "x")


def test_skipped_special_tag_is_found_by_token_id():
    class Tok:
        class _T:
            def __init__(self, content):
                self.content = content
        added_tokens_decoder = {7: _T("<think>"), 8: _T("</think>")}

    p = get_reasoning_parser("qwen3", Tok())
    assert (p.start_id, p.end_id) == (7, 8)
    s = p.stream()
    out = [s.feed("", [7]), s.feed("why", [5]), s.feed("", [8]), s.feed("so", [6])]
    assert out == [(None, None), ("why", None), (None, None), (None, "so")]


def test_known_names_and_unknown_name():
    assert {"deepseek_r1", "qwen3", "granite", "mistral", "glm45", "openai_gptoss"} <= set(reasoning_parser_names())
    with pytest.raises(ReasoningParserError, match="known: .*deepseek_r1.*qwen3"):
        get_reasoning_parser("nope", _NoAddedTokens())


PLUGIN = """
from vllite_core.plugins import hookimpl
from vllite_core.reasoning import ThinkTagParser

VLLITE_PLUGIN_API = (1, 1)


class Bracket(ThinkTagParser):
    start_tag, end_tag, initial_state = "[r]", "[/r]", "content_pre"


@hookimpl
def vllite_register_reasoning_parsers():
    return {"bracket": Bracket, "qwen3": Bracket}
"""


def test_a_plugin_adds_and_replaces_parsers(fresh_plugins):  # noqa: F811
    mod = unique("rparser")
    fresh_plugins("rparser-dist", {PLUGINS_GROUP: {"rparser": mod}}, {mod: PLUGIN})
    assert {"bracket", "deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    assert parser("bracket").extract("a[r]b[/r]c") == ("b", "ac")
    assert parser("qwen3").extract("a[r]b[/r]c") == ("b", "ac")  # the plugin's replaces the built-in
    assert parser("deepseek_r1").extract("x</think>y") == ("x", "y")


def test_gptoss_reasoning_then_openai_tool_parser_give_the_call():
    """The reasoning parser passes a harmony tool call on as content; the ``openai`` tool parser reads it."""
    from vllite_core.plugins.manager import get_plugin_manager
    from vllite_core.tool_parsers import load_tool_parsers

    text = ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima"}<|call|>')
    reasoning, content = parser("openai_gptoss").extract(text)
    parsed = load_tool_parsers(get_plugin_manager())["openai"]().parse(content, final=True)
    assert reasoning == "Need it." and parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Lima"}')]
