"""Multimodal cost: image preprocessing and vision-encoder time per image, and the encoder cache on a workload
that repeats images.

A random-weight Llava (CLIP ViT-B/16 at 224 px: 12 layers, hidden 768, 196 image tokens; a small Llama
decoder) is built in a temp folder. ``--requests`` requests share ``--distinct`` images (each shown
``requests / distinct`` times, in a shuffled order, different questions so the prefix cache cannot skip the
image), greedy, ``--output-len`` tokens each.

    python benchmarks/multimodal.py [--requests 32] [--distinct 8] [--output-len 16]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build(path: Path) -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=16)
    text = LlamaConfig(vocab_size=image_id + 1, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                         vision_feature_select_strategy="default", vision_feature_layer=-2,
                         architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))


def picture(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(200, 640)), int(rng.integers(200, 480))
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--distinct", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=16)
    a = ap.parse_args()
    from vllite_core import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        llm = LLM(model=tmp, dtype="float32", max_model_len=1024, num_kv_blocks=2048, num_threads=2)
        engine = llm.llm_engine
        images = [picture(i) for i in range(a.distinct)]
        order = [i % a.distinct for i in range(a.requests)]
        random.Random(0).shuffle(order)
        prompts = [{"prompt": f"USER: <image>\nQuestion {k}: what is shown? ASSISTANT:",
                    "multi_modal_data": {"image": images[i]}} for k, i in enumerate(order)]
        t0 = time.perf_counter()
        processed = [engine.process_prompt(p) for p in prompts]
        prep = (time.perf_counter() - t0) / len(prompts)
        model = engine.core.engine_core.worker.runner.model
        pixels = [processed[0].mm_features[0].data]
        model.embed_multimodal(pixels)  # warm-up
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            model.embed_multimodal(pixels)
            runs.append(time.perf_counter() - t0)
        enc_one = min(runs)
        t0 = time.perf_counter()
        model.embed_multimodal(pixels * 8)
        enc_batch8 = (time.perf_counter() - t0) / 8
        sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(processed, sp)
        wall = time.perf_counter() - t0
        stats = engine.core.engine_core.scheduler.encoder_cache.stats
        runner = engine.core.engine_core.worker.runner.encoder_runner
        print(json.dumps({
            "image_tokens": processed[0].mm_features[0].length,
            "preprocess_ms_per_image": round(prep * 1000, 2),
            "encoder_ms_per_image": round(enc_one * 1000, 2),
            "encoder_ms_per_image_batch8": round(enc_batch8 * 1000, 2),
            "requests": a.requests, "distinct_images": a.distinct,
            "images_encoded": runner.num_encoded,
            "encoder_cache_queries": stats.queries, "encoder_cache_hits": stats.hits,
            "encoder_cache_hit_rate": round(stats.hit_rate, 3),
            "generate_s": round(wall, 2),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }, indent=1))


if __name__ == "__main__":
    main()
