"""A tiny random-weight Whisper checkpoint with a real (small) Whisper tokenizer and feature extractor,
built offline: a byte-level BPE trained on a few sentences, then Whisper's special tokens in Whisper's
order (<|endoftext|>, <|startoftranscript|>, the languages, tasks, <|notimestamps|>, timestamps)."""
from __future__ import annotations

import json

import numpy as np
import torch

_TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny whisper test",
         "speech recognition with a small vocabulary", "one two three four five six seven eight nine ten"]


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(_TEXT * 10, trainer)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split())
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    tok = WhisperTokenizer(vocab=bpe.get_vocab(), merges=merges)  # adds <|endoftext|> (eos = bos = unk)
    specials = (["<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                   "<|notimestamps|>"])
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_tokens([AddedToken("<|%.2f|>" % (i * 0.02), special=False, normalized=False) for i in range(1501)])
    return tok


def save_tiny_whisper(path, seed: int = 0, **overrides):
    """Save config + safetensors + tokenizer + preprocessor_config.json into ``path``; return the HF model."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tok = build_tokenizer()
    eot, sot = tok.convert_tokens_to_ids(["<|endoftext|>", "<|startoftranscript|>"])
    cfg = dict(vocab_size=len(tok), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
               max_source_positions=1500, max_target_positions=32, pad_token_id=eot, bos_token_id=eot,
               eos_token_id=eot, decoder_start_token_id=sot, begin_suppress_tokens=None, suppress_tokens=None,
               architectures=["WhisperForConditionalGeneration"])
    cfg.update(overrides)
    config = WhisperConfig(**cfg)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("encoder.embed_positions.weight"):
                continue  # sinusoids, as in real checkpoints
            if "layer_norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)  # large enough that greedy choices are not near-ties
    model.save_pretrained(path)
    tok.save_pretrained(path)
    chunk = 2 * config.max_source_positions * 160 // 16000
    WhisperFeatureExtractor(feature_size=config.num_mel_bins, chunk_length=chunk).save_pretrained(path)
    return model


def tone(seconds: float, freq: float = 440.0, sr: int = 16000, chirp_to: float | None = None) -> np.ndarray:
    """A sine tone (or a linear chirp from ``freq`` to ``chirp_to``) with a little deterministic noise."""
    t = np.arange(int(seconds * sr)) / sr
    if chirp_to is None:
        phase = 2 * np.pi * freq * t
    else:
        phase = 2 * np.pi * (freq * t + (chirp_to - freq) * t * t / (2 * seconds))
    noise = np.random.default_rng(int(freq)).normal(0, 0.01, t.size)
    return (0.5 * np.sin(phase) + noise).astype(np.float32)


def wav_bytes(samples: np.ndarray, sr: int, channels: int = 1) -> bytes:
    """16-bit PCM WAV (the same samples on each channel)."""
    import io
    import wave

    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    if channels > 1:
        pcm = np.repeat(pcm[:, None], channels, axis=1).reshape(-1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()
