"""InternVL (transformers' native class) against Hugging Face on a tiny random checkpoint: prompt ids equal to
transformers' InternVLProcessor (tiles picked by aspect ratio plus a thumbnail, ``<img>`` + context tokens +
``</img>``) and greedy tokens identical to ``generate`` in float32, for images cut into 2x2 and 2x1 tiles, one
left whole, two images in one prompt and a text-only prompt in one batch, also with a step budget smaller than
an image (each tile its own item, encoded as steps reach it); ``LLM.chat`` with ``image_url`` parts; the encoder
cache reused by a second request sharing an image, the prefix cache by a repeated prompt; a Qwen3 decoder
(InternVL3.5's); a list ``vision_feature_layer`` refused."""
from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
from tiny_bart import make_image
from tiny_internvl import CONTEXT, hf_internvl_greedy, internvl_processor, save_tiny_internvl

from vllite_core import LLM, SamplingParams
from vllite_core.errors import ConfigError

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
REQUESTS = [(f"User: {CONTEXT}\nWhat is in the picture?\nAssistant:", [make_image(60, 60, 0)]),
            (f"User: {CONTEXT}\nDescribe it.\nAssistant:", [make_image(80, 40, 1)]),
            (f"User: {CONTEXT} and {CONTEXT}: which is brighter?\nAssistant:", [make_image(50, 50, 2),
                                                                                  make_image(20, 20, 3)]),
            ("A prompt without any picture", [])]
SECOND = (f"Look at this {CONTEXT} closely.", [make_image(60, 60, 0)])  # the first request's pixels, other text
CHAT_IMAGES = [make_image(40, 80, 4), make_image(30, 30, 5)]
CHAT_TEXT = "Compare them."
BUDGET = 10  # tokens per step: 2 tiles' rows, half the largest image (5 tiles x 4 rows)


def _chat_text(tok) -> str:
    """The template rendered as vllite renders image parts: each image's placeholder, then the text, a line each."""
    content = "\n".join([CONTEXT] * len(CHAT_IMAGES) + [CHAT_TEXT])
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """(folder, (processor ids, HF greedy tokens) for REQUESTS, SECOND and the chat)."""
    path = tmp_path_factory.mktemp("tiny-internvl")
    hf = save_tiny_internvl(path)
    proc = internvl_processor(path)
    ref = [hf_internvl_greedy(hf, proc, t, im, N)
           for t, im in REQUESTS + [SECOND, (_chat_text(proc.tokenizer), CHAT_IMAGES)]]
    context = proc.tokenizer.convert_tokens_to_ids(CONTEXT)
    assert [ids.count(context) for ids, _ in ref[:3]] == [20, 12, 24]  # 2x2 + thumbnail, 2x1 + thumbnail, 5 + 1
    return str(path), ref


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
            for t, im in requests]


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_internvl_greedy_chat_and_encoder_cache_match_hf(internvl):
    path, ref = internvl
    llm = LLM(path, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in outs] == ref[:len(REQUESTS)]
    assert ref[0][1] != ref[3][1]  # the image matters
    # The first image under other text (no prefix hit): its encoder output comes from the cache.
    core = llm.llm_engine.core.engine_core
    stats, runner = core.scheduler.encoder_cache.stats, core.worker.runner.encoder_runner
    hits, encoded = stats.hits, runner.num_encoded
    out = llm.generate(_prompts([SECOND]), GREEDY)[0]
    assert (out.prompt_token_ids, list(out.outputs[0].token_ids)) == ref[len(REQUESTS)]
    assert (stats.hits - hits, runner.num_encoded - encoded) == (5, 0)  # its 5 tiles
    again = llm.generate(_prompts(REQUESTS[:1]), GREEDY)[0]  # a repeated prompt: a prefix hit into the image
    assert (again.prompt_token_ids, list(again.outputs[0].token_ids)) == ref[0] and again.num_cached_tokens > 0
    parts = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in CHAT_IMAGES]
    out = llm.chat([{"role": "user", "content": parts + [{"type": "text", "text": CHAT_TEXT}]}], GREEDY)[0]
    assert (out.prompt_token_ids, list(out.outputs[0].token_ids)) == ref[-1]


def test_internvl_images_larger_than_the_step_budget_match_hf(internvl):
    """A 10-token step budget, smaller than the 5-tile image's 20 rows: its tiles are encoded a step at a time
    and some step ends inside a tile's run (the rest of its rows from the encoder cache); tokens are still HF's."""
    path, ref = internvl
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=BUDGET,
              long_prefill_token_threshold=0)
    core = llm.llm_engine.core.engine_core
    cuts = []
    orig = core.worker.execute_model

    def spy(so):
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs + so.scheduled_cached_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            cuts.extend(f for f in core.scheduler.requests[rid].mm_features or []
                        if f.offset < starts[rid] + n < f.end)
        return orig(so)

    core.worker.execute_model = spy
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in outs] == ref[:len(REQUESTS)]
    assert cuts, "no step ended inside a tile"


def test_internvl_feature_layer_list_is_refused(internvl, tmp_path):
    path, _ = internvl
    dst = tmp_path / "layers"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "vision_feature_layer": [-1]}))
    with pytest.raises(ConfigError, match="vision_feature_layer"):
        LLM(str(dst), dtype="float32", num_kv_blocks=64)


def test_internvl_with_a_qwen3_decoder_matches_hf(tmp_path):
    """InternVL3.5's layout: the same tower and projector over a Qwen3 decoder (q/k norms per head)."""
    hf = save_tiny_internvl(tmp_path, decoder="qwen3")
    proc = internvl_processor(tmp_path)
    requests = REQUESTS[:1] + REQUESTS[2:3]
    ref = [hf_internvl_greedy(hf, proc, t, im, N) for t, im in requests]
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(_prompts(requests), GREEDY)
    assert [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in outs] == ref
