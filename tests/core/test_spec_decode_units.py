"""Speculative decoding pieces against independent references: the ngram proposer against a plain-Python
prompt lookup, the rejection sampler's output distribution against the target distribution computed by
hand (40k draws per case, total variation bound), and the config checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllite_core.config import ConfigError, EngineArgs
from vllite_core.config.speculative import SpeculativeConfig
from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sample.rejection_sampler import rejection_sample
from vllite_core.sample.sampler import Sampler
from vllite_core.spec_decode.ngram import NgramProposer


def lookup(seq: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Reference prompt lookup: longest suffix first, its most recent earlier occurrence, the k tokens after."""
    for n in range(hi, lo - 1, -1):
        if len(seq) < n + 1:
            continue
        suffix = seq[-n:]
        for s in range(len(seq) - n - 1, -1, -1):
            if seq[s:s + n] == suffix:
                return seq[s + n:s + n + k]
    return []


@pytest.mark.parametrize("lo,hi,k", [(1, 3, 4), (2, 5, 3), (3, 3, 1)])
def test_ngram_matches_reference(lo, hi, k):
    rng = np.random.default_rng(lo * 10 + hi)
    prop = NgramProposer(SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}))
    for trial in range(20):
        rows = int(rng.integers(1, 9))
        seqs = [rng.integers(0, int(rng.integers(2, 12)), size=int(rng.integers(1, 60))).tolist() for _ in range(rows)]
        width = max(len(s) for s in seqs) + 7
        arr = np.full((rows, width), 999, dtype=np.int64)  # junk past each row's end must be ignored
        for i, s in enumerate(seqs):
            arr[i, :len(s)] = s
        got = prop.propose(arr, np.array([len(s) for s in seqs], dtype=np.int64))
        assert got == [lookup(s, lo, hi, k) for s in seqs], trial


V = 8
LOGITS = torch.tensor([1.2, 0.3, 2.0, -0.5, 0.8, 1.5, -1.0, 0.0])


def target(temperature=1.0, top_p=1.0, bias=None):
    """The distribution a plain step samples from, computed independently of the sampler."""
    x = LOGITS.clone().double()
    for t, b in (bias or {}).items():
        x[t] += b
    p = torch.softmax(x / temperature, -1)
    if top_p < 1.0:
        order = torch.argsort(p, descending=True)
        keep = torch.zeros(V, dtype=torch.bool)
        cum = 0.0
        for idx in order.tolist():
            keep[idx] = True
            cum += float(p[idx])
            if cum >= top_p:
                break
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p.float()


def metadata(n, temperature=1.0, top_p=1.0, bias=None):
    md = SamplingMetadata(temperature=torch.full((n,), temperature), top_k=None,
                          top_p=torch.full((n,), top_p) if top_p < 1 else None, min_p=None,
                          all_greedy=temperature == 0, all_random=temperature > 0, generators={}, max_num_logprobs=None)
    if bias:
        ids = list(bias)
        md.bias = (torch.arange(n).repeat_interleave(len(ids)), torch.tensor(ids).repeat(n),
                   torch.tensor([bias[i] for i in ids], dtype=torch.float32).repeat(n))
    return md


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"top_p": 0.75}, {"bias": {6: 3.0, 2: -1.0}},
                                {"bias": {3: 2.0}, "top_p": 0.8, "temperature": 1.3}])
