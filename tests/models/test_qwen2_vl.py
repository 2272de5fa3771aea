"""Qwen2-VL and Qwen2.5-VL (vision transformer with dynamic resolution, M-RoPE decoder) against Hugging Face on
tiny random checkpoints: greedy tokens identical to ``generate`` (fp32; pixels and grids from transformers' PIL
image processor, placeholders expanded by hand as its processor would) for a batch of prompts with one and two
images of different sizes and a text-only one in the same steps; the same with a step budget that cuts image
placeholder ranges and a KV cache small enough to preempt (the position delta survives recompute); and a second
request with an earlier image, served from the prefix and encoder caches; ``LLM.chat`` with ``image_url`` parts
(each written as vision start, placeholder, vision end)."""
from __future__ import annotations

import base64
import io

import pytest
from tiny_bart import make_image
from tiny_qwen2_vl import IMAGE, hf_inputs, hf_qwen_vl_greedy, image_processor, save_tiny_qwen_vl

from vllite_core import LLM, SamplingParams

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
Q = f"USER: {IMAGE}What is in the picture? ASSISTANT:"
# Grids (after merging): 1x2, 2x3 (two windows in Qwen2.5-VL), 1x2 + 3x1, 2x2; one text-only prompt.
REQUESTS = [(Q, [make_image(40, 30, 0)]), (Q, [make_image(90, 60, 1)]),
            (f"USER: {IMAGE} and {IMAGE}: which is brighter? ASSISTANT:", [make_image(50, 30, 2),
                                                                            make_image(20, 70, 3)]),
            ("A prompt without any picture", []), (f"{IMAGE}Say it.", [make_image(56, 56, 4)])]
LATER = (f"Look: {IMAGE}Describe it.", [make_image(90, 60, 1)])  # REQUESTS[1]'s image, other text around it
MIDDLE = (f"USER: {IMAGE}Which colour is it? ASSISTANT:", [make_image(90, 60, 1)])  # ... other text after it
CHAT_IMAGES = [make_image(60, 45, 5), make_image(30, 80, 6)]


def _chat_text(tok, n_images: int, text: str) -> str:
    """The template rendered as vllite renders image parts: each image's tokens, then the text, one per line."""
    content = "\n".join([IMAGE] * n_images + [text])
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    """(checkpoint folder, its HF greedy outputs (REQUESTS, LATER, MIDDLE, the chat), REQUESTS' hand-expanded
    prompt ids, the image placeholder id)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_qwen_vl(path, request.param)
    tok, proc = AutoTokenizer.from_pretrained(path), image_processor(path)
    ref = [hf_qwen_vl_greedy(hf, tok, proc, text, images, N) for text, images in REQUESTS + [LATER, MIDDLE]]
    ids = [hf_inputs(tok, proc, hf.config.image_token_id, text, images)[0] for text, images in REQUESTS]
    chat = hf_qwen_vl_greedy(hf, tok, proc, _chat_text(tok, 2, "Compare them."), CHAT_IMAGES, N)
    return str(path), ref + [chat], ids, hf.config.image_token_id


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
            for t, im in requests]


def test_qwen_vl_greedy_matches_hf_mixed_batch(qwen):
    path, ref, ids, pad_id = qwen
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4)
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == ref[:len(REQUESTS)]
    assert ref[0] != ref[1]  # the image matters
    # The same prompt again: prefix blocks reused, the generated tokens' positions still carry the image's delta.
    core = llm.llm_engine.core.engine_core
    stats, runner = core.scheduler.encoder_cache.stats, core.worker.runner.encoder_runner
    encoded = runner.num_encoded
    again = llm.generate(_prompts([REQUESTS[1]]), GREEDY)[0]
    assert again.outputs[0].token_ids == ref[1] and again.num_cached_tokens > 0
    # Its image under other text: no prefix shared, the encoder output is found in the encoder cache.
    hits = stats.hits
    later = llm.generate(_prompts([LATER]), GREEDY)[0]
    assert later.outputs[0].token_ids == ref[len(REQUESTS)] and later.num_cached_tokens == 0
    assert runner.num_encoded == encoded and stats.hits == hits + 1
    # Same text up to the image, other text after it: the prefix hit ends inside the image's placeholders, the
    # rest of them (and their 3D positions) are computed from the cached encoder output.
    middle = llm.generate(_prompts([MIDDLE]), GREEDY)[0]
    pad = [i for i, t in enumerate(middle.prompt_token_ids) if t == pad_id]
    assert pad[0] < middle.num_cached_tokens <= pad[-1]
    assert middle.outputs[0].token_ids == ref[len(REQUESTS) + 1]
    assert runner.num_encoded == encoded and stats.hits == hits + 2


def test_qwen_vl_chunks_split_images_and_preemption(qwen):
    """A 7-token step budget cuts image placeholder ranges across steps (seen by the runner's position
    builder), 14 blocks of 4 tokens for five requests force preemptions: tokens are still HF's."""
    path, ref, _, _ = qwen
    llm = LLM(model=path, dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=7,
              long_prefill_token_threshold=0)
    core = llm.llm_engine.core.engine_core
    runner = core.worker.runner
    mrope, features = runner.mrope, runner.encoder_runner.features
    cuts = []
    orig = mrope.step_positions

    def spy(req_ids, index, starts, num_sched):
        for rid, lo, n in zip(req_ids, starts, num_sched):
            end = int(index[lo + n - 1]) + 1
            cuts.extend(rid for f in features.get(rid, ()) if f.offset < end < f.end)
        return orig(req_ids, index, starts, num_sched)

    mrope.step_positions = spy
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref[:len(REQUESTS)]
    assert cuts, "no chunk ended inside an image's placeholders"
    assert core.scheduler.num_preemptions_total > 0


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_qwen_vl_chat_image_parts(qwen):
    path, ref, _, _ = qwen
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    parts = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in CHAT_IMAGES]
    out = llm.chat([{"role": "user", "content": parts + [{"type": "text", "text": "Compare them."}]}], GREEDY)[0]
    assert out.outputs[0].token_ids == ref[-1]
    assert out.prompt.count(IMAGE) == 2
