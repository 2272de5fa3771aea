"""Speculative decoding with a model of its own (draft_model): greedy output token-identical to the engine
without speculation (chunk budget 64, prefix caching with shared prompt prefixes, KV pressure with
preemptions), a draft that is the target itself has every draft accepted (its KV follows the accepted tokens
through chunks, prefix hits, rollback and recompute), acceptance counters equal a replay of the draft with
HF transformers, lossless sampling with the draft's real q (chi-square, the ngram tests' harness), and bad
drafts fail at start with a ConfigError."""
from __future__ import annotations

import numpy as np
import pytest
from test_spec_decode_engine import N_DRAWS, POSITIONS, TINY_V, _draws, tiny_vocab  # noqa: F401
from tiny_models import TINY, save_tiny

from vllite_core.entrypoints.llm import LLM
from vllite_core.errors import ConfigError
from vllite_core.sampling_params import SamplingParams

K = 3
MAX_TOKENS = 20
SHARED = list(range(10, 58))  # three full blocks every prompt shares: prefix-cache hits on the draft's pages too
PROMPTS = [SHARED + [100 + 7 * i + j for j in range(3 + 5 * i)] for i in range(6)] + \
    [[200 + j for j in range(n)] for n in (5, 70)]


def _llama(tmp_path_factory, name, seed, **over):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp(name)
    save_tiny(path, LlamaConfig(**{**TINY, **over}, architectures=["LlamaForCausalLM"]), seed=seed)
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = _llama(tmp_path_factory, "target", 1)
    draft = _llama(tmp_path_factory, "draft", 2, num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    return target, draft


def _greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, logprobs=None):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    tokens = [o.outputs[0].token_ids for o in outs]
    if logprobs is None:
        return tokens
    return tokens, [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


@pytest.fixture(scope="module")
def reference(pair):
    llm = LLM(model=pair[0], dtype="float32", num_kv_blocks=256, num_threads=2, enforce_eager=True)
    tokens, logprobs = _greedy(llm, logprobs=1)
    return tokens, logprobs


@pytest.mark.parametrize("which", ["itself", "small"])
def test_greedy_identical_chunked_prefix_cached_under_pressure(pair, reference, which):
    target, small = pair
    draft = target if which == "itself" else small
    common = dict(model=target, dtype="float32", num_threads=2, enforce_eager=True, max_num_batched_tokens=64,
                  enable_prefix_caching=True, max_model_len=128)
    roomy = LLM(**common, num_kv_blocks=256, speculative_config={"model": draft, "num_speculative_tokens": K})
    assert type(roomy.llm_engine.core.engine_core.worker.runner.proposer).__name__ == "DraftModelProposer"  # inferred
    tokens, logprobs = _greedy(roomy, logprobs=1)
    assert tokens == reference[0]  # and the accepted tokens' logprobs are the plain engine's
    assert np.allclose(np.concatenate(logprobs), np.concatenate(reference[1]), atol=1e-4)
    assert roomy.llm_engine.get_stats().prefix_cache_hits > 0
    tight = LLM(**common, num_kv_blocks=22,
                speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    assert _greedy(tight) == reference[0]
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    tight.llm_engine.core.engine_core.kv_cache_manager.check_integrity([])
    for sd in (roomy.llm_engine.get_stats().spec_decoding, stats.spec_decoding):
        assert sd.num_draft_tokens > 100
        assert sum(sd.num_accepted_tokens_per_pos) == sd.num_accepted_tokens
        if which == "itself":  # the target drafting for itself: a stale draft KV would show as a rejection
            assert sd.num_accepted_tokens == sd.num_draft_tokens


# ---- counters against a replay of the draft, on a tiny vocabulary (so drafts are often right) ------------

@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    return _llama(tmp_path_factory, "tiny-draft", 5, vocab_size=TINY_V, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, max_position_embeddings=128, bos_token_id=0, eos_token_id=1)


def _replay(draft_path, outs, prompts):
    """What the counters must say, from the outputs alone: the draft's greedy continuation (HF transformers)
    of each verified prefix, accepted while it equals the output's next tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * K
    for prompt, out in zip(prompts, outs):
        n = 1  # the prefill step samples the first token without drafts
        while n < len(out):
            room = MAX_TOKENS - n - 1
            if room <= 0:
                n += 1
                continue
            seq = prompt + out[:n]
            guess = []
            with torch.no_grad():  # plain greedy steps (generate() would stop at the tiny vocabulary's EOS)
                for _ in range(min(K, room)):
                    guess.append(int(model(torch.tensor([seq + guess])).logits[0, -1].argmax()))
            a = 0
            while a < len(guess) and guess[a] == out[n + a]:
                a += 1
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(guess), accepted + a
            for p in range(a):
                per_pos[p] += 1
            n += a + 1
    return drafts, draft_tokens, accepted, per_pos


def test_counters_equal_replay_of_draft(tiny_vocab, tiny_draft):  # noqa: F811
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [6, 2, 6, 2, 6], [7, 3, 2, 5, 4, 6, 2, 3, 7, 5, 4]]
    base = _greedy(LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=64, num_threads=2, enforce_eager=True),
                   prompts)
    spec = LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=64, num_threads=2, enforce_eager=True,
               max_num_seqs=1, speculative_config={"model": tiny_draft, "num_speculative_tokens": K})
    outs = _greedy(spec, prompts)
    assert outs == base
    sd = spec.llm_engine.get_stats().spec_decoding
    want = _replay(tiny_draft, outs, prompts)
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, sd.num_accepted_tokens_per_pos) == want
    assert 0 < sd.num_accepted_tokens < sd.num_draft_tokens


@pytest.mark.slow
def test_sampling_distribution_unchanged_with_draft_q(tiny_vocab, tiny_draft):  # noqa: F811
    """The ngram test's chi-square harness with a draft model's real q (family-wise level 1e-3 over the
    positions): a verifier using a one-hot q, or a q that is not what the draft sampled from, shifts the law."""
    from scipy.stats import chi2_contingency

    kw = {"logit_bias": {5: 1.5, 2: -2.0}, "top_p": 0.8}
    base, _ = _draws(tiny_vocab, None, **kw)
    spec, sd = _draws(tiny_vocab, {"model": tiny_draft, "num_speculative_tokens": K}, **kw)
    assert sd.num_draft_tokens > N_DRAWS and sd.num_accepted_tokens > N_DRAWS // 2
    for pos in range(POSITIONS):
        table = np.stack([np.bincount(base[:, pos], minlength=TINY_V), np.bincount(spec[:, pos], minlength=TINY_V)])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        assert chi2_contingency(table)[1] > 1e-3 / POSITIONS, (pos, table)


def test_bad_draft_config(pair, tiny_draft):
    with pytest.raises(ConfigError, match="512.*8|8.*512"):
        LLM(model=pair[0], dtype="float32", num_kv_blocks=64,
            speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": K})
    with pytest.raises(ConfigError, match="speculative_config.model"):
        LLM(model=pair[0], dtype="float32", num_kv_blocks=64,
            speculative_config={"model": "/nonexistent/draft", "num_speculative_tokens": K})
    with pytest.raises(ConfigError, match="speculative_config.model"):
        LLM(model=pair[0], speculative_config={"method": "draft_model", "num_speculative_tokens": K})


# ---- eagle: a random EAGLE-1 head (EAGLE's checkpoint names) ---------------------------------------------

def _eagle_head(path, target_cfg, seed):
    """A random EAGLE-1 Llama head saved in EAGLE's format (no layer-0 input norm, no embedding of its own)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**target_cfg, "num_hidden_layers": 1})
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,),
              "layers.0.self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
              "layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
              "layers.0.self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
              "layers.0.self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
              "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
              "layers.0.mlp.down_proj.weight": (h, inter), "layers.0.post_attention_layernorm.weight": (h,)}
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.rand(s, generator=g) + 0.5 if n.endswith("norm.weight") else
                   torch.randn(s, generator=g) * 0.15).contiguous() for n, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg.save_pretrained(path)
    return str(path), tensors


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return _eagle_head(tmp_path_factory.mktemp("eagle") / "head", TINY, 11)[0]


