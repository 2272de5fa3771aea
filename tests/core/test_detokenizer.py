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


def _run_processor(tokenizer, params: SamplingParams, ids: list[int], delta: bool = False):
    """Each token as one step's core output (the last one finishing the request, as max_tokens would):
    the outputs of every step, and whether a stop string ended it early."""
    from vllite_core.engine.core import EngineCoreOutput
    from vllite_core.engine.output_processor import OutputProcessor

    proc = OutputProcessor(tokenizer)
    proc.add("r", None, [1], params, ["r"])
    steps = []
    for j, t in enumerate(ids):
        last = j == len(ids) - 1
        outs, to_stop = proc.process([EngineCoreOutput("r", [t], finish_reason="length" if last else None)],
                                     delta=delta)
        steps.append(outs)
        if to_stop:
            return steps, True
    return steps, False


@pytest.mark.parametrize("stop", [None, ["\n\n"]])
def test_output_kinds_final_only_and_delta(tokenizer, stop):
    """vLLM's output_kind: FINAL_ONLY builds one output, when the request finishes, equal to the cumulative
    one then; DELTA's pieces add up to it and never show a stop string."""
    from vllite_core.sampling_params import RequestOutputKind

    ids = tokenizer.encode("Paris is big.\n\nThe end of it", add_special_tokens=False)
    cumulative, stopped = _run_processor(tokenizer, SamplingParams(stop=stop), ids)
    assert stopped == (stop is not None) and all(len(outs) == 1 for outs in cumulative)
    final = cumulative[-1][0]
    assert final.finished and final.outputs[0].text == ("Paris is big." if stop else tokenizer.decode(ids))

    steps, _ = _run_processor(tokenizer, SamplingParams(stop=stop, output_kind=RequestOutputKind.FINAL_ONLY), ids)
    assert [len(outs) for outs in steps] == [0] * (len(steps) - 1) + [1]
    got = steps[-1][0]
    assert got.finished and got.outputs[0].text == final.outputs[0].text
    assert got.outputs[0].token_ids == final.outputs[0].token_ids
    assert got.outputs[0].finish_reason == final.outputs[0].finish_reason

    steps, _ = _run_processor(tokenizer, SamplingParams(stop=stop, output_kind=RequestOutputKind.DELTA), ids)
    pieces = [o.outputs[0] for outs in steps for o in outs]
    assert "".join(p.text for p in pieces) == final.outputs[0].text
    assert [t for p in pieces for t in p.token_ids] == final.outputs[0].token_ids


def test_output_kind_is_checked():
    from vllite_core.sampling_params import RequestOutputKind, SamplingParamsError

    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY  # its value, as an enum
    with pytest.raises(SamplingParamsError, match="output_kind"):
        SamplingParams(output_kind="everything")
