"""Llava (CLIP vision tower + projector + the built-in Llama decoder) against Hugging Face on a tiny random
checkpoint: greedy tokens identical to ``generate`` (fp32, inputs from transformers' own LlavaProcessor) for
mixed batches of one-image, two-image and text-only prompts, with a step budget that splits the image
placeholders across steps, under preemption; image-aware prefix caching and the encoder cache (counters);
bad media refused with a typed error naming the field."""
from __future__ import annotations

import pytest
import torch
from tiny_bart import make_image
from tiny_llava import NUM_IMAGE_TOKENS, hf_llava_greedy, llava_processor, save_tiny_llava

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
Q = "USER: <image>\nWhat is in the picture? ASSISTANT:"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    hf = save_tiny_llava(path)
    return str(path), hf, llava_processor(path)


def _ref(llava, requests):
    _, hf, proc = llava
    return [hf_llava_greedy(hf, proc, text, images, N) for text, images in requests]


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
            for t, im in requests]


MIXED = [(Q, [make_image(40, 30, 0)]), (Q, [make_image(90, 64, 1)]),
         ("USER: <image> and <image>: which is brighter? ASSISTANT:", [make_image(50, 30, 2), make_image(20, 60, 3)]),
         ("A prompt without any picture", []), ("<image>", [make_image(28, 28, 4)])]


def test_llava_greedy_matches_hf_mixed_batch(llava):
    path, _, proc = llava
    ref = _ref(llava, MIXED)
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    outs = llm.generate(_prompts(MIXED), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image matters
    # Placeholders expanded as transformers' processor expands them.
    want = proc(text=MIXED[2][0], images=MIXED[2][1], return_tensors="pt")["input_ids"][0].tolist()
    assert outs[2].prompt_token_ids == want
    assert want.count(llm.llm_engine.model_info.hf_config.image_token_index) == 2 * NUM_IMAGE_TOKENS


def test_llava_chunk_budget_splits_placeholders_and_preemption(llava):
    """A 5-token step budget cuts every image's 4 placeholders across two steps; 10 blocks of 4 tokens for
    five requests force preemptions (recompute: images encoded again or found in the encoder cache)."""
    path, _, _ = llava
    ref = _ref(llava, MIXED)
    llm = LLM(model=path, dtype="float32", num_kv_blocks=10, block_size=4, max_num_batched_tokens=5,
              long_prefill_token_threshold=0)
    core = llm.llm_engine.core.engine_core
    splits = []
    orig = core.worker.execute_model

    def spy(so):
        for f in so.scheduled_encoder_inputs:
            splits.append(f.length)
        return orig(so)

    core.worker.execute_model = spy
    outs = llm.generate(_prompts(MIXED), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert core.scheduler.num_preemptions_total > 0
    assert splits  # the encoder ran in the engine's steps, within its budget of 5 rows
    assert core.scheduler.encoder_cache.budget == 5


def test_llava_same_text_different_images_never_share_blocks(llava):
    path, _, _ = llava
    reqs = [(Q, [make_image(40, 30, 10 + i)]) for i in range(3)]
    ref = _ref(llava, reqs)
    assert len({tuple(r) for r in ref}) == 3
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4)
    outs = llm.generate(_prompts(reqs), GREEDY)  # concurrently: equal token ids, no block shared
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert len({tuple(o.prompt_token_ids) for o in outs}) == 1
    outs = llm.generate(_prompts(reqs[::-1]), GREEDY)  # again: each finds only its own image's blocks
    assert [o.outputs[0].token_ids for o in outs] == ref[::-1]
    assert [o.num_cached_tokens for o in outs] == [(len(o.prompt_token_ids) - 1) // 4 * 4 for o in outs]


def test_llava_same_image_prefix_and_encoder_cache_hits(llava):
    path, _, _ = llava
    image = make_image(64, 48, 20)
    first = ("USER: <image>Describe it. ASSISTANT:", [image])
    second = ("USER: <image>What colour? ASSISTANT:", [image.copy()])  # another object, same pixels
    third = ("USER: <image>What colour? ASSISTANT:", [make_image(64, 48, 21)])
    ref = _ref(llava, [first, second, third])
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4)
    core = llm.llm_engine.core.engine_core
    stats = core.scheduler.encoder_cache.stats
    encoded = core.worker.runner.encoder_runner
    out = llm.generate(_prompts([first]), GREEDY)[0]
    assert out.outputs[0].token_ids == ref[0] and out.num_cached_tokens == 0
    assert (stats.queries, stats.hits, encoded.num_encoded) == (1, 0, 1)
    # Same image, text diverging right after it: the first block (3 text tokens + 1 placeholder) is a prefix hit,
    # the rest of the image's placeholders are recomputed from the cached encoder output.
    out = llm.generate(_prompts([second]), GREEDY)[0]
    assert out.outputs[0].token_ids == ref[1] and out.num_cached_tokens == 4
    assert (stats.queries, stats.hits, encoded.num_encoded) == (2, 1, 1)
    # Same text, another image: no block shared, the encoder runs.
    out = llm.generate(_prompts([third]), GREEDY)[0]
    assert out.outputs[0].token_ids == ref[2] and out.num_cached_tokens == 0
    assert (stats.queries, stats.hits, encoded.num_encoded) == (3, 1, 2)


def test_llava_encoder_cache_evicts_least_recently_used(llava):
    """A cache of 8 rows holds two images: a third evicts the least recently used, which is encoded again."""
    path, _, _ = llava
    imgs = [make_image(30, 30, 30 + i) for i in range(3)]
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, encoder_cache_size=8, enable_prefix_caching=False)
    core = llm.llm_engine.core.engine_core
    enc, runner = core.scheduler.encoder_cache, core.worker.runner.encoder_runner
    for i in (0, 1, 2, 1, 0):
        llm.generate(_prompts([(Q, [imgs[i]])]), GREEDY)
        assert set(enc.entries) == set(runner.cache)  # the runner mirrors the scheduler
        assert enc.used <= 8
    # 0, 1 encoded; 2 evicts 0; 1 hits; 0 is encoded again (evicting 2).
    assert runner.num_encoded == 4 and enc.stats.hits == 1 and enc.stats.evictions == 2


