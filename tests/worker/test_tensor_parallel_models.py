"""Tensor parallelism beyond the dense decoders, on the ``mp`` executor with two worker processes, against
references that are not the engine: a BERT encoder (all-MiniLM-L6-v2) against sentence-transformers, a
causal LM's last-token embeddings against transformers' final hidden states, Llava (vision tower whole on
each rank, language model sharded), Jamba (Mamba mixers split by channel, attention, MoE) and Mamba-2
(mixers split by heads, one B/C group shared by both ranks) against transformers' float32 greedy tokens.
Each engine starts once (module fixtures); ``vllite env`` shows each rank's heads and refuses what does not
divide.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny_bart import make_image
from tiny_llava import hf_llava_greedy, llava_processor, save_tiny_llava
from tiny_models import TINY, save_tiny
from tiny_pooling import minilm_path

from vllite_core import LLM, PoolingParams, SamplingParams

SENTENCES = ["Hello world.", "The quick brown fox jumps over the lazy dog.", "机器学习是人工智能的一个分支。",
             "a", "Paris is the capital of France.", "The end." * 30]
# One KV head (replicated on both ranks), an odd MLP width, a vocabulary that pads: every uneven split.
QWEN2 = dict(TINY, vocab_size=509, intermediate_size=97, num_attention_heads=4, num_key_value_heads=1)
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((5, 17, 40))]


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.core.shutdown()


def _local_rows(llm: LLM, path: str) -> list[int]:
    """Each rank's row count of the weight at ``path`` (dotted, from the runner's model)."""
    def rows(worker):
        obj = worker.runner.model
        for part in path.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        return int(obj.shape[0])

    return llm.collective_rpc(rows)


# ---- a BERT encoder ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm_tp2():
    llm = LLM(minilm_path(), dtype="float32", tensor_parallel_size=2)
    yield llm
    _shutdown(llm)


def test_bert_embeddings_over_two_ranks_match_sentence_transformers(minilm_tp2):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(minilm_path(), device="cpu").encode(SENTENCES, convert_to_tensor=True).float()
    mine = torch.tensor([o.outputs.embedding for o in minilm_tp2.embed(SENTENCES)])
    assert F.cosine_similarity(mine, ref).min() >= 0.9999
    assert (mine - ref).abs().max() <= 1e-5
    # Each rank holds 6 of the 12 heads (q, k and v of each: 3 x 6 x 32 rows) and half of the 1536-wide MLP.
    assert _local_rows(minilm_tp2, "layers.0.qkv.weight") == [576, 576]
    assert _local_rows(minilm_tp2, "layers.0.intermediate.weight") == [768, 768]


# ---- last-token pooling (a causal LM as an embedding model) ------------------------------------------

@pytest.fixture(scope="module")
def qwen2_embed_model(tmp_path_factory):
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2-embed-tp")
    return str(path), save_tiny(path, Qwen2Config(**QWEN2, architectures=["Qwen2ForCausalLM"]))


@pytest.fixture(scope="module")
def qwen2_embed_path(qwen2_embed_model):
    return qwen2_embed_model[0]


@pytest.fixture(scope="module")
def qwen2_embed(qwen2_embed_model):
    path, model = qwen2_embed_model
    with torch.no_grad():  # HF's final normed hidden state of each prompt's last token
        ref = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS])
    llm = LLM(path, runner="pooling", dtype="float32", tensor_parallel_size=2, num_kv_blocks=64,
              max_num_batched_tokens=16)  # the 40-token prompt pools after three chunks
    yield llm, ref
    _shutdown(llm)


def test_last_token_embeddings_over_two_ranks_match_transformers(qwen2_embed):
    llm, ref = qwen2_embed
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False))
    mine = torch.tensor([o.outputs.embedding for o in raw])
    assert F.cosine_similarity(mine, ref).min() >= 0.9999
    assert (mine - ref).abs().max() <= 1e-5
    assert _local_rows(llm, "model.layers.0.mlp.gate_up_proj.weight") == [2 * 49, 2 * 48]


# ---- a vision-language model ------------------------------------------------------------------------

Q = "USER: <image>\nWhat is in the picture? ASSISTANT:"
MIXED = [(Q, [make_image(40, 30, 0)]), (Q, [make_image(90, 64, 1)]),
         ("USER: <image> and <image>: which is brighter? ASSISTANT:", [make_image(50, 30, 2), make_image(20, 60, 3)]),
         ("A prompt without any picture", [])]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava-tp")
    return path, save_tiny_llava(path)


@pytest.fixture(scope="module")
def llava_tp2(llava):
    path, hf = llava
    ref = [hf_llava_greedy(hf, llava_processor(path), text, images, 6) for text, images in MIXED]
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    yield llm, ref
    _shutdown(llm)


def test_llava_over_two_ranks_matches_hf_greedy(llava_tp2):
    llm, ref = llava_tp2
    prompts = [{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}} if im else t
               for t, im in MIXED]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert ref[0] != ref[1]  # the image matters
    # The language model is sharded (2 of 4 heads, 1 of 2 KV heads per rank: 4 x 16 rows); the tower is whole.
    assert _local_rows(llm, "language_model.model.layers.0.self_attn.qkv_proj.weight") == [64, 64]
    assert _local_rows(llm, "vision_tower.layers.0.fc1.weight") == [48, 48]


@pytest.mark.parametrize("arch", ["nemotron_h", "granite_moe_hybrid", "falcon_h1", "zamba2", "lfm2"])
def test_hybrid_mixers_that_do_not_split_are_refused(arch):
    """A Mamba-2 mixer of 8 heads in 3 groups splits over neither 2 ranks (3 groups) nor does LFM2's attention over
    3 (2 KV heads): a ConfigError naming tensor_parallel_size, from the class's own check (what `vllite env` and the
    engine call before any worker starts)."""
    from test_state_space_models import _configs

    from model_registry.models import falcon_h1, granite_moe_hybrid, lfm2, nemotron_h, zamba2
    from vllite_core.errors import ConfigError

    cls = {"nemotron_h": nemotron_h.NemotronHForCausalLM, "falcon_h1": falcon_h1.FalconH1ForCausalLM,
           "granite_moe_hybrid": granite_moe_hybrid.GraniteMoeHybridForCausalLM, "zamba2": zamba2.Zamba2ForCausalLM,
           "lfm2": lfm2.Lfm2ForCausalLM}[arch]
    config = _configs()[arch]()
    cls.check_tensor_parallel(config, 2)  # the test configs split over two ranks
    if arch == "lfm2":
        with pytest.raises(ConfigError, match="tensor_parallel_size: 3 ranks is more than the model's 2 KV heads"):
            cls.check_tensor_parallel(config, 3)
        return
    setattr(config, cls.mamba2_fields[1], 3)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 ranks cannot split a Mamba-2 mixer of 8 heads "
                                          r"in 3 group\(s\)"):
        cls.check_tensor_parallel(config, 2)


# ---- the other VLMs: language model sharded like Llava's, encoder whole on every rank --------------------------

def _vlm(kind: str, path) -> tuple[list[tuple[str, list]], list[list[int]]]:
    """A tiny ``kind`` VLM saved at ``path`` (4 query heads over 2 KV heads in its language model): one-image and
    two-image requests in its own placeholder spelling, and transformers' float32 greedy tokens for them."""
    if kind == "gemma3":
        from tiny_gemma3 import BOI, gemma3_processor, hf_gemma3_greedy, save_tiny_gemma3
        hf, tag = save_tiny_gemma3(path), BOI
        proc = gemma3_processor(path)
        ref = lambda t, im: hf_gemma3_greedy(hf, proc, t, im, 6)  # noqa: E731
    elif kind == "idefics3":
        from tiny_idefics3 import IMAGE, hf_idefics3_greedy, idefics3_processor, save_tiny_idefics3
        hf, tag = save_tiny_idefics3(path), IMAGE
        proc = idefics3_processor(path)
        ref = lambda t, im: hf_idefics3_greedy(hf, proc, t, im, 6)[1]  # noqa: E731
    elif kind == "internvl":
        from tiny_internvl import CONTEXT, hf_internvl_greedy, internvl_processor, save_tiny_internvl
        hf, tag = save_tiny_internvl(path), CONTEXT
        proc = internvl_processor(path)
        ref = lambda t, im: hf_internvl_greedy(hf, proc, t, im, 6)[1]  # noqa: E731
    elif kind == "mistral3":
        from tiny_mistral3 import IMG, hf_mistral3_greedy, save_tiny_mistral3
        hf, tag = save_tiny_mistral3(path), IMG
        ref = lambda t, im: hf_mistral3_greedy(hf, path, t, im, 6)[1]  # noqa: E731
    else:  # qwen2_vl
        from tiny_qwen2_vl import IMAGE, hf_qwen_vl_greedy, image_processor, save_tiny_qwen_vl
        from transformers import AutoTokenizer
        hf, tag = save_tiny_qwen_vl(path, kind), IMAGE
        tok, proc = AutoTokenizer.from_pretrained(path), image_processor(path)
        ref = lambda t, im: hf_qwen_vl_greedy(hf, tok, proc, t, im, 6)  # noqa: E731
    requests = [(f"User: {tag}What is in the picture? Assistant:", [make_image(60, 60, 0)]),
                (f"User: {tag} and {tag}: which is brighter? Assistant:",
                 [make_image(50, 40, 2), make_image(30, 30, 3)])]
    return requests, [ref(t, im) for t, im in requests]


