"""A tiny random InternVL checkpoint (transformers' native ``InternVLForConditionalGeneration``): a 28 px / patch 7
tower (16 patches + CLS, layer scale, q/k norms), pixel-shuffled by 0.5 to 4 image tokens per tile, images cut
into up to 4 tiles of 28 px plus a thumbnail, a 2-layer Qwen2 (or Qwen3) decoder, SmolLM2's tokenizer plus ``<img>``,
``</img>``, ``<IMG_CONTEXT>``; transformers' own InternVLProcessor (GotOCR2's PIL image backend) for reference
inputs."""
from __future__ import annotations

import json

import torch

START, END, CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
TOKENS_PER_TILE = 4


def _image_processor():
    from transformers import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=False, min_patches=1,
                                    max_patches=4, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def save_tiny_internvl(path, seed: int = 0, decoder: str = "qwen2"):
    """``decoder``: the text model, "qwen2" (InternVL3) or "qwen3" (InternVL3.5, with q/k norms per head)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration, Qwen2Config, Qwen3Config
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [START, END, CONTEXT, VIDEO]})
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=28, patch_size=7, attention_bias=True, use_qk_norm=True,
                                  layer_scale_init_value=1.0)
    text_config = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[decoder]
    text = text_config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    config = InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5,
                            image_token_id=tok.convert_tokens_to_ids(CONTEXT), image_seq_length=TOKENS_PER_TILE,
                            architectures=["InternVLForConditionalGeneration"])
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "lambda" in name) and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    cfg_file = path / "tokenizer_config.json"  # the named image tokens InternVLProcessor reads off the tokenizer
    cfg = json.loads(cfg_file.read_text())
    cfg.update(start_image_token=START, end_image_token=END, context_image_token=CONTEXT, video_token=VIDEO)
    cfg_file.write_text(json.dumps(cfg))
    _image_processor().save_pretrained(path)
    return model.eval()


def internvl_processor(path):
    """transformers' InternVLProcessor without its video processor (whose mapping needs torchvision, absent here;
    the class check is skipped for that one slot, which image prompts never use)."""
    from transformers import AutoTokenizer, InternVLProcessor

    class ImageOnlyInternVLProcessor(InternVLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyInternVLProcessor(image_processor=_image_processor(), tokenizer=AutoTokenizer.from_pretrained(path),
                             image_seq_length=TOKENS_PER_TILE)


@torch.inference_mode()
def hf_internvl_greedy(model, processor, text: str, images, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(the processor's prompt ids, HF ``generate``'s new tokens: greedy, EOS ignored)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()