def test_llava_bad_inputs(llava, tiny_path):
    path, _, _ = llava
    llm = LLM(model=path, dtype="float32", num_kv_blocks=32, limit_mm_per_prompt={"image": 1},
              max_image_pixels=100 * 100)
    img = make_image(40, 30, 0)
    cases = [
        ({"prompt": "<image><image>", "multi_modal_data": {"image": [img, img]}}, "limit_mm_per_prompt"),
        ({"prompt": Q, "multi_modal_data": {"audio": img}}, "modality 'audio'"),
        ({"prompt": Q, "multi_modal_data": {"image": "not an image"}}, "PIL.Image"),
        ({"prompt": Q, "multi_modal_data": {"image": make_image(200, 100, 1)}}, "max_image_pixels"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": img}}, "0 image placeholder"),
        ({"prompt": Q}, "1 image placeholder"),
    ]
    for prompt, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg) as e:
            llm.generate(prompt, GREEDY)
        assert e.value.param == "multi_modal_data"
    ok = llm.generate({"prompt": Q, "multi_modal_data": {"image": img}}, GREEDY)[0]  # the engine still serves
    assert len(ok.outputs[0].token_ids) == N
    text_llm = LLM(model=tiny_path, dtype="float32", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="text-only") as e:
        text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": img}}, GREEDY)
    assert e.value.param == "multi_modal_data"


def test_llava_decoder_matches_hf_with_prompt_token_ids(llava):
    """prompt_token_ids with one unexpanded placeholder per image work like text."""
    path, _, proc = llava
    tok = proc.tokenizer
    ids = tok.encode(Q)
    img = make_image(33, 77, 5)
    ref = _ref(llava, [(Q, [img])])
    llm = LLM(model=path, dtype="float32", num_kv_blocks=32)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, GREEDY)[0]
    assert out.outputs[0].token_ids == ref[0]
    assert torch.is_tensor(llm.llm_engine.core.engine_core.worker.runner.model.vision_tower.patch_embedding)


def test_llava_encoder_budget_limits_each_step(llava):
    """An encoder budget of one image (4 rows) per step: three requests' images are encoded in three steps, a
    request's chunk stopping before an image that does not fit; outputs are still HF's."""
    path, _, _ = llava
    reqs = [(Q, [make_image(40, 30, 40 + i)]) for i in range(3)]
    ref = _ref(llava, reqs)
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, encoder_cache_size=NUM_IMAGE_TOKENS)
    core = llm.llm_engine.core.engine_core
    steps = []
    orig = core.worker.execute_model

    def spy(so):
        steps.append((sum(f.length for f in so.scheduled_encoder_inputs), dict(so.num_scheduled_tokens)))
        return orig(so)

    core.worker.execute_model = spy
    outs = llm.generate(_prompts(reqs), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [rows for rows, _ in steps[:3]] == [NUM_IMAGE_TOKENS] * 3
    first = steps[0][1]
    assert sorted(first.values()) == [3, 3, len(outs[0].prompt_token_ids)]  # two stop at their image (offset 3)


def test_llava_abort_releases_encoder_cache_references(llava):
    path, _, _ = llava
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=5,
              long_prefill_token_threshold=0)
    engine = llm.llm_engine
    enc = engine.core.engine_core.scheduler.encoder_cache
    engine.add_request("r", {"prompt": Q, "multi_modal_data": {"image": make_image(40, 30, 50)}}, GREEDY)
    engine.step()  # 5 tokens: 3 text + 2 of the image's 4 placeholders; the image is held
    assert enc.held == {"r": set(enc.entries)} and len(enc.entries) == 1
    engine.abort_request("r")
    assert enc.held == {} and all(not r for r in enc.refs.values())
    assert len(enc.entries) == 1  # kept (unreferenced) for a later request with the same image


def test_llava_parallel_sampling_shares_the_encoder_output(llava):
    path, _, _ = llava
    req = (Q, [make_image(52, 44, 60)])
    ref = _ref(llava, [req])[0]
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    out = llm.generate(_prompts([req]), SamplingParams(n=3, temperature=0.0, max_tokens=N, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    assert llm.llm_engine.core.engine_core.worker.runner.encoder_runner.num_encoded == 1
