"""LLM.beam_search (vLLM's API) against transformers' beam search on the same tiny random Llama: with EOS
ignored every beam has the same length, so both rank by the summed logprobs and must return the same beams."""
from __future__ import annotations

import pytest
import torch
from tiny_models import TINY, save_tiny

from vllite_core import LLM, BeamSearchParams
from vllite_core.sampling_params import SamplingParamsError

PROMPTS = [[5, 77, 301, 12, 9, 480, 33], list(range(40, 70))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-beam")
    hf = save_tiny(path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]), seed=21)
    return str(path), hf


def test_beams_equal_transformers(tiny):
    path, hf = tiny
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    width, n = 3, 8
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=n, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, early_stopping=False, length_penalty=1.0,
                              output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        # HF's beam score is the summed logprob over the output length; vLLM's over the whole length
        want = (ref.sequences_scores * n).tolist()
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(want, abs=1e-4)
        assert all(len(s.logprobs) == n and s.tokens[:len(prompt)] == prompt for s in out.sequences)


def test_bad_params_name_the_field():
    with pytest.raises(SamplingParamsError) as e:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert e.value.param == "beam_width"
