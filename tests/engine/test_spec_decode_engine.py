"""Speculative decoding in the engine: greedy output token-identical to the same engine without speculation
(SmolLM2, 16 prompts incl. copy-heavy ones, batched and one at a time, chunk budget 64, prefix caching,
KV pressure), accepted tokens' logprobs equal the non-speculative ones, acceptance counters equal a count
made independently from the outputs, stop strings, n > 1, seeds; and lossless sampling on a tiny-vocabulary
model (spec vs no spec, chi-square homogeneity per position) with logit bias, top-p and penalties."""
from __future__ import annotations

import numpy as np
import pytest
from test_spec_decode_units import lookup

from vllite_core.entrypoints.llm import LLM
from vllite_core.sampling_params import SamplingParams

K, LO, HI = 4, 2, 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": LO, "prompt_lookup_max": HI}
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. Repeat:",
    f"Rewrite this code with the function names in capitals:\n{CODE}\nAnswer:\n",
    f"{CODE}\n# the same code again:\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "a b c a b c a b c a b c",
    "The capital of France is",
    "List the colours of the rainbow:",
    "Once upon a time, in a land far away,",
    "Translate to French: good morning, good evening, good night.",
    "red green blue red green blue red green",
    "<html><body><p>Hello</p><p>Hello</p><p>",
    "Q: What is 2 + 2?\nA: 4\nQ: What is 3 + 3?\nA:",
    "Write a haiku about the sea.",
    "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT",
    "Python is a programming language that",
    "the cat sat on the mat. the cat sat on the mat. the cat",
]
MAX_TOKENS = 24


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", num_threads=2, enforce_eager=True, num_kv_blocks=512)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    stop = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["\n", "."]))
    yield {"outs": outs, "stop": stop, "tok": llm.get_tokenizer(), "structured": _structured(llm)}
    del llm


def _structured(llm):
    """A structured-output request in a batch with copy-heavy ones (it is not speculated, they are)."""
    from vllite_core.sampling_params import StructuredOutputsParams

    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    choice = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe not"]))
    return _tokens(llm.generate(["Is the sky blue? Answer yes or no:", *PROMPTS[:3]], [choice, plain, plain, plain]))


def _check_same(outs, reference, logprobs=True):
    assert _tokens(outs) == _tokens(reference["outs"])
    if logprobs:
        for a, b in zip(outs, reference["outs"]):
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                (ta, va), (tb, vb) = next(iter(la.items())), next(iter(lb.items()))
                assert ta == tb and abs(va.logprob - vb.logprob) < 1e-3