# Slow-marked (each engine start with its HF reference is 40-70 s on this host); Qwen2-Audio, whose encoder is
# sharded too, runs every time. Qwen2.5-VL is Qwen2-VL's class with another vision tower (whole on every rank).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "idefics3", "internvl", "mistral3", "qwen2_vl"])
def test_vlm_over_two_ranks_matches_hf_greedy(tmp_path, capsys, kind):
    """One engine start per VLM: TP=2 greedy tokens equal transformers' float32 ones; each rank holds half of the
    language model's query heads (2 of 4, 1 of 2 KV heads: 4 x 16 rows) and the whole encoder."""
    requests, ref = _vlm(kind, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}}
                             for t, im in requests], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert _local_rows(llm, "language_model.model.layers.0.self_attn.qkv_proj.weight") == [64, 64]
    finally:
        _shutdown(llm)
    rc, out, _ = _env(capsys, "-tp", "2", "--model", str(tmp_path))
    assert rc == 0 and "tensor-parallel rank 1: query heads 2-3 (2) of 4, KV heads 1-1 (1) of 2 (text_config" in out


def test_qwen2_audio_over_two_ranks_matches_hf_greedy(tmp_path, capsys):
    """Qwen2-Audio: the language model and the Whisper-shaped audio encoder both sharded by heads (2 of 4 each)."""
    from tiny_qwen2_audio import CLIP, hf_qwen2_audio_greedy, qwen2_audio_processor, save_tiny_qwen2_audio
    from tiny_whisper import tone

    hf = save_tiny_qwen2_audio(tmp_path)
    proc = qwen2_audio_processor(tmp_path)
    requests = [(f"User: {CLIP} What is this sound? Assistant:", [tone(0.6, 440.0)]),
                (f"Two: {CLIP} and {CLIP} Same? Assistant:", [tone(0.35, 900.0, chirp_to=300.0), tone(0.6, 440.0)])]
    ref = [hf_qwen2_audio_greedy(hf, proc, t, clips, 6)[1] for t, clips in requests]
    llm = LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        prompts = [{"prompt": t, "multi_modal_data": {"audio": [(c, 16000) for c in clips] if len(clips) > 1
                                                      else (clips[0], 16000)}} for t, clips in requests]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert _local_rows(llm, "audio_tower.layers.0.fc1.weight") == [32, 32]  # 64 wide
        assert _local_rows(llm, "language_model.model.layers.0.self_attn.qkv_proj.weight") == [64, 64]
    finally:
        _shutdown(llm)
    rc, out, _ = _env(capsys, "-tp", "2", "--model", str(tmp_path))
    assert rc == 0 and ("tensor-parallel rank 1: query heads 2-3 (2) of 4, KV heads 1-1 (1) of 2 (text_config; the "
                        "projector whole on every rank); audio encoder heads 2-3 (2) of 4") in out


