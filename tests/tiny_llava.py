"""A tiny random Llava checkpoint (CLIP vision tower 28 px / patch 14, a 2-layer Llama) with the SmolLM2 tokenizer
plus an ``<image>`` token, and transformers' own LlavaProcessor for reference inputs."""
from __future__ import annotations

import json

import torch
from tiny_models import TINY

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 28, 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # "default" strategy drops the CLS token


def llava_config(image_token_index: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(**{**TINY, "vocab_size": image_token_index + 1})
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_index,
                       vision_feature_select_strategy="default", vision_feature_layer=-2,
                       projector_hidden_act="gelu", architectures=["LlavaForConditionalGeneration"])


def save_tiny_llava(path, seed: int = 0):
    """Random weights (scaled so greedy choices are not near-ties), tokenizer, CLIP preprocessor config."""
    from transformers import LlavaForConditionalGeneration

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    config = llava_config(image_id)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layer_norm1.weight", "layer_norm2.weight", "layrnorm.weight")):
                p.uniform_(0.5, 1.5)
            elif "language_model" in name or "lm_head" in name:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return model.eval()


def llava_processor(path):
    """transformers' LlavaProcessor (PIL image backend): the reference's placeholder expansion and pixels."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

    return LlavaProcessor(image_processor=CLIPImageProcessorPil.from_pretrained(path),
                          tokenizer=AutoTokenizer.from_pretrained(path), patch_size=PATCH,
                          vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                          num_additional_image_tokens=1)


@torch.inference_mode()
def hf_llava_greedy(model, processor, text: str, images, max_new_tokens: int) -> list[int]:
    """HF ``generate`` (greedy, EOS ignored) on the processor's inputs: the new tokens."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
