"""Gemma 3 with images (SigLIP tower, avg-pooling projector, Gemma 3 decoder with one sliding and one global
layer) against Hugging Face on a tiny random checkpoint: greedy tokens identical to ``generate`` (fp32, inputs
from transformers' own Gemma3Processor, pan-and-scan off) for a batch of one-image, two-image and text-only
prompts, with the image tokens attending to each other both ways (the sliding window of 8 is shorter than the
prompts, so the window applies inside the non-causal spans too); a step budget that would cut an image never
does (the image waits for the next step); ``prompt_token_ids`` and ``LLM.chat`` with ``image_url`` parts
expanded as the processor does; the encoder cache reused across two requests sharing an image; a broken image
refused naming the part."""
from __future__ import annotations

import base64
import io

import pytest
from tiny_bart import make_image
from tiny_gemma3 import BOI, TOKENS_PER_IMAGE, gemma3_processor, hf_gemma3_greedy, save_tiny_gemma3

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
Q = f"USER: {BOI}What is in the picture? ASSISTANT:"
REQUESTS = [(Q, [make_image(40, 30, 0)]), (Q, [make_image(90, 64, 1)]),
            (f"USER: {BOI} and {BOI}: which is brighter? ASSISTANT:", [make_image(50, 30, 2), make_image(20, 60, 3)]),
            ("A prompt without any picture", []), (f"{BOI}Say it.", [make_image(28, 28, 4)])]
SHARED = make_image(64, 48, 20)
FIRST = (f"USER: {BOI}Describe it. ASSISTANT:", [SHARED])
SECOND = (f"Look at this {BOI} and tell me its colour.", [SHARED.copy()])  # same pixels, other text
CHAT_IMAGES = [make_image(60, 45, 5), make_image(30, 80, 6)]
CHAT_TEXT = "Compare them."


def _chat_text(tok) -> str:
    """The template rendered as vllite renders image parts: each image's placeholder, then the text, a line each."""
    content = "\n".join([BOI] * len(CHAT_IMAGES) + [CHAT_TEXT])
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, HF greedy outputs of REQUESTS + FIRST, SECOND, the chat; the processor's ids of REQUESTS and of
    the chat)."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    hf = save_tiny_gemma3(path)
    proc = gemma3_processor(path)
    chat = _chat_text(proc.tokenizer)
    ref = [hf_gemma3_greedy(hf, proc, t, im, N) for t, im in REQUESTS + [FIRST, SECOND, (chat, CHAT_IMAGES)]]
    ids = [proc(text=t, images=im or None, return_tensors="pt")["input_ids"][0].tolist()
           for t, im in REQUESTS + [(chat, CHAT_IMAGES)]]
    return str(path), ref, ids


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
            for t, im in requests]


def test_gemma3_greedy_matches_hf_mixed_batch(gemma3):
    path, ref, ids = gemma3
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4)
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [o.prompt_token_ids for o in outs] == ids[:len(REQUESTS)]  # expanded as the processor expands
    assert [o.outputs[0].token_ids for o in outs] == ref[:len(REQUESTS)]
    assert ref[0] != ref[1]  # the image matters


def test_gemma3_images_are_never_cut_across_steps(gemma3):
    """A 6-token step budget: every image's 4 tokens land in one step (a chunk stops before an image it would
    cut); 24 blocks of 4 tokens (12 per cache group: sliding and global layers) for five requests force a
    preemption. Tokens are still HF's."""
    path, ref, _ = gemma3
    llm = LLM(model=path, dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=6,
              long_prefill_token_threshold=0)
    core = llm.llm_engine.core.engine_core
    cuts, stops = [], []
    orig = core.worker.execute_model

    def spy(so):
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs + so.scheduled_cached_reqs}
        for rid, n in so.num_scheduled_tokens.items():
            hi = starts[rid] + n
            feats = core.scheduler.requests[rid].mm_features or []
            cuts.extend(f for f in feats if f.offset < hi < f.end)
            stops.extend(f for f in feats if f.offset == hi)
        return orig(so)

    core.worker.execute_model = spy
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref[:len(REQUESTS)]
    assert not cuts
    assert stops, "no chunk stopped before an image"
    assert core.scheduler.num_preemptions_total > 0


def test_gemma3_encoder_cache_reused_across_requests(gemma3):
    path, ref, _ = gemma3
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4)
    core = llm.llm_engine.core.engine_core
    stats, runner = core.scheduler.encoder_cache.stats, core.worker.runner.encoder_runner
    out = llm.generate(_prompts([FIRST]), GREEDY)[0]
    assert out.outputs[0].token_ids == ref[len(REQUESTS)]
    assert (stats.queries, stats.hits, runner.num_encoded) == (1, 0, 1)
    out = llm.generate(_prompts([SECOND]), GREEDY)[0]  # same image under other text: no prefix, a cache hit
    assert out.outputs[0].token_ids == ref[len(REQUESTS) + 1]
    assert (stats.queries, stats.hits, runner.num_encoded) == (2, 1, 1)
    again = llm.generate(_prompts([FIRST]), GREEDY)[0]  # the prefix cache holds the image's (bidirectional) K/V
    assert again.outputs[0].token_ids == ref[len(REQUESTS)] and again.num_cached_tokens > 0


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_gemma3_chat_and_prompt_token_ids(gemma3):
    path, ref, ids = gemma3
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    parts = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in CHAT_IMAGES]
    out = llm.chat([{"role": "user", "content": parts + [{"type": "text", "text": CHAT_TEXT}]}], GREEDY)[0]
    assert out.prompt_token_ids == ids[-1]
    assert out.outputs[0].token_ids == ref[-1]
    tok = llm.get_tokenizer()
    pids = tok.encode(REQUESTS[2][0])
    out = llm.generate({"prompt_token_ids": pids, "multi_modal_data": {"image": REQUESTS[2][1]}}, GREEDY)[0]
    assert out.prompt_token_ids == ids[2] and out.outputs[0].token_ids == ref[2]


def test_gemma3_broken_image_names_the_part(gemma3):
    path, _, _ = gemma3
    llm = LLM(model=path, dtype="float32", num_kv_blocks=32)
    url = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    bad = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(InvalidRequestError, match="cannot decode the image") as e:
        llm.chat([{"role": "user", "content": bad}], GREEDY)
    assert e.value.param == "messages.content.image_url"
    with pytest.raises(InvalidRequestError, match="1 image placeholder") as e:
        llm.generate({"prompt": Q, "multi_modal_data": {"image": [make_image(30, 30, 0)] * 2}}, GREEDY)
    assert e.value.param == "multi_modal_data"
    ok = llm.generate({"prompt": Q, "multi_modal_data": {"image": make_image(30, 30, 0)}}, GREEDY)[0]
    assert len(ok.outputs[0].token_ids) == N and TOKENS_PER_IMAGE == 4  # the engine still serves


def test_gemma3_causal_image_tokens_would_differ(gemma3, monkeypatch):
    """The non-causal spans are what makes the tokens HF's: with them off (image tokens causal) some output
    differs."""
    import model_registry.models.gemma3_mm as gemma3_mm

    path, ref, _ = gemma3
    monkeypatch.setattr(gemma3_mm, "token_spans", lambda *a: None)
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4)
    outs = llm.generate(_prompts(REQUESTS), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] != ref[:len(REQUESTS)]
