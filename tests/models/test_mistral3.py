"""Mistral 3 (Pixtral tower) against Hugging Face on a tiny random checkpoint: greedy tokens identical to
``generate`` in float32 and prompt ids equal to PixtralProcessor's rule ([IMG] rows with [IMG_BREAK] / [IMG_END];
its module needs torchvision, absent here, so the test writes the rule out), for images of different sizes and
aspect ratios, two images in one prompt and a text-only prompt in one batch; the encoder cache reused by a
second request sharing an image; ``vision_feature_layer`` as a list of one (a middle layer) against HF, several
refused."""
from __future__ import annotations

import json
import shutil

import pytest
from tiny_bart import make_image
from tiny_mistral3 import IMG, hf_mistral3_greedy, save_tiny_mistral3

from vllite_core import LLM, SamplingParams
from vllite_core.errors import ConfigError

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
REQUESTS = [(f"User:{IMG}What is in the picture?\nAssistant:", [make_image(60, 60, 0)]),
            (f"User:{IMG}Describe it.\nAssistant:", [make_image(80, 40, 1)]),
            (f"User: {IMG} and {IMG}: which is brighter?\nAssistant:", [make_image(30, 50, 2),
                                                                          make_image(20, 20, 3)]),
            ("A prompt without any picture", [])]
SECOND = (f"Look at this {IMG} closely.", [make_image(60, 60, 0)])  # the first request's pixels, other text


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral3")
    hf = save_tiny_mistral3(path)
    ref = [hf_mistral3_greedy(hf, path, t, im, N) for t, im in REQUESTS + [SECOND]]
    hf.config.vision_feature_layer = [1]  # a list of one, not the last layer: the tower's first block only
    ref.append(hf_mistral3_greedy(hf, path, *REQUESTS[0], N))
    return str(path), ref


def _with_feature_layer(src: str, dst, layers) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "vision_feature_layer": layers}))
    return str(dst)


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
            for t, im in requests]


def test_mistral3_greedy_matches_hf(mistral3):
    path, ref = mistral3
    llm = LLM(path, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    for out, (ids, tokens) in zip(outs, ref):
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens
    core = llm.llm_engine.core.engine_core
    stats, runner = core.scheduler.encoder_cache.stats, core.worker.runner.encoder_runner
    hits, encoded = stats.hits, runner.num_encoded
    out = llm.generate(_prompts([SECOND]), GREEDY)[0]
    assert out.prompt_token_ids == ref[len(REQUESTS)][0] and list(out.outputs[0].token_ids) == ref[len(REQUESTS)][1]
    assert (stats.hits - hits, runner.num_encoded - encoded) == (1, 0)


def test_mistral3_feature_layer_list(mistral3, tmp_path):
    """``vision_feature_layer: [1]`` (transformers takes a list of one) reads the first block's states, as HF does;
    several layers are a ConfigError: transformers' own projector is sized for one layer and fails on them."""
    path, ref = mistral3
    llm = LLM(_with_feature_layer(path, tmp_path / "one", [1]), dtype="float32", num_kv_blocks=64)
    out = llm.generate(_prompts([REQUESTS[0]]), GREEDY)[0]
    assert (out.prompt_token_ids, list(out.outputs[0].token_ids)) == ref[-1]
    assert ref[-1][1] != ref[0][1]  # the layer matters
    with pytest.raises(ConfigError, match="vision_feature_layer"):
        LLM(_with_feature_layer(path, tmp_path / "two", [1, 2]), dtype="float32", num_kv_blocks=64)
