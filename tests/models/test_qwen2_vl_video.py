"""Video input for Qwen2-VL and Qwen2.5-VL against Hugging Face on tiny random checkpoints: the frames' patches
(each frame through transformers' PIL image processor, consecutive frames paired on the temporal axis, the
video processor's layout) and greedy tokens identical to ``generate`` given the same ``pixel_values_videos``,
``video_grid_thw`` (and Qwen2.5-VL's ``second_per_grid_ts``); a prompt with an image and a video, an odd
frame count (the last frame repeated), and the limit per prompt."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_bart import make_image
from tiny_qwen2_vl import MERGE, image_processor, save_tiny_qwen_vl

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError

N = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def _frames(n, w, h, seed):
    return [make_image(w, h, seed + i) for i in range(n)]


def _video_pixels(proc, frames, tp=2):
    """The video processor's patch layout, built independently from per-frame pixels (numpy reference)."""
    out = [proc([f], return_tensors="np") for f in frames]
    grid = out[0]["image_grid_thw"][0]
    per = [o["pixel_values"].reshape(o["pixel_values"].shape[0], 3, tp, 14, 14)[:, :, 0] for o in out]
    per += [per[-1]] * (-len(per) % tp)
    t = len(per) // tp
    rows = np.stack([np.stack(per[g * tp:(g + 1) * tp], axis=2) for g in range(t)])  # [t, rows, C, tp, p, p]
    return torch.from_numpy(rows.reshape(t * per[0].shape[0], -1).copy()), [t, int(grid[1]), int(grid[2])]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "-video")
    return str(path), save_tiny_qwen_vl(path, request.param, seed=3), request.param


@torch.inference_mode()
def _hf_greedy(hf, ids, image, frames, kind):
    c = hf.config
    proc = image_processor(hf.name_or_path) if hf.name_or_path else None
    kwargs, counts = {}, {}
    if image is not None:
        px = proc([image], return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
        counts[c.image_token_id] = int(px["image_grid_thw"].prod()) // MERGE ** 2
    vpx, grid = _video_pixels(proc, frames)
    kwargs.update(pixel_values_videos=vpx, video_grid_thw=torch.tensor([grid]))
    if kind == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([2 / 2.0])
    counts[c.video_token_id] = grid[0] * grid[1] * grid[2] // MERGE ** 2
    full = [t for i in ids for t in ([i] * counts[i] if i in counts else [i])]
    x = torch.tensor([full])
    kinds = torch.zeros_like(x)
    kinds[x == c.image_token_id], kinds[x == c.video_token_id] = 1, 2
    # Greedy by hand: the prompt's forward computes the 3D positions and the model's own rope_deltas; each later
    # token sits at its index + rope_deltas (vLLM's rule; transformers' generate instead continues from the last
    # prompt position + 1, which differs once a video's time axis runs past the text after it).
    out = hf(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=kinds, use_cache=True, **kwargs)
    cache, delta, new = out.past_key_values, int(hf.model.rope_deltas), []
    for i in range(N):
        new.append(int(out.logits[0, -1].argmax()))
        pos = torch.full((3, 1, 1), len(full) + i + delta)
        out = hf(input_ids=torch.tensor([[new[-1]]]), past_key_values=cache, position_ids=pos, use_cache=True)
        cache = out.past_key_values
    return full, new


def test_video_greedy_matches_hf(qwen):
    path, hf, kind = qwen
    hf.name_or_path = path
    c = hf.config
    vs, ve = c.vision_start_token_id, c.vision_end_token_id
    frames = _frames(5, 56, 42, 10)  # 5 frames: the last one repeated to fill the third temporal patch
    image = make_image(40, 30, 0)
    ids_video = [11, 12, vs, c.video_token_id, ve, 13, 14, 15]
    ids_both = [11, vs, c.image_token_id, ve, 12, vs, c.video_token_id, ve, 13]
    llm = LLM(model=path, dtype="float32", num_kv_blocks=96, block_size=4, max_num_batched_tokens=24)
    prompts = [{"prompt_token_ids": ids_video, "multi_modal_data": {"video": frames}},
               {"prompt_token_ids": ids_both, "multi_modal_data": {"image": image, "video": np.stack(
                   [np.asarray(f) for f in frames[:4]])}}]
    outs = llm.generate(prompts, GREEDY)
    for out, ids, img, fr in zip(outs, (ids_video, ids_both), (None, image), (frames, frames[:4])):
        full, ref = _hf_greedy(hf, ids, img, fr, kind)
        assert out.prompt_token_ids == full
        assert out.outputs[0].token_ids == ref
    with pytest.raises(InvalidRequestError):  # one video placeholder, two videos
        llm.generate([{"prompt_token_ids": ids_video, "multi_modal_data": {"video": [frames, frames]}}], GREEDY)
