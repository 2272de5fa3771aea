"""Beam search through the engine (vLLM's ``LLM.beam_search``): every step asks the engine for one token with
the top ``2 * beam_width`` logprobs of each live beam (each beam a prompt of its tokens so far, so the prefix
cache serves the shared part), then keeps the ``beam_width`` best continuations per prompt by the length-
penalised score. A beam that draws EOS is complete and leaves the search (unless ``ignore_eos``); at the end
the complete and the live beams are ranked together. Tokens include the prompt, as vLLM's do.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllite_core.outputs import Logprob, RequestOutput
from vllite_core.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (prompt and output), the logprobs dict of each output step, their sum."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's score: the sum of logprobs over the length (EOS not counted) to the power ``length_penalty``."""
    n = len(seq.tokens) - (1 if eos_token_id is not None and seq.tokens and seq.tokens[-1] == eos_token_id else 0)
    return seq.cum_logprob / (n ** length_penalty)


Generate = Callable[[list[Any], SamplingParams], list[RequestOutput]]


def beam_search(generate: Generate, prompts: Sequence[Any], params: BeamSearchParams, eos_token_id: int | None,
                decode: Callable[[list[int]], str], lora_request: Any = None) -> list[BeamSearchOutput]:
    """``generate``: the engine's batch call (one output per prompt); ``decode``: token ids -> text."""
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)

    def key(seq: BeamSearchSequence) -> float:
        return beam_score(seq, eos_token_id, params.length_penalty)

    beams: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    prompt_lens = [0] * len(prompts)
    for i in range(params.max_tokens):
        if i == 0:  # the prompts as given (the engine tokenizes them); their ids come back with the outputs
            owners, asked = list(range(len(prompts))), list(prompts)
            parents = [BeamSearchSequence([]) for _ in prompts]
        else:
            pairs = [(p, b) for p, live in enumerate(beams) for b in live]
            if not pairs:
                break
            owners, parents = [p for p, _ in pairs], [b for _, b in pairs]
            asked = [{"prompt_token_ids": b.tokens} for b in parents]
        outs = generate(asked, step)
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for p, parent, out in zip(owners, parents, outs):
            tokens = parent.tokens or list(out.prompt_token_ids)
            prompt_lens[p] = prompt_lens[p] or len(out.prompt_token_ids)
            top = (out.outputs[0].logprobs or [{}])[0]
            for tid, lp in top.items():
                child = BeamSearchSequence(tokens + [tid], parent.logprobs + [top], parent.cum_logprob + lp.logprob,
                                           lora_request=lora_request)
                if tid == eos_token_id and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", tid
                    done[p].append(child)
                else:
                    grown[p].append(child)
        beams = [sorted(g, key=key, reverse=True)[:params.beam_width] for g in grown]
    results = []
    for p in range(len(prompts)):
        for b in beams[p]:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(done[p] + beams[p], key=key, reverse=True)[:params.beam_width]
        for b in best:
            out_ids = b.tokens[prompt_lens[p]:]
            if b.finish_reason == "stop" and not params.include_stop_str_in_output:
                out_ids = out_ids[:-1]
            b.text = decode(b.tokens[:prompt_lens[p]] + out_ids)
        results.append(BeamSearchOutput(best))
    return results
