"""Tiny random BART and Florence-2 checkpoints (transformers configs, SmolLM2 tokenizer) and their
Hugging Face greedy references, for the vllite-plugin-bart tests."""
from __future__ import annotations

import json

import torch

# The SmolLM2 tokenizer: 49152 tokens, <|im_start|> = 1 (BOS), <|im_end|> = 2 (EOS), <|endoftext|> = 0.
VOCAB = 49152
BOS, EOS, PAD = 1, 2, 0

BART_TEXT = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=160,
                 bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=EOS,
                 forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def _randomize(model, seed: int, std: float = 0.1, vision_std: float = 0.5) -> None:
    """Random weights large enough that greedy choices are not near-ties and outputs depend on the
    image and the prompt; LayerNorm gains around 1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, vision_std if "vision_tower" in name else std)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0.0, 0.5)


def _save_tokenizer(path) -> None:
    from model_registry.source import load_tokenizer, resolve_model_source

    load_tokenizer(resolve_model_source(None)).save_pretrained(path)


def save_tiny_bart(path, seed: int = 0, std: float = 0.1, generation: dict | None = None, **overrides):
    """``generation``: generation-config fields saved with the model (e.g. ``forced_bos_token_id``).
    With random weights, an untied LM head (``tie_word_embeddings=False``) gives the most varied outputs;
    a tied head tends to repeat the token it was just fed."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(**{**BART_TEXT, **overrides}, architectures=["BartForConditionalGeneration"])
    model = BartForConditionalGeneration(config)
    _randomize(model, seed, std=std)
    model.generation_config.update(**(generation or {}))
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model.eval()


IMAGE_SIZE = 64  # the tiny vision tower: 64 px -> 16x16 (stride 4) -> 8x8 (stride 2) = 1 + 64 image tokens
IMAGE_TOKENS = 65
VISION = dict(depths=[1, 1], embed_dim=[16, 32], num_heads=[2, 4], num_groups=[2, 4], patch_size=[7, 3],
              patch_stride=[4, 2], patch_padding=[3, 1], patch_prenorm=[False, True], window_size=3,
              projection_dim=64, max_position_embeddings=16, max_temporal_embeddings=8, drop_path_rate=0.0)


def save_tiny_florence2(path, seed: int = 0):
    """Tiny Florence-2 with the SmolLM2 tokenizer plus an ``<image>`` token (id 49152, as Florence-2's own
    tokenizer has one), and Florence-2's image processor config at 64 px."""
    from transformers import AutoTokenizer, Florence2Config, Florence2ForConditionalGeneration

    _save_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens={"image_token": "<image>"})
    tok.save_pretrained(path)
    text = {**BART_TEXT, "vocab_size": len(tok)}
    # An untied LM head: with random weights a tied head keeps choosing the token it was just fed.
    config = Florence2Config(text_config=text, vision_config=dict(VISION), image_token_id=tok.image_token_id,
                             tie_word_embeddings=False, architectures=["Florence2ForConditionalGeneration"])
    model = Florence2ForConditionalGeneration(config)
    _randomize(model, seed)
    model.save_pretrained(path)
    # Florence-2's image processor config (CLIPImageProcessor: bicubic resize to a square, ImageNet mean/std).
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"height": IMAGE_SIZE,
        "width": IMAGE_SIZE}, "resample": 3, "do_center_crop": False, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225], "do_convert_rgb": True, "image_seq_length": IMAGE_TOKENS}))
    return model.eval()


def florence2_processor(path):
    """transformers' own Florence2Processor for the saved folder (the reference's prompt construction)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Florence2Processor

    return Florence2Processor(image_processor=AutoImageProcessor.from_pretrained(path),
                              tokenizer=AutoTokenizer.from_pretrained(path))


def make_image(width: int, height: int, seed: int):
    """A generated RGB picture: a gradient with a few coloured rectangles."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], -1)
    for _ in range(3):
        x0, y0 = rng.integers(0, width // 2), rng.integers(0, height // 2)
        img[y0:y0 + height // 3, x0:x0 + width // 3] = rng.integers(0, 256, 3)
    return Image.fromarray(img.astype(np.uint8))


@torch.inference_mode()
def hf_seq2seq_greedy(model, max_new_tokens: int, **inputs) -> list[int]:
    """Hugging Face ``generate`` (greedy, EOS ignored, no forced EOS): the generated tokens after the decoder
    start token (a forced BOS counts as generated, as in transformers)."""
    import copy

    gen = copy.deepcopy(model.generation_config)
    gen.update(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=None,
               forced_eos_token_id=None, min_length=0, no_repeat_ngram_size=0, pad_token_id=PAD)
    out = model.generate(**{k: v for k, v in inputs.items()}, generation_config=gen)
    return out[0, 1:].tolist()
