"""Qwen2-Audio (Whisper-shaped audio encoder + projector + the built-in Qwen2 decoder) against Hugging Face on a
tiny random checkpoint: greedy tokens identical to ``generate`` in float32 on transformers' own
Qwen2AudioProcessor inputs (prompt ids equal to the processor's) for a batch of one-clip, two-clip and text-only
prompts, a clip given at 8 kHz (resampled), a step budget that cuts a clip's placeholders; the encoder cache
reused by a second request with the same clip; ``LLM.chat`` with ``input_audio`` and ``audio_url`` parts;
limit_mm_per_prompt counting clips; bad audio refused naming the field."""
from __future__ import annotations

import base64

import pytest
from tiny_qwen2_audio import CLIP, hf_qwen2_audio_greedy, qwen2_audio_processor, save_tiny_qwen2_audio
from tiny_whisper import tone, wav_bytes

from vllite_core import LLM, SamplingParams
from vllite_core.audio import resample
from vllite_core.errors import InvalidRequestError

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
Q = "User: " + CLIP + " What is this sound? Assistant:"
A, B = tone(0.6, 440.0), tone(0.35, 900.0, chirp_to=300.0)
SLOW = tone(0.5, 250.0, sr=8000)  # resampled to 16 kHz by the model's prompt processor


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-audio")
    hf = save_tiny_qwen2_audio(path)
    proc = qwen2_audio_processor(path)
    return str(path), hf, proc


@pytest.fixture(scope="module")
def llm(qa):
    return LLM(model=qa[0], dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
               long_prefill_token_threshold=0)


MIXED = [(Q, [A]), (Q, [B]), ("Two: " + CLIP + " and " + CLIP + " Same? Assistant:", [B, A]),
         ("No audio at all here", [])]


def _prompt(text, clips, rates=None):
    if not clips:
        return text
    items = [(c, r) for c, r in zip(clips, rates or [16000] * len(clips))]
    return {"prompt": text, "multi_modal_data": {"audio": items if len(items) > 1 else items[0]}}


def test_greedy_matches_hf_mixed_batch_under_a_small_step_budget(qa, llm):
    """16-token steps cut clips' placeholders (8 to 15 rows, after text) across steps."""
    _, hf, proc = qa
    refs = [hf_qwen2_audio_greedy(hf, proc, t, c, N) for t, c in MIXED]
    outs = llm.generate([_prompt(t, c) for t, c in MIXED], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [r[0] for r in refs]
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the audio matters
    # A clip at 8 kHz: resampled to the feature extractor's 16 kHz, then what HF gives on those samples.
    ref = hf_qwen2_audio_greedy(hf, proc, Q, [resample(SLOW, 8000, 16000)], N)
    out = llm.generate([_prompt(Q, [SLOW], [8000])], GREEDY)[0]
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == ref


def test_encoder_cache_reused_for_the_same_clip(qa, llm):
    _, hf, proc = qa
    runner = llm.llm_engine.core.engine_core.worker.runner.encoder_runner
    clip = tone(0.45, 610.0)
    first = llm.generate([_prompt(Q, [clip])], GREEDY)[0]
    encoded = runner.num_encoded
    other = "Listen: " + CLIP + " Describe it. Assistant:"
    second = llm.generate([_prompt(other, [clip.copy()])], GREEDY)[0]
    assert runner.num_encoded == encoded  # the second request's rows came from the encoder cache
    assert first.outputs[0].token_ids == hf_qwen2_audio_greedy(hf, proc, Q, [clip], N)[1]
    assert second.outputs[0].token_ids == hf_qwen2_audio_greedy(hf, proc, other, [clip], N)[1]


def chat_ref(qa, text: str, clips) -> tuple[list[int], list[int]]:
    """HF reference for a chat: each audio part on its own line before the text, as vllite flattens content."""
    _, hf, proc = qa
    content = "\n".join([CLIP] * len(clips) + [text])
    prompt = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    return hf_qwen2_audio_greedy(hf, proc, prompt, clips, N)


def audio_msg(text: str, parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def input_audio(samples, sr: int = 16000) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(samples, sr)).decode(),
                                                   "format": "wav"}}


def test_llm_chat_audio_parts_match_hf(qa, llm):
    url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(B, 16000)).decode()
    convs = [audio_msg("What is this?", [input_audio(A)]),
             audio_msg("Compare.", [input_audio(A), {"type": "audio_url", "audio_url": {"url": url}}])]
    outs = llm.chat(convs, GREEDY)
    # WAV holds 16-bit samples: the reference gets what the server decodes.
    q = [(c * 32767).astype("int16").astype("float32") / 32768 for c in (A, B)]
    refs = [chat_ref(qa, "What is this?", [q[0]]), chat_ref(qa, "Compare.", [q[0], q[1]])]
    assert [o.prompt_token_ids for o in outs] == [r[0] for r in refs]
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]


@pytest.mark.parametrize("prompt, param, message", [
    (_prompt(Q, [A], [7]), "multi_modal_data", "cannot be resampled"),
    ({"prompt": Q, "multi_modal_data": {"audio": (A[:100], 16000)}}, "multi_modal_data", "too short"),
    ({"prompt": Q, "multi_modal_data": {"audio": (A.reshape(2, -1), 16000)}}, "multi_modal_data", "1-D"),
    ({"prompt": Q, "multi_modal_data": {"image": A}}, "multi_modal_data", "not supported"),
    (_prompt(Q, [A, B]), "multi_modal_data", "placeholder"),
])
def test_bad_audio_is_a_typed_error(llm, prompt, param, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        llm.generate([prompt], GREEDY)
    assert e.value.param == param
    assert llm.generate([_prompt(Q, [A])], GREEDY)[0].outputs[0].token_ids  # the engine still serves


def test_limit_mm_per_prompt_counts_clips(qa):
    llm = LLM(model=qa[0], dtype="float32", num_kv_blocks=16, limit_mm_per_prompt={"audio": 1})
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt") as e:
        llm.generate([_prompt(MIXED[2][0], [A, B])], GREEDY)
    assert e.value.param == "multi_modal_data"
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt") as e:
        llm.chat(audio_msg("Compare.", [input_audio(A), input_audio(B)]), GREEDY)
    assert e.value.param == "messages.content"