# ---- a hybrid: Jamba (a Mamba mixer layer with a dense MLP, an attention layer with the MoE) ---------------

def _state_space_tp2(path, arch: str):
    """A tiny state-space model of test_state_space_models (``arch``) at ``path`` on two ranks, its prompts (the
    longer ones prefill in 24-token chunks) and transformers' float32 greedy tokens for them."""
    from hf_reference import hf_greedy_with
    from test_state_space_models import _configs

    hf = save_tiny(path, _configs()[arch]())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (2, 17, 40)]
    ref = [hf_greedy_with(hf, p, 10, lambda logits, *_: logits) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, max_model_len=256,
              max_num_batched_tokens=24, num_kv_blocks=64)
    return llm, prompts, ref


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def jamba_tp2(tmp_path_factory):
    llm, prompts, ref = _state_space_tp2(tmp_path_factory.mktemp("tiny-jamba-tp"), "jamba")
    yield llm, prompts, ref
    _shutdown(llm)


def test_jamba_over_two_ranks_matches_hf_greedy(jamba_tp2):
    llm, prompts, ref = jamba_tp2
    assert _greedy(llm, prompts) == ref
    # Each rank holds half of the mixer's 128 channels (and so half of each request's state) and 2 of 4 heads.
    assert _local_rows(llm, "model.layers.0.mamba.A_log") == [64, 64]
    assert _local_rows(llm, "model.layers.0.mamba.in_proj.weight") == [128, 128]
    assert _local_rows(llm, "model.layers.1.self_attn.qkv_proj.weight") == [64, 64]