def _independent_count(tok, outs):
    """What the counters must say, from the outputs alone: replay prompt lookup (reference implementation)
    over each output; with greedy decoding a draft is accepted while it equals the output's next tokens."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * K
    for o in outs:
        prompt, out = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        n = 1  # the prefill step samples the first token without drafts
        while n < len(out):
            guess = lookup(prompt + out[:n], LO, HI, K)[:MAX_TOKENS - n - 1]
            if not guess:
                n += 1
                continue
            a = 0
            while a < len(guess) and guess[a] == out[n + a]:
                a += 1
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(guess), accepted + a
            for p in range(a):
                per_pos[p] += 1
            n += a + 1
    return drafts, draft_tokens, accepted, per_pos


@pytest.mark.slow
def test_greedy_identical_batched_chunked_with_counters(reference):
    llm = LLM(dtype="float32", num_threads=2, enforce_eager=True, speculative_config=NGRAM,
              max_num_batched_tokens=64, enable_prefix_caching=True, num_kv_blocks=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                                                ignore_eos=True))
    _check_same(outs, reference)
    sd = llm.llm_engine.get_stats().spec_decoding
    assert sd.num_accepted_tokens > 50  # the copy-heavy prompts do get drafts accepted
    stop = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["\n", "."]))
    assert _tokens(stop) == _tokens(reference["stop"])
    assert [o.outputs[0].text for o in stop] == [o.outputs[0].text for o in reference["stop"]]
    assert _structured(llm) == reference["structured"]


@pytest.mark.slow
def test_greedy_identical_batch_one_and_counters(reference):
    llm = LLM(dtype="float32", num_threads=2, enforce_eager=True, speculative_config=NGRAM, max_num_seqs=1,
              num_kv_blocks=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                                                ignore_eos=True))
    _check_same(outs, reference)
    sd = llm.llm_engine.get_stats().spec_decoding
    drafts, draft_tokens, accepted, per_pos = _independent_count(reference["tok"], outs)
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, sd.num_accepted_tokens_per_pos) == \
        (drafts, draft_tokens, accepted, per_pos)
    assert accepted > 50


@pytest.mark.slow
def test_greedy_identical_under_kv_pressure_and_n2(reference):
    llm = LLM(dtype="float32", num_threads=2, enforce_eager=True, speculative_config=NGRAM,
              max_num_batched_tokens=64, num_kv_blocks=24)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                                                ignore_eos=True, n=2))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    for o, ref in zip(outs, reference["outs"]):
        assert [c.token_ids for c in o.outputs] == [ref.outputs[0].token_ids] * 2
    assert stats.spec_decoding.num_accepted_tokens > 0
    llm.llm_engine.core.engine_core.kv_cache_manager.check_integrity([])


def test_seeded_sampling_reproducible(tiny_vocab):
    runs = []
    for _ in range(2):
        llm = LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=512, num_threads=2, enforce_eager=True,
                  speculative_config=NGRAM)
        sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=4)
        runs.append(_tokens(llm.generate([{"prompt_token_ids": [3, 4, 5, 3, 4, 5, 3, 4]}] * 3, sp)))
        assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
        del llm
    assert runs[0] == runs[1]


# ---- lossless sampling on a tiny vocabulary -------------------------------------------------------------

TINY_V = 8
N_DRAWS = 4000
POSITIONS = 4


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    from tiny_models import save_tiny
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-vocab")
    cfg = dict(vocab_size=TINY_V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=0,
               eos_token_id=1, architectures=["LlamaForCausalLM"])
    save_tiny(path, LlamaConfig(**cfg), seed=3)
    return str(path)


def _draws(path, spec, **kw):
    import torch

    torch.manual_seed(0)
    llm = LLM(model=path, dtype="float32", num_kv_blocks=512, num_threads=2, enforce_eager=True, max_num_seqs=256,
              speculative_config=spec)
    sp = SamplingParams(temperature=1.0, max_tokens=POSITIONS, ignore_eos=True, detokenize=False, n=125, **kw)
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5, 3, 4, 5, 3, 4]}] * (N_DRAWS // 125), sp)
    sd = llm.llm_engine.get_stats().spec_decoding
    return np.array([c.token_ids for o in outs for c in o.outputs]), sd


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"logit_bias": {5: 1.5, 2: -2.0}, "top_p": 0.8},
                                {"frequency_penalty": 0.8, "presence_penalty": 0.3}])
def test_sampling_distribution_unchanged(tiny_vocab, kw):
    """Chi-square homogeneity test per position (4000 draws each way), Bonferroni over the positions at
    family-wise level 1e-3; seeds are fixed, so the test is deterministic and fails only if spec sampling
    changes the distribution (a wrong history extension shifts a penalised position's law by far more)."""
    from scipy.stats import chi2_contingency

    base, _ = _draws(tiny_vocab, None, **kw)
    spec, sd = _draws(tiny_vocab, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2}, **kw)
    assert sd.num_draft_tokens > N_DRAWS // 2 and sd.num_accepted_tokens > N_DRAWS // 20
    for pos in range(POSITIONS):
        table = np.stack([np.bincount(base[:, pos], minlength=TINY_V), np.bincount(spec[:, pos], minlength=TINY_V)])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        p = chi2_contingency(table)[1]
        assert p > 1e-3 / POSITIONS, (pos, table)


