"""Idefics3 (SmolVLM) against Hugging Face on a tiny random checkpoint: the processor's prompt ids (tiles, row /
column tokens, the global view) and greedy tokens identical to ``generate`` in float32, for images cut into 2x2,
1x2 tiles, two images in one prompt and a text-only prompt in one batch; the encoder cache reused by a second
request sharing an image."""
from __future__ import annotations

import pytest
from tiny_bart import make_image
from tiny_idefics3 import IMAGE, ROW_COL, hf_idefics3_greedy, idefics3_processor, save_tiny_idefics3

from vllite_core import LLM, SamplingParams

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
REQUESTS = [(f"User:{IMAGE}What is in the picture?\nAssistant:", [make_image(60, 60, 0)]),
            (f"User:{IMAGE}Describe it.\nAssistant:", [make_image(80, 40, 1)]),
            (f"User: {IMAGE} and {IMAGE}: which is brighter?\nAssistant:", [make_image(50, 50, 2),
                                                                              make_image(30, 70, 3)]),
            ("A prompt without any picture", [])]
SECOND = (f"Look at this {IMAGE} closely.", [make_image(60, 60, 0)])  # the first request's pixels, other text


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-idefics3")
    hf = save_tiny_idefics3(path)
    proc = idefics3_processor(path)
    ref = [hf_idefics3_greedy(hf, proc, t, im, N) for t, im in REQUESTS + [SECOND]]
    assert proc.tokenizer.convert_tokens_to_ids(ROW_COL[7]) in ref[0][0]  # 60x60 -> 2x2 tiles (row 2, col 2)
    return str(path), ref


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
            for t, im in requests]


def test_idefics3_greedy_matches_hf(idefics3):
    path, ref = idefics3
    llm = LLM(path, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    for out, (ids, tokens) in zip(outs, ref):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
    # The first image under other text (no prefix hit): its 5 tiles come from the encoder cache.
    core = llm.llm_engine.core.engine_core
    stats, runner = core.scheduler.encoder_cache.stats, core.worker.runner.encoder_runner
    hits, encoded = stats.hits, runner.num_encoded
    out = llm.generate(_prompts([SECOND]), GREEDY)[0]
    assert out.prompt_token_ids == ref[-1][0] and list(out.outputs[0].token_ids) == ref[-1][1]
    assert (stats.hits - hits, runner.num_encoded - encoded) == (5, 0)
