"""A tiny random Qwen2-Audio checkpoint (a 2-layer, 32-wide Whisper-shaped encoder over a 1 s window: 80 mels,
100 frames; a 2-layer Qwen2 decoder) with the SmolLM2 tokenizer plus the audio tokens, its
WhisperFeatureExtractor, and transformers' own Qwen2AudioProcessor built offline for reference inputs."""
from __future__ import annotations

import torch

AUDIO, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
CLIP = AUDIO_BOS + AUDIO + AUDIO_EOS  # how a prompt holds one clip (Qwen2-Audio's own prompts)
WINDOW_S = 1  # feature extractor chunk_length: 100 mel frames = 2 * max_source_positions


def _tokenizer():
    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [AUDIO, AUDIO_BOS, AUDIO_EOS]})
    return tok


def save_tiny_qwen2_audio(path, seed: int = 0):
    """Random weights (scaled so greedy choices are not near-ties), tokenizer, feature extractor; the HF model."""
    from tiny_models import TINY
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    tok = _tokenizer()
    eos = tok.eos_token_id
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=80,
                 max_source_positions=50 * WINDOW_S)
    text = {**TINY, "model_type": "qwen2", "vocab_size": len(tok), "bos_token_id": eos, "eos_token_id": eos}
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=tok.convert_tokens_to_ids(AUDIO),
                              tie_word_embeddings=False, architectures=["Qwen2AudioForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_positions.weight"):
                continue
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=80, chunk_length=WINDOW_S).save_pretrained(path)
    return model.eval()


def qwen2_audio_processor(path):
    from transformers import AutoTokenizer, Qwen2AudioProcessor, WhisperFeatureExtractor

    return Qwen2AudioProcessor(WhisperFeatureExtractor.from_pretrained(path), AutoTokenizer.from_pretrained(path))


@torch.inference_mode()
def hf_qwen2_audio_greedy(model, proc, text: str, clips, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, new tokens) of HF ``generate`` (greedy, EOS ignored) on Qwen2AudioProcessor's inputs;
    ``clips``: 16 kHz float arrays."""
    kwargs = {"audio": list(clips), "sampling_rate": 16000} if clips else {}
    inputs = proc(text=text, return_tensors="pt", **kwargs)
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()
