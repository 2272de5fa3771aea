"""Bad requests get clear typed errors; the engine keeps serving the others."""
from __future__ import annotations

import pytest

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError, PromptTooLongError
from vllite_core.sampling_params import SamplingParamsError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=128)


def test_bad_requests_do_not_disturb_others(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("good", {"prompt_token_ids": list(range(100, 120))}, params)
    with pytest.raises(PromptTooLongError, match="max_model_len=128"):
        engine.add_request("long", {"prompt_token_ids": list(range(100, 300))}, params)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", "", params)
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("oov", {"prompt_token_ids": [10**9]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert list(done) == ["good"] and len(done["good"].outputs[0].token_ids) == 8


@pytest.mark.parametrize("bad", [0, -3])
def test_max_tokens_must_be_positive(bad):
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=bad)


def test_unknown_model_path():
    from model_registry.source import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        LLM(model="/no/such/model")


def test_removed_options_explain_themselves():
    with pytest.raises(SamplingParamsError, match="best_of"):
        SamplingParams(n=1, best_of=3)
    with pytest.raises(SamplingParamsError, match="global"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="recompute"):
        LLM(swap_space=4)


def test_stop_string_and_multibyte_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    text = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                    SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0].text
    assert "4" in text
    out = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                   SamplingParams(temperature=0.0, max_tokens=40, stop=["4"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "4"
    assert out.text == text[:text.index("4")]
    del params