@pytest.mark.parametrize("drafter", ["one_hot", "probs"])
def test_rejection_sampler_is_lossless(kw, drafter):
    """Whatever the drafts, the emitted token at a verified position is distributed as p."""
    n = 40_000
    torch.manual_seed(1)
    q = torch.softmax(torch.tensor([0.0, 1.0, 0.5, 2.0, -1.0, 0.3, 1.1, 0.0]), -1)  # a proposer unlike p
    drafts = torch.multinomial(q, n, replacement=True)
    # n requests of one draft each: the draft's row, then the bonus row (-1); the draft rows are checked.
    rows = torch.stack([drafts, torch.full_like(drafts, -1)], dim=1).flatten()
    probs = q.repeat(2 * n, 1) if drafter == "probs" else None
    both = rejection_sample(Sampler(), LOGITS.repeat(2 * n, 1), metadata(2 * n, **kw), rows, probs)
    out = type(both)(both.token_ids[0::2], both.accepted[0::2], None)
    freq = torch.bincount(out.token_ids, minlength=V).float() / n
    want = target(**kw)
    assert float((freq - want).abs().sum()) / 2 < 0.015  # total variation (sampling noise is about 0.005)
    assert bool((freq[want == 0] == 0).all())
    # Accepted exactly where the emitted token is the draft and the sampler said so.
    assert bool((out.token_ids[out.accepted] == drafts[out.accepted]).all())
    # Acceptance probability sum_x min(p(x), q(x)) (one-hot q: sum_x q(x) p(x)).
    rate = float(out.accepted.float().mean())
    expect = float(torch.minimum(want, q).sum()) if drafter == "probs" else float((want * q).sum())
    assert abs(rate - expect) < 0.015


def test_rejection_sampler_greedy_and_bonus():
    n = 6
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([int(logits[0].argmax()), (int(logits[1].argmax()) + 1) % V, -1, -1, 3, 5])
    out = rejection_sample(Sampler(), logits, metadata(n, temperature=0.0), drafts)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.accepted.tolist() == [True, False, False, False, int(logits[4].argmax()) == 3,
                                     int(logits[5].argmax()) == 5]


@pytest.mark.parametrize("value,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "model"),
    ("{not json", "JSON"),
    (["ngram"], "must be a dict"),
])
def test_bad_speculative_config(value, field):
    with pytest.raises(ConfigError, match=field):
        EngineArgs(speculative_config=value).create_config()


def test_config_defaults_and_json():
    cfg = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
                     ).create_config().speculative_config
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert EngineArgs().create_config().speculative_config is None
    # Only a model given: the method is inferred from its name, as vLLM does.
    for model, method in (("/m/draft-1b", "draft_model"), ("/m/EAGLE-LLaMA3-8B", "eagle")):
        cfg = EngineArgs(speculative_config={"model": model, "num_speculative_tokens": 2}).create_config()
        assert cfg.speculative_config.method == method


def test_cli_flag_parses_json():
    import argparse

    from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    cfg = engine_args_from_namespace(ns).create_config().speculative_config
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "ngram"])


def test_unknown_method_fails_at_engine_start(tiny_path):
    from vllite_core.entrypoints.llm import LLM

    with pytest.raises(ConfigError, match="unknown method 'eagle9'.*known: draft_model, eagle, ngram"):
        LLM(model=tiny_path, speculative_config={"method": "eagle9", "num_speculative_tokens": 2})


def test_builtin_proposer_registered_through_the_hook():
    from vllite_core.plugins import VLLITE_PLUGIN_API
    from vllite_core.plugins.manager import get_plugin_manager
    from vllite_core.spec_decode.registry import spec_proposer_factories

    assert VLLITE_PLUGIN_API >= (1, 2)
    from vllite_core.spec_decode.draft_model import DraftModelProposer
    from vllite_core.spec_decode.eagle import EagleProposer

    found = spec_proposer_factories(get_plugin_manager())
    assert (found["ngram"], found["draft_model"], found["eagle"]) == (NgramProposer, DraftModelProposer,
                                                                      EagleProposer)


def test_first_unaccepted_row_per_request():
    """The rows whose sample is kept: per request (ending at its bonus row), the first not accepted."""
    from vllite_core.sample.rejection_sampler import _first_unaccepted

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        sizes = torch.randint(0, 4, (6,), generator=gen).tolist()  # drafts per request
        draft_ids = torch.tensor([t for k in sizes for t in [*range(k), -1]])
        accepted = (torch.rand(len(draft_ids), generator=gen) < 0.6) & (draft_ids >= 0)
        want, pos = [], 0
        for k in sizes:
            first = next(j for j in range(k + 1) if not bool(accepted[pos + j]))
            want += [j == first for j in range(k + 1)]
            pos += k + 1
        assert _first_unaccepted(accepted, draft_ids).tolist() == want
