"""A tiny random Gemma 3 vision-language checkpoint (SigLIP tower 28 px / patch 7 -> 16 patches, pooled to 4
image tokens; a 2-layer Gemma 3 decoder, one sliding and one global layer) with the SmolLM2 tokenizer plus the
image tokens, and transformers' own Gemma3Processor (PIL image backend) built offline for reference inputs."""
from __future__ import annotations

import json

import torch

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 28, 7, 4
SPECIAL = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}


def gemma3_config(ids: dict[str, int], vocab: int, eos: int):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            query_pre_attn_scalar=16, rms_norm_eps=1e-6, bos_token_id=eos, eos_token_id=eos,
                            pad_token_id=0, tie_word_embeddings=False)
    return Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS_PER_IMAGE,
                        boi_token_index=ids[BOI], eoi_token_index=ids[EOI], image_token_index=ids[IMAGE],
                        tie_word_embeddings=False, architectures=["Gemma3ForConditionalGeneration"])


def _tokenizer():
    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [BOI, IMAGE, EOI]})
    return tok


def save_tiny_gemma3(path, seed: int = 0):
    """Random weights (scaled so greedy choices are not near-ties), tokenizer, SigLIP preprocessor config."""
    from transformers import Gemma3ForConditionalGeneration

    tok = _tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOI, IMAGE, EOI)}
    config = gemma3_config(ids, len(tok), tok.eos_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(-0.5, 0.5) if "language_model" in name or "soft_emb" in name else p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:  # scaled by sqrt(hidden) = 8: kept small, or it drowns the rest
                p.normal_(0.0, 0.03)
            elif "language_model" in name or "lm_head" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "do_pan_and_scan": False,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return model.eval()


def gemma3_processor(path):
    """transformers' Gemma3Processor (PIL image backend), its tokenizer given the image tokens' names."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=SPECIAL)
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(path), tokenizer=tok,
                           image_seq_length=TOKENS_PER_IMAGE)


@torch.inference_mode()
def hf_gemma3_greedy(model, processor, text: str, images, max_new_tokens: int) -> list[int]:
    """HF ``generate`` (greedy, EOS ignored) on the processor's inputs: the new tokens."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
