"""Incremental detokenization never splits a multi-byte character; stop strings truncate."""
from __future__ import annotations

import pytest

from vllite_core.engine.detokenizer import IncrementalDetokenizer
from vllite_core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from model_registry.source import load_tokenizer, resolve_model_source

    return load_tokenizer(resolve_model_source(None))


TEXT = "Grüße aus Köln! 世界你好 🙂🚀 naïve café — done."


def test_deltas_are_whole_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    pieces = [d.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    # Byte-level BPE splits the emoji over several tokens: some steps must have emitted nothing.
    assert any(p == "" for p in pieces)


def test_stop_string_truncates(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    for include, expected in ((False, "alpha beta"), (True, "alpha beta gamma")):
        d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[" gamma"], include_stop_str_in_output=include))
        hit = None
        for t in ids:
            d.add_tokens([t])
            hit = d.check_stop()
            if hit:
                break
        assert hit == " gamma" and d.output_text == expected


def test_streamed_deltas_never_show_a_stop_string(tokenizer):
    from vllite_core.engine.core import EngineCoreOutput
    from vllite_core.engine.output_processor import OutputProcessor

    ids = tokenizer.encode("Paris.\n\nThe end", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add("r", None, [1], SamplingParams(stop=["\n\n"]), ["r"])
    streamed = ""
    for t in ids:
        outs, to_stop = proc.process([EngineCoreOutput("r", [t])], delta=True)
        streamed += "".join(o.outputs[0].text for o in outs)
        if to_stop:
            break
    assert streamed == "Paris."


@pytest.mark.parametrize("skip_special", [True, False])
def test_rust_decoder_matches_transformers_decode(tokenizer, skip_special):
    """The default tokenizer decodes through its Rust tokenizer directly; the deltas (special tokens in the
    middle, skipped or not) are the ones transformers' ``decode`` gives."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    special = sorted(tokenizer.all_special_ids)[:2]
    ids = ids[:5] + special + ids[5:] + special[:1]
    params = SamplingParams(skip_special_tokens=skip_special)
    fast = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    slow = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    assert fast._rust is not None
    slow._rust = None
    assert [fast.add_tokens([t]) for t in ids] == [slow.add_tokens([t]) for t in ids]
    want = tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)
    assert fast.output_text == want