# ---- Mamba-2: mixers split by whole heads --------------------------------------------------------------

def test_mamba2_over_two_ranks_matches_hf_greedy(tmp_path, capsys):
    """8 heads in 1 group: each rank 4 heads and the whole group's B and C; the gated norm spans both ranks (its
    squares summed over them); 24-token chunks of the longer prompts. ``vllite env`` shows the split."""
    llm, prompts, ref = _state_space_tp2(tmp_path, "mamba2")
    try:
        assert _greedy(llm, prompts) == ref
        # in_proj: gate 64 + x 64 + B 16 + C 16 + dt 4 rows of 128 + 128 + 16 + 16 + 8; conv: x 64 + B + C
        assert _local_rows(llm, "model.layers.0.mixer.in_proj.weight") == [164, 164]
        assert _local_rows(llm, "model.layers.0.mixer.conv1d.weight") == [96, 96]
        assert _local_rows(llm, "model.layers.0.mixer.A_log") == [4, 4]
    finally:
        _shutdown(llm)
    rc, out, _ = _env(capsys, "-tp", "2", "--model", str(tmp_path))
    assert rc == 0 and "tensor-parallel rank 1: SSM heads 4-7 (4) of 8, groups 0-0 of 1" in out
    rc, _, err = _env(capsys, "-tp", "3", "--model", str(tmp_path))
    assert rc == 1 and "tensor_parallel_size: 3 ranks cannot split a Mamba-2 mixer of 8 heads in 1 group(s)" in err


# ---- the Mamba-2 hybrids: attention by heads, mixers by whole heads, MLPs/experts by channels -------------

