"""Whisper on the engine's encoder-decoder path: a tiny random Whisper (built from a transformers config,
with a real small Whisper tokenizer and feature extractor) gives greedy tokens identical to Hugging Face's
WhisperForConditionalGeneration on the same weights and audio, with requests of different audio and prompt
lengths in the same steps; the config rules; LLM.transcribe; POST /v1/audio/transcriptions."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from tiny_whisper import save_tiny_whisper, tone, wav_bytes

from vllite_core import LLM, SamplingParams
from vllite_core.audio import AudioDecodeError, load_wav, resample

# One request's cross-attention blocks (the tiny model's 1500 encoder positions, blocks of 16): they come
# out of the same pool as the decoder's blocks.
CROSS_BLOCKS = -(-1500 // 16)

MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-whisper")
    hf = save_tiny_whisper(path)
    return str(path), hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], dtype="float32", num_kv_blocks=64 + 8 * CROSS_BLOCKS, max_num_seqs=8)


@pytest.fixture(scope="module")
def fe(tiny):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(tiny[0])


@torch.inference_mode()
def hf_whisper_greedy(hf, features: torch.Tensor, decoder_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with HF's own encoder, decoder and cache (EOS ignored, like ignore_eos)."""
    enc = hf.model.encoder(input_features=features).last_hidden_state
    out = hf(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([decoder_ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = hf(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([[tokens[-1]]]),
                 cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _ids(tok, *tokens: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(tokens))


def test_greedy_matches_hf_with_mixed_lengths_in_one_step(tiny, llm, fe):
    _, hf = tiny
    tok = llm.get_tokenizer()
    audios = [tone(1.0, 300), tone(3.5, 500, chirp_to=2000), tone(7.0, 800), tone(12.0, 200, chirp_to=900),
              tone(30.0, 1000)]
    prompts = [
        {"multi_modal_data": {"audio": audios[0]}},  # default: <|sot|><|en|><|transcribe|><|notimestamps|>
        {"multi_modal_data": {"audio": (audios[1], 16000)}, "language": "german", "timestamps": True},
        {"multi_modal_data": {"audio": (audios[2], 16000)}, "prompt": "hello world"},
        {"multi_modal_data": {"audio": (audios[3], 16000)}, "task": "translate", "language": "fr"},
        {"multi_modal_data": {"audio": (audios[4], 16000)},
         "prompt_token_ids": _ids(tok, "<|startoftranscript|>", "<|ja|>", "<|transcribe|>")},
    ]
    sot, en, de, fr, transcribe, translate, nots, prev = _ids(
        tok, "<|startoftranscript|>", "<|en|>", "<|de|>", "<|fr|>", "<|transcribe|>", "<|translate|>",
        "<|notimestamps|>", "<|startofprev|>")
    core = llm.llm_engine.core
    steps_before = core.stats().step_times.steps
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    # Every request was prefilled in the first step and decoded together after it.
    assert core.stats().step_times.steps - steps_before == MAX_NEW
    decoder_prompts = [o.prompt_token_ids for o in outs]
    assert decoder_prompts[0] == [sot, en, transcribe, nots]
    assert decoder_prompts[1] == [sot, de, transcribe]
    assert decoder_prompts[2][0] == prev and decoder_prompts[2][-4:] == [sot, en, transcribe, nots]
    assert decoder_prompts[3] == [sot, fr, translate, nots]
    assert len({len(p) for p in decoder_prompts}) >= 3
    for audio, out in zip(audios, outs):
        feats = fe(audio, sampling_rate=16000, return_tensors="pt").input_features
        assert out.outputs[0].token_ids == hf_whisper_greedy(hf, feats, out.prompt_token_ids, MAX_NEW)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # the audio matters


def test_matches_hf_generate(tiny, llm, fe):
    """The same against transformers' own Whisper generate() (default decoder prompt, greedy)."""
    _, hf = tiny
    audio = tone(5.0, 600, chirp_to=300)
    out, = llm.generate({"multi_modal_data": {"audio": audio}},
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    feats = fe(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        ref = hf.generate(input_features=feats, decoder_input_ids=torch.tensor([out.prompt_token_ids]),
                          max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    ref = ref[0].tolist()
    if ref[:len(out.prompt_token_ids)] == out.prompt_token_ids:
        ref = ref[len(out.prompt_token_ids):]
    assert out.outputs[0].token_ids == ref


def test_preemption_recomputes_encoder_and_decoder(tiny, llm):
    """Few KV blocks: requests are preempted and recomputed (the encoder runs again on readmission)
    and the tokens are those of an engine with room to spare."""
    prompts = [{"multi_modal_data": {"audio": tone(1.0 + 2 * i, 200 + 150 * i)}} for i in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    small = LLM(tiny[0], dtype="float32", num_kv_blocks=4 + 3 * CROSS_BLOCKS, max_num_seqs=3)
    outs = small.generate(prompts, sp)
    assert small.llm_engine.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_encoder_decoder_config_rules(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="vllite"):
        llm = LLM(tiny[0], dtype="float32", num_kv_blocks=32 + 2 * CROSS_BLOCKS, max_num_seqs=2,
                  enable_chunked_prefill=True, enable_prefix_caching=True)
    cfg = llm.llm_engine.config
    assert not cfg.scheduler_config.enable_chunked_prefill
    assert not cfg.cache_config.enable_prefix_caching
    assert cfg.model_config.capabilities.is_encoder_decoder
    assert "chunked prefill and prefix caching are turned off" in caplog.text
    assert llm.llm_engine.max_model_len == 32  # the decoder's max_target_positions, not the encoder's 1500


def test_bad_whisper_prompts_are_refused(llm):
    from vllite_core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="needs audio"):
        llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="at most 30 s"):
        llm.generate({"multi_modal_data": {"audio": tone(31.0)}})
    with pytest.raises(InvalidRequestError, match="language"):
        llm.generate({"multi_modal_data": {"audio": tone(1.0)}, "language": "klingon"})
    with pytest.raises(InvalidRequestError, match="one channel"):
        llm.generate({"multi_modal_data": {"audio": np.zeros((2, 16000), np.float32)}})


def test_transcribe(llm):
    tok = llm.get_tokenizer()
    short = tone(2.0, 440)
    long = tone(45.0, 300, chirp_to=700)
    stereo_44k = wav_bytes(tone(3.0, 700, sr=44100), 44100, channels=2)
    res = llm.transcribe([short, (long, 16000), stereo_44k])
    assert [len(r.windows) for r in res] == [1, 2, 1]  # 45 s: two 30 s windows
    assert [r.language for r in res] == ["en"] * 3
    assert res[1].duration == pytest.approx(45.0) and res[2].duration == pytest.approx(3.0)
    for r in res:
        texts = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True).strip() for o in r.windows]
        assert r.text == " ".join(t for t in texts if t)
        assert all(o.outputs[0].finish_reason in ("stop", "length") for o in r.windows)
    # The same as generate() on the same audio with the default prompt.
    ref, = llm.generate({"multi_modal_data": {"audio": short}}, SamplingParams(temperature=0.0, max_tokens=None))
    assert res[0].windows[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert res[0].text == ref.outputs[0].text.strip()
    # Each window of the long audio is the request for that slice.
    second, = llm.generate({"multi_modal_data": {"audio": long[30 * 16000:]}},
                           SamplingParams(temperature=0.0, max_tokens=None))
    assert res[1].windows[1].outputs[0].token_ids == second.outputs[0].token_ids
    # Language detection: one greedy token among the language tokens.
    auto, = llm.transcribe(short, language=None, sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    lang_id = tok.convert_tokens_to_ids(f"<|{auto.language}|>")
    assert auto.windows[0].prompt_token_ids[:2] == [tok.convert_tokens_to_ids("<|startoftranscript|>"), lang_id]


def test_wav_decoding_and_resampling():
    sr = 8000
    x = tone(0.5, 440, sr=sr)
    y, got_sr = load_wav(wav_bytes(x, sr, channels=2))
    assert got_sr == sr and y.dtype == np.float32 and np.abs(y - x).max() < 1e-3
    # 32-bit float WAV (which the wave module refuses) through the RIFF reader.
    import struct

    payload = x.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, sr, sr * 4, 4, 32)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(payload)) + payload
    y, _ = load_wav(b"RIFF" + struct.pack("<I", len(riff)) + riff)
    assert np.array_equal(y, x)
    with pytest.raises(AudioDecodeError, match="MP3"):
        load_wav(b"ID3\x03\x00" + b"\x00" * 64)
    # Resampling keeps a tone's frequency and the duration.
    up = resample(x, sr, 16000)
    assert len(up) == 16000 // 2
    spectrum = np.abs(np.fft.rfft(up))
    assert abs(np.argmax(spectrum) * 16000 / len(up) - 440) < 4


def test_transcription_endpoint(tiny, llm):
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.entrypoints.openai.api_server import build_app

    audio = tone(4.0, 520, sr=22050)
    wav = wav_bytes(audio, 22050, channels=2)
    expected, = llm.transcribe(wav)
    app = build_app(AsyncLLM(llm.llm_engine), ["tiny-whisper"])
    with TestClient(app) as client:
        r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav, "audio/wav")},
                        data={"model": "tiny-whisper", "language": "en"})
        assert r.status_code == 200, r.text
        assert r.json() == {"text": expected.text}
        r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav, "audio/wav")},
                        data={"response_format": "text"})
        assert r.status_code == 200 and r.text == expected.text
        r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav, "audio/wav")},
                        data={"response_format": "verbose_json"})
        assert r.json()["text"] == expected.text and len(r.json()["segments"]) == 1
        # The official client, through the same app.
        oai = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        got = oai.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", wav, "audio/wav"))
        assert got.text == expected.text
        # Refusals in OpenAI's error shape; the server keeps serving.
        bad = client.post("/v1/audio/transcriptions", files={"file": ("a.mp3", b"ID3\x03" + b"\0" * 32, "audio/mpeg")})
        assert bad.status_code == 400 and "MP3" in bad.json()["error"]["message"]
        assert client.post("/v1/audio/transcriptions", data={"model": "tiny-whisper"}).status_code == 400
        missing = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav, "audio/wav")},
                              data={"model": "nope"})
        assert missing.status_code == 404
        # Text endpoints refuse a speech model's text-only prompt with a 400, not a crash.
        r = client.post("/v1/completions", json={"model": "tiny-whisper", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400 and "audio" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200
