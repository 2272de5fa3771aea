"""V1 sampling semantics on a tiny random Llama, checked against computations on HF's logits."""
from __future__ import annotations

import math

import pytest
import torch
from hf_reference import hf_greedy, hf_greedy_with, hf_logits
from tiny_models import TINY, save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.errors import InvalidRequestError
from vllite_core.sampling_params import SamplingParamsError

PROMPT = [5, 77, 301, 12, 9, 480, 33, 250, 101, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-sampling")
    hf = save_tiny(path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]), seed=11)
    return str(path), hf


@pytest.fixture(scope="module")
def engines(tiny):
    path, _ = tiny
    cache: dict[str, LLM] = {}

    def get(mode="raw_logprobs", **kw):
        key = mode + repr(sorted(kw.items()))
        if key not in cache:
            cache[key] = LLM(model=path, dtype="float32", num_kv_blocks=256, logprobs_mode=mode, **kw)
        return cache[key]

    return get


def one(llm, prompt, params):
    return llm.generate([{"prompt_token_ids": prompt}], params)[0]


def _positions(hf, prompt, out_ids):
    """HF float32 logits at the positions that produced each output token."""
    logits = hf_logits(hf, prompt + out_ids)
    return logits[len(prompt) - 1:len(prompt) - 1 + len(out_ids)]


def _reference_processed(logits, temperature, top_k, top_p):
    """Temperature, top-k, top-p written out independently of the sampler."""
    x = logits / temperature
    if top_k:
        kth = torch.topk(x, top_k).values[-1]
        x = torch.where(x < kth, torch.tensor(float("-inf")), x)
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    total = 0.0
    for idx in order.tolist():  # smallest set whose mass reaches top_p
        keep[idx] = True
        total += float(probs[idx])
        if total >= top_p:
            break
    return torch.where(keep, x, torch.tensor(float("-inf")))


def test_raw_logprobs_are_log_softmax_of_hf_logits(tiny, engines):
    _, hf = tiny
    out = one(engines(), PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True))
    comp = out.outputs[0]
    ref = torch.log_softmax(_positions(hf, PROMPT, comp.token_ids), -1)
    total = 0.0
    for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert entry[tok].rank == 1
        assert abs(entry[tok].logprob - float(ref[pos, tok])) < 1e-3
        top = torch.topk(ref[pos], 5)
        assert set(entry) == set(top.indices.tolist())  # sampled token is the top-1 here
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - val) < 1e-3
        total += entry[tok].logprob
    assert math.isclose(comp.cumulative_logprob, total, rel_tol=1e-5)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logits"])
def test_processed_and_logits_modes(tiny, engines, mode):
    _, hf = tiny
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, max_tokens=6, logprobs=3, ignore_eos=True)
    comp = one(engines(mode), PROMPT, params).outputs[0]
    raw = _positions(hf, PROMPT, comp.token_ids)
    for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        if mode == "raw_logits":
            ref = raw[pos]
        else:
            ref = _reference_processed(raw[pos], 0.7, 20, 0.9)
            if mode == "processed_logprobs":
                ref = torch.log_softmax(ref, -1)
        assert math.isfinite(float(ref[tok])), "sampled a token outside the nucleus"
        assert abs(entry[tok].logprob - float(ref[tok])) < 1e-3
        assert entry[tok].rank == int((ref > ref[tok]).sum()) + 1
        top = torch.topk(ref, 3)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - val) < 1e-3


def test_prompt_logprobs_match_hf_and_bypass_the_cache(tiny, engines):
    _, hf = tiny
    llm = engines()
    long_prompt = PROMPT * 5  # 50 tokens: 3 full blocks
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    one(llm, long_prompt + [1], warm)  # fills the prefix cache
    stats0 = llm.llm_engine.core.stats()
    outs = llm.generate([{"prompt_token_ids": long_prompt + [2]}, {"prompt_token_ids": long_prompt + [3]}],
                        [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True), warm])
    with_lp, other = outs
    assert with_lp.num_cached_tokens == 0 and other.num_cached_tokens == 48
    stats1 = llm.llm_engine.core.stats()
    assert stats1.prefix_cache_hits - stats0.prefix_cache_hits == 48  # the other request still hit
    prompt = long_prompt + [2]
    ref = torch.log_softmax(hf_logits(hf, prompt), -1)
    plp = with_lp.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert abs(entry[prompt[i]].logprob - float(ref[i - 1, prompt[i]])) < 1e-3
        assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        top = torch.topk(ref[i - 1], 2)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - val) < 1e-3
    assert other.prompt_logprobs is None


def test_prompt_logprobs_across_chunks(tiny):
    path, hf = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)
    prompt = PROMPT * 4
    out = one(llm, prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    ref = torch.log_softmax(hf_logits(hf, prompt), -1)
    got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    want = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_seeds_are_reproducible_across_batch_compositions(engines):
    llm = engines()
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = one(llm, PROMPT, params).outputs[0].token_ids
    others = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(40, 46)]
    batch = llm.generate(others + [{"prompt_token_ids": PROMPT}],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 6 + [params])
    assert batch[-1].outputs[0].token_ids == alone
    different = one(llm, PROMPT, SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True))
    assert different.outputs[0].token_ids != alone


def test_n_children_share_the_prompt_and_are_seeded(engines):
    llm = engines()
    prompt = PROMPT * 4
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    a = one(llm, prompt, params)
    b = one(llm, prompt, params)
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert a.num_cached_tokens >= 32  # children after the first reuse the prompt's blocks


# ---- constraints and penalties, each against a direct greedy computation on HF logits ----