# Per hybrid: weight path -> each rank's rows. Every mixer has 8 heads of 16 in 1 group (so the gated norm spans
# both ranks; in_proj: gate 64 + x 64 + B 16 + C 16 + dt 4 rows), attention 4 heads over 2 KV heads (16 wide),
# MLPs 96 wide; `vllite env -tp 2` prints HYBRID_RANK_1 for rank 1.
HYBRID_SHARDS = {
    "nemotron_h": {"model.layers.0.mixer.A_log": [4, 4], "model.layers.0.mixer.in_proj.weight": [164, 164],
                   "model.layers.1.mixer.qkv_proj.weight": [64, 64]},
    "granite_moe_hybrid": {"model.layers.0.mamba.A_log": [4, 4], "model.layers.1.self_attn.qkv_proj.weight": [64, 64],
                           "model.layers.1.feed_forward.w13_weight.0": [96, 96],  # expert 0: gate + up, 48 each
                           "model.layers.1.feed_forward.shared_experts.gate_up_proj.weight": [96, 96]},
    # muP multipliers and the float32-weight gated norm follow the rank's rows
    "falcon_h1": {"model.layers.0.mamba.mup_vector": [164, 164], "model.layers.0.mamba.norm.weight": [64, 64],
                  "model.layers.1.self_attn.qkv_proj.weight": [64, 64],
                  "model.layers.1.feed_forward.gate_proj.weight": [48, 48]},
    # the shared block (4 heads of 32 over 4 KV heads) and its adapters' up projections (rank 8 -> this rank's rows)
    "zamba2": {"model.layers.0.mamba.A_log": [4, 4],
               "model.layers.1.shared_transformer.self_attn.qkv_proj.weight": [192, 192],
               "model.layers.1.shared_transformer.self_attn.linear_k_adapter_list.0.1.weight": [64, 64],
               "model.layers.1.shared_transformer.feed_forward.gate_up_proj.weight": [96, 96],
               "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.1.1.weight": [96, 96]},
    # the short conv by channels (B, C and x rows of in_proj, 32 each); the MLP is 256 wide
    "lfm2": {"model.layers.0.conv.in_proj.weight": [96, 96], "model.layers.0.conv.conv.weight": [32, 32],
             "model.layers.1.self_attn.qkv_proj.weight": [64, 64], "model.layers.1.feed_forward.w1.weight": [128, 128]},
}
SSM_RANK_1 = "SSM heads 4-7 (4) of 8, groups 0-0 of 1"
HYBRID_RANK_1 = {arch: f"query heads 2-3 (2) of 4, KV heads 1-1 (1) of 2; {SSM_RANK_1}" for arch in HYBRID_SHARDS}
HYBRID_RANK_1["zamba2"] = f"query heads 2-3 (2) of 4, KV heads 2-3 (2) of 4; {SSM_RANK_1}"
HYBRID_RANK_1["lfm2"] = "query heads 2-3 (2) of 4, KV heads 1-1 (1) of 2; conv channels 32-63 (32) of 64"


# NemotronH (Mamba-2 beside attention and an MLP) and LFM2 (the short conv) in every run; the others' engines are
# slow-marked (each start is 20-50 s on this host).
@pytest.mark.parametrize("arch", [a if a in ("nemotron_h", "lfm2") else pytest.param(a, marks=pytest.mark.slow)
                                  for a in HYBRID_SHARDS])
def test_hybrid_over_two_ranks_matches_hf_greedy(tmp_path, capsys, arch):
    """One engine start per hybrid: TP=2 greedy tokens equal transformers' float32 ones (24-token prefill chunks),
    each rank holds its share, and ``vllite env`` prints it."""
    llm, prompts, ref = _state_space_tp2(tmp_path, arch)
    try:
        assert _greedy(llm, prompts) == ref
        assert {path: _local_rows(llm, path) for path in HYBRID_SHARDS[arch]} == HYBRID_SHARDS[arch]
    finally:
        _shutdown(llm)
    rc, out, _ = _env(capsys, "-tp", "2", "--model", str(tmp_path))
    assert rc == 0 and f"tensor-parallel rank 1: {HYBRID_RANK_1[arch]}" in out


