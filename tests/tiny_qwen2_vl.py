"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (the SmolLM2 tokenizer plus the vision tokens) and HF greedy
references built by hand: pixels and ``image_grid_thw`` from transformers' PIL image processor, each
``<|image_pad|>`` expanded to ``t*h*w / merge**2`` tokens, ``mm_token_type_ids`` marking them (the default
processor needs torchvision, which is not installed here)."""
from __future__ import annotations

import json

import torch
from tiny_models import TINY

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE = VISION_START + IMAGE_PAD + VISION_END
PATCH, MERGE = 14, 2
MAX_PIXELS = 28 * 28 * 12  # at most 12 merged tokens per image: small grids, several shapes


def qwen_vl_config(kind: str, ids: dict[str, int], eos: int):
    """``kind``: "qwen2_vl" or "qwen2_5_vl"; the vision width equals the text width (64)."""
    text = {**TINY, "vocab_size": max(ids.values()) + 1, "bos_token_id": eos, "eos_token_id": eos,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    common = dict(bos_token_id=eos, eos_token_id=eos, image_token_id=ids[IMAGE_PAD], video_token_id=ids[IMAGE_PAD] - 3,
                  vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=2, hidden_act="quick_gelu")
        return Qwen2VLConfig(text_config=text, vision_config=vision, architectures=["Qwen2VLForConditionalGeneration"],
                             **common)
    from transformers import Qwen2_5_VLConfig

    vision = dict(depth=3, hidden_size=64, out_hidden_size=64, intermediate_size=80, num_heads=4, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, hidden_act="silu", window_size=56,
                  fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,  # as the 3B model
                            architectures=["Qwen2_5_VLForConditionalGeneration"], **common)


def save_tiny_qwen_vl(path, kind: str = "qwen2_vl", seed: int = 0):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)}
    config = qwen_vl_config(kind, ids, tok.eos_token_id)
    cls = Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.uniform_(0.5, 1.5)
            elif "visual" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "temporal_patch_size": 2,
        "merge_size": MERGE, "min_pixels": 28 * 28, "max_pixels": MAX_PIXELS}))
    return model.eval()


def image_processor(path):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(path)


def hf_inputs(tok, proc, pad: int, text: str, images) -> tuple[list[int], dict]:
    """The prompt's ids with each ``pad`` expanded to its image's merged patches, and the pixel inputs."""
    ids = tok.encode(text)
    if not images:
        return ids, {}
    px = proc(images, return_tensors="pt")
    grids = px["image_grid_thw"]
    counts = iter((grids.prod(-1) // MERGE ** 2).tolist())
    ids = [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]
    return ids, dict(pixel_values=px["pixel_values"], image_grid_thw=grids)


@torch.inference_mode()
def hf_qwen_vl_greedy(model, tok, proc, text: str, images, max_new_tokens: int) -> list[int]:
    """HF ``generate`` (greedy, EOS ignored) on hand-built inputs: the new tokens."""
    pad = model.config.image_token_id
    ids, kwargs = hf_inputs(tok, proc, pad, text, images)
    input_ids = torch.tensor([ids])
    kwargs["mm_token_type_ids"] = (input_ids == pad).int()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()
