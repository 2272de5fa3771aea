"""Qwen2-VL / Qwen2.5-VL vision encoder: preprocessing and encoder time per image, vllite's tower against HF's
``model.visual`` on the same random weights and the same patches (taking turns, best of ``--repeats``), and the
largest difference between their outputs.

The vision tower has the real width (Qwen2-VL: 1280 wide, 16 heads, MLP x4; Qwen2.5-VL: 1280 wide, SwiGLU 3420,
window 112 px, full attention every 4th block) but ``--depth`` blocks (default 4) so a shared CPU host can run
it; the decoder is tiny (it is not timed). Images are ``--size`` px square (448: 32x32 patches, 256 tokens).

    python benchmarks/qwen2_vl_encoder.py [--arch qwen2_vl|qwen2_5_vl] [--depth 4] [--size 448] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build(path: Path, arch: str, depth: int):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    from model_registry.source import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None))
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    text = dict(vocab_size=max(ids) + 1, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
    common = dict(image_token_id=ids[1], video_token_id=ids[1] - 3, vision_start_token_id=ids[0],
                  vision_end_token_id=ids[2], text_config=text)
    if arch == "qwen2_vl":
        vision = dict(depth=depth, embed_dim=1280, hidden_size=256, num_heads=16, mlp_ratio=4)
        config = Qwen2VLConfig(vision_config=vision, architectures=["Qwen2VLForConditionalGeneration"], **common)
        cls = Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=depth, hidden_size=1280, out_hidden_size=256, intermediate_size=3420, num_heads=16,
                      window_size=112, fullatt_block_indexes=list(range(3, depth, 4)))
        config = Qwen2_5_VLConfig(vision_config=vision, architectures=["Qwen2_5_VLForConditionalGeneration"],
                                  **common)
        cls = Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 1024 * 28 * 28}))
    return model


def picture(seed: int, size: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def best(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=["qwen2_vl", "qwen2_5_vl"], default="qwen2_vl")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from vllite_core import LLM

    with tempfile.TemporaryDirectory() as tmp:
        hf = build(Path(tmp), a.arch, a.depth)
        llm = LLM(model=tmp, dtype="float32", num_kv_blocks=256, num_threads=a.threads)
        engine = llm.llm_engine
        prompts = [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?",
                    "multi_modal_data": {"image": picture(i, a.size)}} for i in range(8)]
        t0 = time.perf_counter()
        processed = [engine.process_prompt(p) for p in prompts]
        prep = (time.perf_counter() - t0) / len(prompts)
        model = engine.core.engine_core.worker.runner.model
        data = [processed[0].mm_features[0].data]
        pixels, grid = data[0]["pixel_values"], torch.tensor([data[0]["image_grid_thw"]])
        with torch.inference_mode():
            ours = model.embed_multimodal(data)[0]
            theirs = hf.model.visual(pixels, grid_thw=grid).pooler_output
            t_ours, t_hf = [], []
            for _ in range(a.repeats):  # taking turns
                t_ours.append(best(lambda: model.embed_multimodal(data), 1))
                t_hf.append(best(lambda: hf.model.visual(pixels, grid_thw=grid), 1))
        print(json.dumps({
            "arch": a.arch, "vision_depth": a.depth, "image_px": a.size,
            "patches": int(pixels.shape[0]), "image_tokens": processed[0].mm_features[0].length,
            "preprocess_ms_per_image": round(prep * 1000, 2),
            "encoder_ms_vllite": round(min(t_ours) * 1000, 1), "encoder_ms_hf": round(min(t_hf) * 1000, 1),
            "hf_over_vllite": round(min(t_hf) / min(t_ours), 3),
            "max_abs_diff": float((ours - theirs).abs().max()),
        }, indent=1))


if __name__ == "__main__":
    main()