# ---- in one process: two ranks as two threads (no worker processes), for encoders ---------------------

class _ThreadComm:
    """A rank's collectives when the ranks are threads of this process: every rank puts its tensor in a shared
    slot, and each reads the slots in rank order once all have arrived."""

    def __init__(self, slots: list, barrier: threading.Barrier, rank: int) -> None:
        self.slots, self.barrier, self.rank, self.world_size, self.group = slots, barrier, rank, len(slots), None

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(sum(self._exchange(x)))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)


def _run_as_ranks(monkeypatch, world: int, build, run) -> list:
    """``build()`` once per rank (the layers read the rank when they are built), then ``run(model)`` on every rank
    at once, one thread each; each rank's result."""
    from vllite_core.distributed import parallel_state
    from vllite_core.distributed.parallel_state import TensorParallelState

    slots, barrier = [None] * world, threading.Barrier(world, timeout=60)
    models = []
    for rank in range(world):
        comm = _ThreadComm(slots, barrier, rank)
        monkeypatch.setattr(parallel_state, "_state", TensorParallelState(rank, world, communicator=comm))
        models.append(build())
    results: list = [None] * world
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, run(models[r]))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results), "a rank did not finish"
    return results


@pytest.mark.parametrize("kind", ["gte", "nomic", "modernbert"])
def test_encoders_sharded_over_two_ranks_match_transformers(monkeypatch, tmp_path, kind):
    """GTE, Nomic BERT and ModernBERT built as each of two ranks (half the heads and MLP each, loaded from the
    full checkpoint), run together: every rank's hidden states equal transformers'. ModernBERT's 8-token local
    window is crossed by the second prompt."""
    from safetensors.torch import load_file
    from tiny_pooling import save_modernbert, save_rope_bert
    from transformers import AutoConfig

    from model_registry.models.modernbert import ModernBertModel
    from model_registry.models.rope_bert import GteModel, NomicBertModel

    hf = save_modernbert(tmp_path, head=False) if kind == "modernbert" else save_rope_bert(tmp_path, kind)
    config = AutoConfig.from_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    cls = {"gte": GteModel, "nomic": NomicBertModel, "modernbert": ModernBertModel}[kind]
    prompts = [[101, 7592, 2088, 102], [101] + list(range(2000, 2030)) + [102]]

    def build():
        model = cls(config, None, torch.float32)
        model.load_weights(weights.items())
        return model

    def run(model):
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        md = SimpleNamespace(query_start_loc_cpu=[0, len(prompts[0]), len(ids)])
        qkv = model.layers[0].Wqkv if kind == "modernbert" else model.layers[0].qkv
        with torch.inference_mode():
            return model(ids, positions, [], [md]), qkv.weight.shape[0]

    ranks = _run_as_ranks(monkeypatch, 2, build, run)
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([p])).last_hidden_state[0] for p in prompts])
    for out, qkv_rows in ranks:
        assert qkv_rows == 3 * 2 * 8  # 2 of the 4 heads of 8, q, k and v
        assert (out - ref).abs().max() <= 1e-5


# ---- the layout, as `vllite env --model` prints it, and what it refuses -------------------------------