def test_eagle_greedy_identical_chunked_prefix_cached_under_pressure(pair, reference, eagle):
    common = dict(model=pair[0], dtype="float32", num_threads=2, enforce_eager=True, max_num_batched_tokens=64,
                  enable_prefix_caching=True, max_model_len=128,
                  speculative_config={"method": "eagle", "model": eagle, "num_speculative_tokens": K})
    roomy = LLM(**common, num_kv_blocks=256)
    assert _greedy(roomy) == reference[0]
    tight = LLM(**common, num_kv_blocks=22)
    assert _greedy(tight) == reference[0]
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.spec_decoding.num_draft_tokens > 100
    tight.llm_engine.core.engine_core.kv_cache_manager.check_integrity([])


def _eagle_replay(target_path, tensors, outs, prompts, target_cfg):
    """The EAGLE-1 head's greedy drafts recomputed from scratch with transformers' Llama layer (no KV cache):
    row i reads (embedding of token i + 1, the HF target's last hidden state at i); accepted while equal."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    tm = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    cfg = LlamaConfig(**{**target_cfg, "num_hidden_layers": 1})
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    layer.load_state_dict({n[len("layers.0."):]: t for n, t in tensors.items() if n.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()
    rope = LlamaRotaryEmbedding(cfg)
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size)
    fc.load_state_dict({"weight": tensors["fc.weight"], "bias": tensors["fc.bias"]})

    def head(tokens, feats):
        x = fc(torch.cat([tm.model.embed_tokens(torch.tensor(tokens)), feats], dim=-1))[None]
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pos = torch.arange(n)[None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))
        return (out[0] if isinstance(out, tuple) else out)[0]

    drafts = draft_tokens = accepted = 0
    per_pos = [0] * K
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            n = 1
            while n < len(out):
                room = MAX_TOKENS - n - 1
                if room <= 0:
                    n += 1
                    continue
                seq = prompt + out[:n]
                hid = tm.model(torch.tensor([seq])).last_hidden_state[0]
                tokens, feats, guess = seq[1:], hid[:-1], []
                for _ in range(min(K, room)):
                    g = head(tokens, feats)[-1]
                    guess.append(int(tm.lm_head(g).argmax()))
                    tokens, feats = tokens + guess[-1:], torch.cat([feats, g[None]])
                a = 0
                while a < len(guess) and guess[a] == out[n + a]:
                    a += 1
                drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(guess), accepted + a
                for p in range(a):
                    per_pos[p] += 1
                n += a + 1
    return drafts, draft_tokens, accepted, per_pos


def test_eagle_counters_equal_replay(tiny_vocab, tmp_path):  # noqa: F811
    import json

    target_cfg = {k: v for k, v in json.load(open(f"{tiny_vocab}/config.json")).items()
                  if k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                           "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")}
    head, tensors = _eagle_head(tmp_path / "head", target_cfg, 12)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [6, 2, 6, 2, 6], [7, 3, 2, 5, 4, 6, 2, 3, 7, 5, 4]]
    base = _greedy(LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=64, num_threads=2, enforce_eager=True),
                   prompts)
    spec = LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=64, num_threads=2, enforce_eager=True,
               max_num_seqs=1, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K})
    outs = _greedy(spec, prompts)
    assert outs == base
    sd = spec.llm_engine.get_stats().spec_decoding
    want = _eagle_replay(tiny_vocab, tensors, outs, prompts, target_cfg)
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, sd.num_accepted_tokens_per_pos) == want
    assert sd.num_accepted_tokens > 0


def test_seeded_sampling_reproducible_with_draft(tiny_vocab, tiny_draft):  # noqa: F811
    runs = []
    for _ in range(2):
        llm = LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=128, num_threads=2, enforce_eager=True,
                  speculative_config={"model": tiny_draft, "num_speculative_tokens": K})
        sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=4,
                            detokenize=False)
        outs = llm.generate([{"prompt_token_ids": [3, 4, 5, 3, 4, 5, 3, 4]}] * 3, sp)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
    assert runs[0] == runs[1]


@pytest.mark.slow  # two worker processes per engine
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_two_ranks_greedy_identical_to_one(pair, reference, eagle, method):
    """tensor_parallel_size=2 (mp): each rank runs its shard of the draft (or EAGLE head) beside its shard of the
    target, and rank 0's verification is shared: greedy tokens and logprobs equal one rank's."""
    draft = pair[1] if method == "draft_model" else eagle
    llm = LLM(model=pair[0], dtype="float32", tensor_parallel_size=2, num_kv_blocks=256, max_num_batched_tokens=64,
              speculative_config={"method": method, "model": draft, "num_speculative_tokens": K})
    try:
        tokens, logprobs = _greedy(llm, logprobs=1)
        assert tokens == reference[0]
        assert np.allclose(np.concatenate(logprobs), np.concatenate(reference[1]), atol=1e-4)
        sd = llm.llm_engine.get_stats().spec_decoding
        assert sd.num_draft_tokens > 100 and sd.num_accepted_tokens > 0
    finally:
        llm.llm_engine.core.shutdown()