# ---- the server ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_server_speculative_config_and_metrics(tiny_path):
    """`vllite serve --speculative-config JSON`: a greedy completion equals the offline engine's without
    speculation, and /metrics carries vLLM's spec_decode counters equal to the offline spec engine's."""
    import json

    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_harness import ServerProcess

    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = LLM(model=tiny_path, dtype="float32", num_kv_blocks=64).generate([{"prompt_token_ids": prompt}], sp)
    spec = LLM(model=tiny_path, dtype="float32", num_kv_blocks=64, speculative_config=NGRAM)
    spec.generate([{"prompt_token_ids": prompt}], sp)
    want = spec.llm_engine.get_stats().spec_decoding
    srv = ServerProcess(["--model", tiny_path, "--dtype", "float32", "--num-kv-blocks", "64",
                         "--speculative-config", json.dumps(NGRAM)])
    try:
        url = srv.wait_ready(timeout=180)
        r = httpx.post(url + "/v1/completions", json={"model": tiny_path, "prompt": prompt, "max_tokens": 60,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain[0].outputs[0].text
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    finally:
        srv.stop()

    def value(name, **labels):
        return sum(s.value for s in fams[name].samples
                   if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))

    assert want.num_drafts > 0
    assert value("vllm:spec_decode_num_drafts", engine="0") == want.num_drafts
    assert value("vllm:spec_decode_num_draft_tokens", engine="0") == want.num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens", engine="0") == want.num_accepted_tokens
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(p)) for p in range(K)] == \
        want.num_accepted_tokens_per_pos


def test_server_rejects_bad_speculative_config(tiny_path):
    from server_harness import ServerProcess

    srv = ServerProcess(["--model", tiny_path, "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 0}'])
    try:
        rc = srv.proc.wait(timeout=120)
    finally:
        srv.stop()
    assert rc != 0 and "num_speculative_tokens" in srv.output


# ---- every processor sees the history a plain step would --------------------------------------------------

class NoRepeatLast:
    """A global processor whose answer depends on the output history: it bans each row's last output token."""

    def apply(self, logits, batch):
        for i, out in enumerate(batch.output_token_ids):
            if out:
                logits[i, out[-1]] = float("-inf")
        return logits


PROCESSOR_CASES = [
    {"repetition_penalty": 1.5},
    {"frequency_penalty": 0.4, "presence_penalty": 0.2},
    {"logit_bias": {5: 0.7, 3: -0.4}, "allowed_token_ids": [2, 3, 4, 5, 6]},
    {"min_tokens": 10, "stop_token_ids": [4], "ignore_eos": False},
]


def _greedy(llm, **kw):
    params = dict(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    params.update(kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in ([3, 4, 5, 3, 4, 5, 3, 4], [6, 2, 6, 2, 6])],
                        SamplingParams(**params))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("processors", [False, True])
def test_greedy_identical_under_processors(tiny_vocab, processors):
    extra = {"logits_processors": ["test_spec_decode_engine:NoRepeatLast"]} if processors else {}
    base = LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=512, num_threads=2, enforce_eager=True, **extra)
    spec = LLM(model=tiny_vocab, dtype="float32", num_kv_blocks=512, num_threads=2, enforce_eager=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}, **extra)
    for kw in PROCESSOR_CASES[:1] if processors else PROCESSOR_CASES:
        assert _greedy(spec, **kw) == _greedy(base, **kw), kw
    if processors:
        out = _greedy(spec)
        assert out == _greedy(base) and all(a != b for o in out for a, b in zip(o, o[1:]))
    assert spec.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0


def test_bench_throughput_reports_spec_counters(tiny_path, tmp_path):
    import json

    from vllite_core.entrypoints.cli import main

    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_path, "--num-prompts", "4", "--input-len", "12",
               "--output-len", "24", "--num-kv-blocks", "64", "--max-model-len", "128", "--dtype", "float32",
               "--speculative-config", json.dumps(NGRAM), "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["output_tokens"] == 96  # speculation never overshoots max_tokens
    assert res["engine"]["speculative_config"]["num_speculative_tokens"] == K
    sd = res["spec_decode"]
    assert sum(sd["num_accepted_tokens_per_pos"]) == sd["num_accepted_tokens"] <= sd["num_draft_tokens"]
