"""A tiny random Mistral 3 checkpoint: a Pixtral tower (patch 7, 2D rotary, any image size up to a 56 px longest
edge), patches merged 2x2, a 2-layer Mistral decoder, SmolLM2's tokenizer plus [IMG] / [IMG_BREAK] / [IMG_END];
transformers' own PixtralProcessor (PIL backend) for reference inputs."""
from __future__ import annotations

import torch

IMG, BREAK, END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"


def _image_processor():
    from transformers import PixtralImageProcessorPil

    return PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14},
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3)


def save_tiny_mistral3(path, seed: int = 0):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": [IMG, BREAK, END]})
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=56, patch_size=7, hidden_act="silu")
    text = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, sliding_window=None)
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                            image_token_id=tok.convert_tokens_to_ids(IMG),
                            architectures=["Mistral3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).to(torch.float32)
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


def reference_inputs(path, text: str, images) -> dict:
    """What transformers' PixtralProcessor gives (its module needs torchvision, absent here, so its documented
    rule is written out on the text): pixels and sizes from the PIL image processor, each [IMG] replaced by
    ([IMG] per merged-patch column + [IMG_BREAK]) per row, the last break [IMG_END], then tokenized."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not images:
        return dict(tok(text, return_tensors="pt"))
    pix = _image_processor()(images, return_tensors="pt")
    parts = text.split(IMG)
    expanded = parts[0]
    for (h, w), rest in zip(pix["image_sizes"].tolist(), parts[1:]):
        expanded += ((IMG * (w // 14) + BREAK) * (h // 14))[: -len(BREAK)] + END + rest
    return {**tok(expanded, return_tensors="pt"), "pixel_values": pix["pixel_values"],
            "image_sizes": pix["image_sizes"]}


@torch.inference_mode()
def hf_mistral3_greedy(model, path, text: str, images, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(the reference prompt ids, HF ``generate``'s new tokens: greedy, EOS ignored)."""
    inputs = reference_inputs(path, text, images)
    out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()
