"""Structured output costs: the per-step share of grammar masking at batch 64, first / cached
compile time per backend, and the gain of jump-forward decoding.

    .venv/bin/python benchmarks/structured_output.py                 # SmolLM2, batch 64, 32 steps
    .venv/bin/python benchmarks/structured_output.py --batch 16 --output-len 16
    .venv/bin/python benchmarks/structured_output.py --jump-forward  # only the jump-forward comparison

Masking: 64 requests decode under a JSON schema (xgrammar) while the two pieces of masking are
timed: filling the step's bitmask (the matchers, on the host) and applying it to the logits (torch
ops on the device); their sum is reported as a share of the engine step time of the same run, and the
step time is compared with 64 free requests of the same lengths (one run each, taking turns; the
machine is shared, so read ratios, not absolute times). Compile: per backend, building its tokenizer
tables once, the first compile of a schema, and the same schema again through the manager's cache.
Jump-forward: two engines, ``jump_forward`` off and on, take turns (``--rounds`` each) generating the
same greedy batch under a schema with long fixed keys, an enum and a const; reported: output tokens per
second of engine step time, steps per batch, and on/off ratios (the outputs are checked identical).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}},
    "required": ["name", "age", "tags"]}


class Timer:
    def __init__(self) -> None:
        self.s = 0.0
        self.calls = 0

    def wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t
                self.calls += 1
        return timed


def run_batch(llm, prompts, params) -> tuple[float, int]:
    core = llm.llm_engine.core
    st0 = core.stats().step_times.as_dict()
    llm.generate(prompts, params)
    st1 = core.stats().step_times.as_dict()
    total = sum(st1[k] - st0[k] for k in ("schedule_s", "execute_s", "update_s"))
    return total, st1["steps"] - st0["steps"]


def masking(a) -> dict:
    import vllite_core.sample.sampler as sampler_mod
    from vllite_core import LLM, SamplingParams, StructuredOutputsParams
    from vllite_core.structured_output.manager import StructuredOutputManager

    fill, apply = Timer(), Timer()
    StructuredOutputManager.grammar_bitmask = fill.wrap(StructuredOutputManager.grammar_bitmask)
    sampler_mod.apply_token_bitmask = apply.wrap(sampler_mod.apply_token_bitmask)
    kw = {"model": a.model} if a.model else {}
    llm = LLM(**kw, dtype=a.dtype, max_model_len=512, max_num_seqs=a.batch)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person {i} as JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(a.batch)]
    # ignore_eos + fixed lengths: both runs do the same number of steps of the same batch size.
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=a.output_len, ignore_eos=True)
    so = SamplingParams(temperature=0.8, seed=1, max_tokens=a.output_len, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    run_batch(llm, prompts[:4], free)  # warm-up
    run_batch(llm, prompts[:4], so)
    fill.s = apply.s = 0.0
    fill.calls = apply.calls = 0
    free_s, free_steps = run_batch(llm, prompts, free)
    f0, a0 = fill.s, apply.s
    so_s, so_steps = run_batch(llm, prompts, so)
    mask_s = (fill.s - f0) + (apply.s - a0)
    return {"batch": a.batch, "output_len": a.output_len, "free_step_ms": 1e3 * free_s / max(free_steps, 1),
            "structured_step_ms": 1e3 * so_s / max(so_steps, 1),
            "fill_ms_per_step": 1e3 * (fill.s - f0) / max(so_steps, 1),
            "apply_ms_per_step": 1e3 * (apply.s - a0) / max(so_steps, 1),
            "mask_share_of_step": mask_s / so_s if so_s else 0.0,
            "structured_over_free_step": (so_s / max(so_steps, 1)) / (free_s / max(free_steps, 1))}


JF_SCHEMA = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 20},
    "preferred_contact_method": {"enum": ["electronic_mail_message", "telephone_call_in_the_evening"]},
    "account_status_description": {"const": "active_and_in_good_standing"},
    "number_of_previous_orders": {"type": "integer", "minimum": 0, "maximum": 99},
    "shipping_address_country_code": {"enum": ["united_kingdom_of_great_britain", "federal_republic_of_germany"]}},
    "required": ["customer_full_name", "preferred_contact_method", "account_status_description",
                 "number_of_previous_orders", "shipping_address_country_code"], "additionalProperties": False}


def jump_forward(a) -> dict:
    from vllite_core import LLM, SamplingParams, StructuredOutputsParams

    kw = {"model": a.model} if a.model else {}
    engines = {jf: LLM(**kw, dtype=a.dtype, max_model_len=512, max_num_seqs=a.jf_batch, jump_forward=jf)
               for jf in (False, True)}
    tok = engines[False].get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Give customer record {i} as JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(a.jf_batch)]
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(
        json=JF_SCHEMA, disable_any_whitespace=True))
    totals = {jf: {"s": 0.0, "steps": 0, "tokens": 0} for jf in engines}
    texts: dict[bool, list[str]] = {}
    for llm in engines.values():  # warm-up (grammar compiled and cached)
        llm.generate(prompts[:1], params)
    jumped0 = engines[True].llm_engine.get_stats().num_jump_forward_tokens
    for _ in range(a.rounds):
        for jf, llm in engines.items():
            core = llm.llm_engine.core
            st0 = core.stats().step_times.as_dict()
            outs = llm.generate(prompts, params)
            st1 = core.stats().step_times.as_dict()
            t = totals[jf]
            t["s"] += sum(st1[k] - st0[k] for k in ("schedule_s", "execute_s", "update_s"))
            t["steps"] += st1["steps"] - st0["steps"]
            t["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
            texts[jf] = [o.outputs[0].text for o in outs]
    res = {("on" if jf else "off"): {"output_tok_per_s": t["tokens"] / t["s"], "steps_per_batch": t["steps"] / a.rounds,
                                     "output_tokens_per_batch": t["tokens"] / a.rounds} for jf, t in totals.items()}
    jumped = engines[True].llm_engine.get_stats().num_jump_forward_tokens - jumped0
    res["jumped_tokens_per_batch"] = jumped / a.rounds
    res["outputs_identical"] = texts[True] == texts[False]
    res["tok_per_s_on_over_off"] = res["on"]["output_tok_per_s"] / res["off"]["output_tok_per_s"]
    res["steps_on_over_off"] = res["on"]["steps_per_batch"] / res["off"]["steps_per_batch"]
    res["batch"], res["rounds"] = a.jf_batch, a.rounds
    return res


def compile_times(a) -> dict:
    from model_registry.source import load_tokenizer, resolve_model_source
    from vllite_core.config import StructuredOutputsConfig
    from vllite_core.plugins.manager import get_plugin_manager
    from vllite_core.sampling_params import StructuredOutputsParams

    tok = load_tokenizer(resolve_model_source(a.model))
    vocab = len(tok)
    out = {}
    for name in ("xgrammar", "guidance", "outlines"):
        from vllite_core.structured_output import StructuredOutputManager

        mgr = StructuredOutputManager(StructuredOutputsConfig(backend=name), tok, vocab, tok.eos_token_id,
                                      get_plugin_manager())
        t = time.perf_counter()
        mgr.backend(name)
        init = time.perf_counter() - t

        def one(schema):
            params = StructuredOutputsParams(json=schema)
            t = time.perf_counter()
            g = mgr.submit(params)
            while not g.poll():
                if g.error:
                    raise RuntimeError(g.error)
                time.sleep(0.0002)
            return time.perf_counter() - t

        first = one(SCHEMA)
        cached = one(SCHEMA)
        out[name] = {"tokenizer_tables_s": init, "first_compile_s": first, "cached_compile_s": cached,
                     "first_over_cached": first / cached if cached else None}
        mgr.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--skip-masking", action="store_true")
    ap.add_argument("--jump-forward", action="store_true", help="only the jump-forward on/off comparison")
    ap.add_argument("--jf-batch", type=int, default=8, help="requests per jump-forward batch")
    ap.add_argument("--rounds", type=int, default=3, help="jump-forward batches per engine, taking turns")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    if a.jump_forward:
        print(json.dumps({"jump_forward": jump_forward(a)}, indent=2))
        return
    result = {"compile": compile_times(a)}
    if not a.skip_masking:
        result["masking"] = masking(a)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
