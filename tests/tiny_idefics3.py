"""A tiny random Idefics3 (SmolVLM) checkpoint: a 28 px / patch 7 tower (16 patches, pixel-shuffled by 2 to 4 image
tokens per tile), images resized to a 56 px longest edge and cut into 28 px tiles plus a global view, a 2-layer
Llama decoder, SmolLM2's tokenizer plus the image tokens; transformers' own Idefics3Processor (PIL backend) for
reference inputs."""
from __future__ import annotations

import torch

IMAGE, FAKE, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"
ROW_COL = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
TOKENS_PER_TILE = 4


def _image_processor():
    from transformers import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 56},
                                     max_image_size={"longest_edge": 28}, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def save_tiny_idefics3(path, seed: int = 0):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE, FAKE, GLOBAL, *ROW_COL]})
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=28, patch_size=7)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids(IMAGE),
                            architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _image_processor().save_pretrained(path)
    return model.eval()


def idefics3_processor(path):
    from transformers import AutoTokenizer, Idefics3Processor

    return Idefics3Processor(image_processor=_image_processor(), tokenizer=AutoTokenizer.from_pretrained(path),
                             image_seq_len=TOKENS_PER_TILE)


@torch.inference_mode()
def hf_idefics3_greedy(model, processor, text: str, images, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(the processor's prompt ids, HF ``generate``'s new tokens: greedy, EOS ignored)."""
    inputs = processor(text=text, images=[images] if images else None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()