def _check_greedy(tiny, engines, params_kw, transform, n=8, prompt=PROMPT):
    path, hf = tiny
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **params_kw)
    comp = one(engines(), prompt, params).outputs[0]
    assert comp.token_ids == hf_greedy_with(hf, prompt, n, transform)
    assert comp.token_ids != hf_greedy(hf, prompt, n), "the constraint did not change the output"
    return comp


def test_repetition_penalty(tiny, engines):
    def rep(logits, prompt, out):
        seen = torch.tensor(sorted(set(prompt + out)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / 1.5, vals * 1.5)
        return logits
    # A prompt that already holds the greedy continuation: the penalty must steer away from it.
    _, hf = tiny
    prompt = PROMPT + hf_greedy(hf, PROMPT, 16) + PROMPT
    _check_greedy(tiny, engines, {"repetition_penalty": 1.5}, rep, prompt=prompt)


def test_frequency_and_presence_penalties(tiny, engines):
    def pen(logits, prompt, out):
        for t in set(out):
            logits[t] -= 1.5 * out.count(t) + 0.5
        return logits
    _check_greedy(tiny, engines, {"frequency_penalty": 1.5, "presence_penalty": 0.5}, pen, n=32)


def test_logit_bias_and_allowed_token_ids(tiny, engines):
    def bias(logits, prompt, out):
        logits[42] += 8.0
        return logits
    _check_greedy(tiny, engines, {"logit_bias": {42: 8.0}}, bias)
    allowed = [3, 99, 200, 311]

    def allow(logits, prompt, out):
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0
        return logits + mask
    comp = _check_greedy(tiny, engines, {"allowed_token_ids": allowed}, allow)
    assert set(comp.token_ids) <= set(allowed)


def test_bad_words_and_min_tokens(tiny, engines):
    path, hf = tiny
    llm = engines()
    tok = llm.get_tokenizer()
    base = hf_greedy(hf, PROMPT, 8)
    word = tok.decode([base[0]])
    out = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=[word]))
    banned = {seq[-1] for seq in out_bad_seqs(tok, word) if len(seq) == 1 and seq[0] < 512}
    assert banned and not banned & set(out.outputs[0].token_ids)

    def ban(logits, prompt, o):
        logits[list(banned)] = float("-inf")
        return logits
    assert out.outputs[0].token_ids == hf_greedy_with(hf, PROMPT, 8, ban)
    # min_tokens: the stop token cannot end the request before min_tokens tokens.
    stop_tok = base[2]
    early = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok]))
    assert early.outputs[0].token_ids[-1] == stop_tok and len(early.outputs[0].token_ids) <= 3
    late = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok], min_tokens=5))

    def no_stop(logits, prompt, o):
        if len(o) < 5:
            logits[stop_tok] = float("-inf")
        return logits
    ref = hf_greedy_with(hf, PROMPT, 8, no_stop)
    got = late.outputs[0].token_ids
    assert len(got) >= 5 and got == ref[:len(got)]


def out_bad_seqs(tok, word):
    return [tok.encode(v, add_special_tokens=False) for v in (word, " " + word.lstrip())]


def test_global_logits_processor_from_engine_argument(tiny):
    path, hf = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=128, logits_processors=["lp_fixtures:BanToken"])
    base = hf_greedy(hf, PROMPT, 6)
    out = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                          extra_args={"ban": base[0]}))
    assert out.outputs[0].token_ids[0] != base[0]
    plain = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert plain.outputs[0].token_ids == base


def test_rejections_name_the_field(engines):
    for kw, field in [({"best_of": 2}, "best_of"), ({"logits_processors": [print]}, "logits_processors"),
                      ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"), ({"n": 0}, "n"),
                      ({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"presence_penalty": 3.0}, "presence_penalty")]:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw)
        assert e.value.param == field and field in str(e.value)
    llm = engines()
    with pytest.raises(InvalidRequestError, match="max_logprobs"):
        one(llm, PROMPT, SamplingParams(logprobs=50))
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        one(llm, PROMPT, SamplingParams(allowed_token_ids=[10**6]))
    assert one(llm, PROMPT, SamplingParams(max_tokens=2)).finished  # still serving


def test_logits_processors_from_the_plugin_hook():
    import pluggy
    from lp_fixtures import BanToken

    from vllite_core.plugins import hookimpl, hookspecs
    from vllite_core.sample.logits_processor import LogitsProcessorError, load_logits_processors

    pm = pluggy.PluginManager("vllite")
    pm.add_hookspecs(hookspecs)

    class Plugin:
        @hookimpl
        def vllite_register_logits_processors(self):
            return [BanToken, lambda logits, batch: logits]

    pm.register(Plugin())
    procs = load_logits_processors(["lp_fixtures:BanToken"], pm)
    assert [type(p).__name__ for p in procs] == ["BanToken", "_CallableProcessor", "BanToken"]
    with pytest.raises(LogitsProcessorError, match="no_such_module"):
        load_logits_processors(["no_such_module:X"], pm)
    with pytest.raises(LogitsProcessorError, match="module:name"):
        load_logits_processors(["just_a_name"], pm)


def test_the_token_that_stops_a_request_is_not_in_its_text(engines):
    """vLLM's rule: a stop token id (or EOS) ends the request and stays in token_ids, but its text is not
    in the output (even with skip_special_tokens=False), unless include_stop_str_in_output asks."""
    llm = engines()
    tok = llm.get_tokenizer()
    base = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).outputs[0].token_ids
    stop_tok = base[3]
    for skip in (True, False):
        out = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_tok],
                                              skip_special_tokens=skip)).outputs[0]
        assert out.token_ids[-1] == stop_tok and out.finish_reason == "stop" and out.stop_reason == stop_tok
        assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=skip)
    kept = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_tok],
                                           include_stop_str_in_output=True)).outputs[0]
    assert kept.text == tok.decode(kept.token_ids)
