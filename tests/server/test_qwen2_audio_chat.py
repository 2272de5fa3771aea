"""Audio in chat through ``vllite serve``: an ``input_audio`` part sent by the real ``openai`` client gives Hugging
Face's greedy tokens on a tiny random Qwen2-Audio; bad audio and more clips than ``--limit-mm-per-prompt`` answer
400 naming the field, and the server keeps serving."""
from __future__ import annotations

import base64

import httpx
import openai
import pytest
from server_harness import ServerProcess
from tiny_qwen2_audio import CLIP, hf_qwen2_audio_greedy, qwen2_audio_processor, save_tiny_qwen2_audio
from tiny_whisper import tone, wav_bytes

pytestmark = pytest.mark.slow
N = 6
A = tone(0.6, 440.0)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def msg(text: str, parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-audio-chat")
    hf = save_tiny_qwen2_audio(path)
    return str(path), hf, qwen2_audio_processor(path)


@pytest.fixture(scope="module")
def server(qa):
    srv = ServerProcess(["--model", qa[0], "--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1",
                         "--limit-mm-per-prompt", '{"audio": 1}'])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_server_chat_input_audio_and_bad_audio(qa, server):
    _, hf, proc = qa
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    # HF reference: the template rendered with the clip's tokens on its own line before the text, on the
    # 16-bit samples the WAV holds.
    prompt = proc.tokenizer.apply_chat_template([{"role": "user", "content": CLIP + "\nWhat is this?"}],
                                                tokenize=False, add_generation_prompt=True)
    ids, ref = hf_qwen2_audio_greedy(hf, proc, prompt, [(A * 32767).astype("int16").astype("float32") / 32768], N)
    good = msg("What is this?", [part(b64(wav_bytes(A, 16000)))])
    resp = client.chat.completions.create(model=model, messages=good, max_tokens=N, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == proc.tokenizer.decode(ref)
    assert resp.usage.prompt_tokens == len(ids)

    clip = b64(wav_bytes(A, 16000))
    bad = [
        (msg("x", [part(clip, "mp3")]), "messages.content.input_audio.format", "not supported"),
        (msg("x", [part("@@@")]), "messages.content.input_audio.data", "base64"),
        (msg("x", [part(b64(b"RIFF-not-a-wav"))]), "messages.content.input_audio.data", "cannot decode"),
        (msg("x", [part(b64(wav_bytes(A[:400], 100)))]), "messages.content.input_audio.data", "cannot be resampled"),
        (msg("x", [part(clip), part(clip)]), "messages.content", "limit_mm_per_prompt"),
        (msg("x", [{"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:9/a.wav"}}]),
         "messages.content.audio_url", "allowed-media-domains"),
        (msg("x", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]),
         "messages.content.image_url", "does not take images"),
    ]
    for messages, param, text in bad:
        r = httpx.post(server + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and text in err["message"], (param, err)
    # The engine is alive: the same request again gives the same answer.
    again = client.chat.completions.create(model=model, messages=good, max_tokens=N, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == resp.choices[0].message.content