def _env(capsys, *argv: str) -> tuple[int, str, str]:
    from vllite_core.entrypoints.cli import main

    rc = main(["env", "--device", "cpu", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_env_shows_each_ranks_heads_and_stages(capsys, llava, qwen2_embed_path):
    rc, out, _ = _env(capsys, "-tp", "2", "-pp", "2", "--model", qwen2_embed_path)
    assert rc == 0
    assert "4 rank(s) (tensor_parallel_size 2 x pipeline_parallel_size 2)" in out
    assert "stage 0: ranks 0-1: layers 0-0 (1), the embedding" in out
    assert "stage 1: ranks 2-3: layers 1-1 (1), the final norm and the LM head" in out
    # One KV head over two ranks: each rank holds it (replicated) with its two query heads.
    assert "tensor-parallel rank 0: query heads 0-1 (2) of 4, KV heads 0-0 (1) of 1" in out
    assert "tensor-parallel rank 1: query heads 2-3 (2) of 4, KV heads 0-0 (1) of 1" in out
    rc, out, _ = _env(capsys, "--tensor-parallel-size", "2", "--model", str(llava[0]))
    assert rc == 0 and "tensor-parallel rank 1: query heads 2-3 (2) of 4, KV heads 1-1 (1) of 2 (text_config" in out
    rc, out, _ = _env(capsys, "-tp", "2", "--model", minilm_path())
    assert rc == 0 and "tensor-parallel rank 1: query heads 6-11 (6) of 12, KV heads 6-11 (6) of 12" in out


def save_untensored_config(path) -> None:
    """The config of a class that does not declare tensor parallelism, no weights (the refusal comes before any
    load): every built-in class declares it, so a plugin's, examples/custom_model's MyLlamaForCausalLM."""
    from transformers import LlamaConfig

    LlamaConfig(**TINY, architectures=["MyLlamaForCausalLM"]).save_pretrained(path)


def test_env_refuses_what_does_not_divide(capsys, llava, qwen2_embed_path, tmp_path):
    # Llava's language model: 4 query heads, 2 KV heads; 3 ranks can neither split nor replicate them.
    rc, _, err = _env(capsys, "-tp", "3", "--model", str(llava[0]))
    assert rc == 1 and "tensor_parallel_size: 3 ranks is more than the model's 2 KV heads" in err
    rc, _, err = _env(capsys, "-pp", "3", "--model", qwen2_embed_path)  # 2 layers, 3 stages
    assert rc == 1 and "pipeline_parallel_size: 3 stages for a model of 2 layer(s)" in err
    from test_state_space_models import _configs

    save_tiny(tmp_path / "lfm2", _configs()["lfm2"]())  # LFM2 builds every layer on every rank
    rc, _, err = _env(capsys, "-pp", "2", "--model", str(tmp_path / "lfm2"))
    assert rc == 1 and "pipeline_parallel_size: Lfm2ForCausalLM does not support pipeline" in err
    save_untensored_config(tmp_path)
    rc, _, err = _env(capsys, "-tp", "2", "--model", str(tmp_path))
    assert rc == 1 and "tensor_parallel_size: MyLlamaForCausalLM does not support tensor parallelism" in err


def test_mamba2_mixer_with_a_group_per_rank_matches_transformers(monkeypatch):
    """Mamba-2's other split: 2 groups over 2 ranks, each rank 4 heads and its own group's B and C (the gated norm
    stays within a rank). Both ranks' mixer outputs equal transformers' Mamba2Mixer on a 20-token prompt."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    from model_registry.layers.mamba import Mamba2Mixer
    from model_registry.layers.params import load_parameter
    from model_registry.models.mamba2 import mamba2_dims

    config = Mamba2Config(vocab_size=512, hidden_size=64, num_hidden_layers=1, state_size=16, conv_kernel=4, expand=2,
                          num_heads=8, head_dim=16, n_groups=2, chunk_size=8)
    torch.manual_seed(0)
    hf = HFMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(20, 64)
    with torch.no_grad():
        ref = hf(x[None])[0]
    weights = hf.state_dict()

    def build():
        mixer = Mamba2Mixer(mamba2_dims(config), torch.float32)
        for name, p in mixer.named_parameters():
            load_parameter(p, weights[name], None, name)
        return mixer

    def run(mixer):
        states = [torch.zeros(1, *shape) for shape in mixer.state_shapes]
        with torch.no_grad():
            return mixer.mix(x, states, SimpleNamespace(query_start_loc_cpu=[0, 20]))

    outs = _run_as_ranks(monkeypatch, 2, build, run)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
