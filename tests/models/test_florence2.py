"""vllite-plugin-bart (plugins/bart): Florence-2 (DaViT vision tower + BART) through the out-of-tree plugin.

Greedy tokens identical to Hugging Face ``generate`` on the same tiny random checkpoint, for generated
images of several sizes and task prompts of different lengths in the same step; inputs for the reference
come from transformers' own Florence2Processor.
"""
from __future__ import annotations

import logging

import pytest
import torch
from tiny_bart import EOS, IMAGE_TOKENS, florence2_processor, hf_seq2seq_greedy, make_image, save_tiny_florence2

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError


@pytest.fixture(scope="module")
def florence(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-florence2")
    hf = save_tiny_florence2(path)
    return path, hf, florence2_processor(path)


@pytest.fixture(scope="module")
def florence_llm(florence):
    path, _, _ = florence
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64)


def test_florence2_greedy_matches_hf(florence, florence_llm):
    _, hf, processor = florence
    n = 8
    requests = [("<CAPTION>", make_image(80, 60, 0)), ("<OD>", make_image(64, 64, 1)),
                ("<CAPTION>", make_image(64, 64, 1)),
                ("<CAPTION_TO_PHRASE_GROUNDING>a red square on a blue field", make_image(33, 97, 2)),
                ("What colour is the top left corner?", make_image(120, 40, 3))]
    ref = []
    for text, image in requests:
        inputs = processor(text=text, images=image, return_tensors="pt")
        ref.append(hf_seq2seq_greedy(hf, n, input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]))
    # A prompt without an image: the encoder sees the text alone.
    text_only = processor(text="<OCR>", return_tensors="pt")["input_ids"]
    ref.append(hf_seq2seq_greedy(hf, n, input_ids=text_only))
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in requests] + [{"prompt": "<OCR>"}]
    outs = florence_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.prompt_token_ids == [EOS] for o in outs)
    assert len({tuple(r) for r in ref}) == len(ref)  # outputs depend on the image and on the prompt
    assert outs[0].prompt == "<CAPTION>"


def test_florence2_prompt_processing(florence):
    path, hf, processor = florence
    from vllite_plugin_bart.florence2 import Florence2ForConditionalGeneration as F2

    from vllite_core.inputs import InputContext

    ctx = InputContext(processor.tokenizer, hf.config, str(path))
    image = make_image(50, 70, 4)
    out = F2.process_prompt({"prompt": "<DETAILED_CAPTION>", "multi_modal_data": {"image": [image]}}, ctx)
    ref = processor(text="<DETAILED_CAPTION>", images=image, return_tensors="pt")
    pixels, ids = out.encoder_inputs
    assert ids == ref["input_ids"][0, IMAGE_TOKENS:].tolist()
    assert out.num_encoder_tokens == ref["input_ids"].shape[1]
    torch.testing.assert_close(pixels, ref["pixel_values"][0])
    with pytest.raises(InvalidRequestError, match="only content"):
        F2.process_prompt({"prompt": "<CAPTION> of a cat", "multi_modal_data": {"image": image}}, ctx)
    with pytest.raises(InvalidRequestError, match="one image"):
        F2.process_prompt({"prompt": "<CAPTION>", "multi_modal_data": {"image": [image, image]}}, ctx)
    with pytest.raises(InvalidRequestError, match="positions"):
        F2.process_prompt({"prompt": "word " * 100, "multi_modal_data": {"image": image}}, ctx)


def test_florence2_config_rules(florence, caplog):
    path, _, _ = florence
    with caplog.at_level(logging.WARNING, logger="vllite.config"):
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, enable_chunked_prefill=True,
                  enable_prefix_caching=True)
    config = llm.llm_engine.config
    assert not config.scheduler_config.enable_chunked_prefill and not config.cache_config.enable_prefix_caching
    assert "turned off" in caplog.text
