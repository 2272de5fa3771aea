"""Structured output offline, on the real SmolLM2: outputs of a table of JSON schemas validate with the
`jsonschema` package (greedy and sampled), regex outputs fullmatch, choice outputs are members; the
three backends agree on allowed-token sets; ``auto`` falls back and says which backend served; free
requests batched with structured ones are token-identical to a run without them; a grammar that fails
to compile fails its request alone."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from vllite_core import LLM, SamplingParams, StructuredOutputsParams
from vllite_core.sampling_params import SamplingParamsError

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
        "required": ["id", "tags"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -10, "maximum": 40}}, "required": ["t"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "b": {"type": "string", "maxLength": 6}}, "required": ["a"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}},
                                "required": ["k"]}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "string", "maxLength": 6}]}}, "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "n": {"type": "integer", "exclusiveMinimum": 0,
                                                                         "maximum": 1000}},
     "required": ["kind", "n"]},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{1,20}\.", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}"]
CHOICES = [["Paris", "London", "Berlin"], ["positive", "negative", "neutral"]]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, num_kv_blocks=512, max_num_seqs=64)


def prompt(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def so_params(max_tokens: int, sampled: bool, i: int, **kind) -> SamplingParams:
    temp = dict(temperature=0.8, seed=100 + i) if sampled else dict(temperature=0.0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind), **temp)


@pytest.mark.slow
def test_json_schemas_validate_greedy_and_sampled(llm):
    # disable_any_whitespace: with free whitespace the 135M model can loop on newlines until max_tokens
    # (the grammar allows it); compact JSON keeps every output short enough to finish.
    p = prompt(llm, "Reply with a small JSON value.")
    params = [so_params(120, sampled, i, json=s, disable_any_whitespace=True)
              for sampled in (False, True) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate([p] * len(params), params)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[i % len(SCHEMAS)])
        assert out.metrics.structured_output_backend == "xgrammar"


def test_regex_and_choice_greedy_and_sampled(llm):
    p = prompt(llm, "Answer briefly.")
    kinds = [dict(regex=r) for r in REGEXES] + [dict(choice=c) for c in CHOICES]
    params = [so_params(48, sampled, i, **k) for sampled in (False, True) for i, k in enumerate(kinds)]
    outs = llm.generate([p] * len(params), params)
    for k, out in zip(kinds * 2, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        if "regex" in k:
            assert re.fullmatch(k["regex"], text), (k, text)
        else:
            assert text in k["choice"], (k, text)


def test_n_children_each_follow_the_grammar(llm):
    out = llm.generate([prompt(llm, "A number.")], SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[2])))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS[2])


@pytest.mark.slow
def test_auto_falls_back_to_guidance_and_says_so(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7, "minimum": 1,
                                                     "maximum": 99}}, "required": ["n"], "additionalProperties": False}
    outs = llm.generate([prompt(llm, "Give a JSON object.")] * 2,
                        [so_params(30, s, 0, json=schema, disable_any_whitespace=True) for s in (False, True)])
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)  # multipleOf enforced
        assert out.metrics.structured_output_backend == "guidance"
    # disable_fallback: xgrammar only, so the request is refused naming the field and the reason
    with pytest.raises(SamplingParamsError, match="multipleOf") as e:
        llm.generate([prompt(llm, "x")], so_params(8, False, 0, json=schema, disable_fallback=True))
    assert e.value.param == "structured_outputs.json"


def test_an_explicit_backend_never_falls_back(llm):
    from vllite_core.config import StructuredOutputsConfig
    from vllite_core.plugins.manager import get_plugin_manager
    from vllite_core.structured_output import StructuredOutputManager

    eng = llm.llm_engine
    mgr = StructuredOutputManager(StructuredOutputsConfig(backend="xgrammar"), eng.tokenizer, eng.vocab_size,
                                  eng.eos_token_id, get_plugin_manager())
    with pytest.raises(SamplingParamsError, match="xgrammar"):
        mgr.select(StructuredOutputsParams(json={"type": "integer", "multipleOf": 2}))
    assert mgr.select(StructuredOutputsParams(regex="a+")) == "xgrammar"
    mgr = StructuredOutputManager(StructuredOutputsConfig(backend="outlines"), eng.tokenizer, eng.vocab_size,
                                  eng.eos_token_id, get_plugin_manager())
    with pytest.raises(SamplingParamsError, match="outlines"):
        mgr.select(StructuredOutputsParams(grammar='root ::= "a"'))
    # outlines-core drops numeric bounds from its regex: refused rather than followed unbounded
    with pytest.raises(SamplingParamsError, match="outlines: numeric bounds are not enforced .*maximum"):
        mgr.select(StructuredOutputsParams(json={"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99}}}))
    assert mgr.select(StructuredOutputsParams(json={"type": "object", "properties": {
        "minimum": {"type": "integer"}}})) == "outlines"  # a property named "minimum" is no bound


def test_backends_agree_on_allowed_tokens(llm):
    """Same regular language, three engines: identical allowed-token sets at random prefixes of outputs
    drawn under xgrammar. Where they differ, and why, so these specs avoid it: ``\\d`` is [0-9] in
    xgrammar but any Unicode digit in llguidance and outlines (Rust regex semantics: they also allow the
    first bytes of e.g. Arabic-Indic digits), so the specs write [0-9]; JSON schemas are not compared,
    as each backend has its own whitespace and separator rules (xgrammar's compact JSON writes ", " and
    ": ", llguidance's "," and ":"). And llguidance is stricter after a non-canonical split: after a
    lone-space token ("Ġ") it allows only what continues that tokenization plausibly (1 token where the
    others allow 4), so guidance's set must be a subset of xgrammar's, and outlines' equal to it."""
    from vllite_core.structured_output.backend import bitmask_words
    from vllite_core.structured_output.bitmask import unpack_bitmask

    eng = llm.llm_engine
    mgr = eng.core.engine_core.structured_output
    rng = random.Random(0)
    specs = [dict(regex=r"[0-9]{3}-[0-9]{4}"), dict(regex=REGEXES[1]), dict(choice=CHOICES[1]),
             dict(regex=r'\{"a": [0-9]{1,3}, "b": "(x|yy)"\}')]
    p = prompt(llm, "Answer.")
    outs = llm.generate([p] * len(specs), [so_params(48, True, i, **k) for i, k in enumerate(specs)])
    checked = same = 0
    for spec, out in zip(specs, outs):
        tokens = out.outputs[0].token_ids
        matchers = {n: mgr.backend(n).matcher(mgr.backend(n).compile(StructuredOutputsParams(**spec)))
                    for n in ("xgrammar", "guidance", "outlines")}
        stops = sorted(rng.sample(range(len(tokens)), min(4, len(tokens))))
        pos = 0
        for stop in stops:
            for tok in tokens[pos:stop]:
                assert all(m.accept_token(tok) for m in matchers.values())
            pos = stop
            masks = {}
            for n, m in matchers.items():
                bm = torch.zeros(1, bitmask_words(eng.vocab_size), dtype=torch.int32)
                m.fill_bitmask(bm, 0)
                masks[n] = unpack_bitmask(bm, eng.vocab_size)[0]
            assert masks["xgrammar"].any()
            diff = (masks["outlines"] ^ masks["xgrammar"]).nonzero().flatten().tolist()
            assert not diff, (spec, stop, diff[:10])
            extra = (masks["guidance"] & ~masks["xgrammar"]).nonzero().flatten().tolist()
            assert not extra and masks["guidance"].any(), (spec, stop, extra[:10])
            same += bool((masks["guidance"] == masks["xgrammar"]).all())
            checked += 1
    assert checked >= 12 and same >= checked // 2


@pytest.mark.slow
def test_structured_rows_leave_free_rows_unchanged(llm):
    free_prompts = [prompt(llm, f"Tell me about the number {i}.") for i in range(32)]
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free)]
    mixed_params = [so_params(12, i % 2 == 1, i, json=SCHEMAS[i % len(SCHEMAS)]) for i in range(32)] + [free] * 32
    mixed = llm.generate([prompt(llm, "JSON please.")] * 32 + free_prompts, mixed_params)
    assert [o.outputs[0].token_ids for o in mixed[32:]] == alone


def test_a_failing_compile_fails_only_its_request(llm, monkeypatch):
    mgr = llm.llm_engine.core.engine_core.structured_output
    real = mgr._compile

    def compile_or_fail(name, params, started):
        if params.regex == "b+":
            raise RuntimeError("compiler crashed")
        return real(name, params, started)

    monkeypatch.setattr(mgr, "_compile", compile_or_fail)
    p = prompt(llm, "Say yes.")
    outs = llm.generate([p] * 3, [so_params(8, False, 0, regex="b+"), so_params(8, False, 0, regex="(yes|no)"),
                                  SamplingParams(temperature=0, max_tokens=4)])
    bad, good, free = (o.outputs[0] for o in outs)
    assert bad.finish_reason == "error" and "compiler crashed" in bad.error
    assert good.text in ("yes", "no") and good.finish_reason == "stop"
    assert free.finish_reason == "length"


def test_compiled_grammars_are_cached(llm):
    mgr = llm.llm_engine.core.engine_core.structured_output
    spec = {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    before = mgr.num_compiles
    llm.generate([prompt(llm, "JSON.")] * 3, so_params(20, False, 0, json=spec))
    assert mgr.num_compiles == before + 1


@pytest.mark.parametrize("kw,field", [
    (dict(json={"type": "object"}, regex="a"), "structured_outputs.regex"),
    (dict(), "structured_outputs.json"),
    (dict(regex="(open"), "structured_outputs.regex"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="a", backend="outlines"), "structured_outputs.backend"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == field


def test_grammar_that_does_not_parse_is_refused_before_queueing(llm):
    with pytest.raises(SamplingParamsError) as e:
        llm.generate([prompt(llm, "x")], so_params(4, False, 0, grammar="root ::= (("))
    assert e.value.param == "structured_outputs.grammar" and "xgrammar:" in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_option_and_cli_flag():
    import argparse

    from vllite_core.config import ConfigError, EngineArgs
    from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["--structured-outputs-backend", "guidance"]))
    assert args.create_config().structured_outputs_config.backend == "guidance"
    with pytest.raises(ConfigError, match="structured_outputs_config"):
        EngineArgs(structured_outputs_config={"backend": "x", "bogus": 1}).create_config()


def test_bitmask_apply_matches_numpy_unpackbits():
    import numpy as np

    from vllite_core.structured_output.bitmask import apply_token_bitmask

    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    bm = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([0, 2, 4])
    out = apply_token_bitmask(logits, rows, bm)
    allowed = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for j, r in enumerate(rows.tolist()):
        assert torch.equal(out[r], torch.where(torch.from_numpy(allowed[j]), logits[r], float("-inf")))
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a grammar are untouched
    full = apply_token_bitmask(logits[:3], torch.arange(3), bm)
    assert torch.equal(full, torch.where(torch.from_numpy(allowed), logits[:3], float("-inf")))


@pytest.mark.slow
def test_preemption_and_chunked_prefill_keep_outputs_valid_and_equal(llm):
    """A KV cache too small for the batch (preemption by recompute: the matcher state must follow the
    recomputed tokens) and a 32-token step budget under long prompts (chunked prefill), with jump-forward
    on: greedy outputs validate with jsonschema and equal the unpressured engine's tokens."""
    pad = " ".join(f"item{i}" for i in range(120))  # a prompt of a few hundred tokens: several chunks
    prompts = [prompt(llm, f"{pad}\nReply with a small JSON value number {i}.") for i in range(8)]
    params = [so_params(60, False, i, json=SCHEMAS[i], disable_any_whitespace=True) for i in range(8)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # No prefix cache: the shared padding would otherwise fit the batch into the 60 blocks.
    # Jump-forward on as well: jumped tokens are computed in 32-token chunks and recomputed after preemption.
    small = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=60, max_num_batched_tokens=32,
                enable_chunked_prefill=True, enable_prefix_caching=False, jump_forward=True)
    outs = small.generate(prompts, params)
    assert small.llm_engine.core.stats().num_preemptions_total > 0
    assert small.llm_engine.core.stats().num_jump_forward_tokens > 0
    for i, out in enumerate(outs):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[i])
    assert [o.outputs[0].token_ids for o in outs] == reference


# Long fixed keys, enums and a const: stretches where the grammar allows one token only.
JF_SCHEMAS = [
    {"type": "object", "properties": {
        "customer_full_name": {"type": "string", "maxLength": 16},
        "preferred_contact_method": {"enum": ["electronic_mail_message", "telephone_call_in_the_evening"]},
        "account_status_description": {"const": "active_and_in_good_standing"}},
     "required": ["customer_full_name", "preferred_contact_method", "account_status_description"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "status_of_the_shipment": {"enum": ["delivered_to_the_recipient", "returned_to_the_sender"]},
        "number_of_parcels_in_the_shipment": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["status_of_the_shipment", "number_of_parcels_in_the_shipment"], "additionalProperties": False},
    {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "object", "properties": {"international_article_number": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
        "required": ["international_article_number"], "additionalProperties": False}},
]


@pytest.fixture(scope="module")
def llm_jf():
    return LLM(dtype="float32", max_model_len=1024, num_kv_blocks=256, max_num_seqs=16, jump_forward=True)


def _generate_counting(llm, prompts, params):
    core = llm.llm_engine.core
    before = core.stats()
    outs = llm.generate(prompts, params)
    after = core.stats()
    return (outs, after.step_times.steps - before.step_times.steps,
            after.num_jump_forward_tokens - before.num_jump_forward_tokens)


@pytest.mark.slow
def test_jump_forward_keeps_greedy_tokens_and_validates(llm, llm_jf):
    """Greedy outputs with jump-forward are token-identical to the engine without it (a token the mask
    alone allows is the one greedy picks), validate with jsonschema, take fewer steps; max_tokens holds
    (a capped request stops at exactly max_tokens, never past it); sampled children validate too."""
    p = prompt(llm, "Reply with a JSON value.")
    greedy = [so_params(120, False, i, json=s, disable_any_whitespace=True) for i, s in enumerate(JF_SCHEMAS)]
    greedy.append(so_params(21, False, 0, json=JF_SCHEMAS[0], disable_any_whitespace=True))
    ref, ref_steps, ref_jumped = _generate_counting(llm, [p] * len(greedy), greedy)
    outs, steps, jumped = _generate_counting(llm_jf, [p] * len(greedy), greedy)
    assert ref_jumped == 0 and jumped > 0
    assert steps < ref_steps
    for r, o in zip(ref, outs):
        assert list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids)
    for i, s in enumerate(JF_SCHEMAS):
        assert outs[i].outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(outs[i].outputs[0].text), s)
    capped = outs[-1].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 21
    sampled = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=JF_SCHEMAS[0], disable_any_whitespace=True))
    for c in llm_jf.generate([p], sampled)[0].outputs:
        jsonschema.validate(json.loads(c.text), JF_SCHEMAS[0])


def test_jump_forward_option_and_flag():
    import argparse

    from vllite_core.config import EngineArgs
    from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_args_from_namespace(parser.parse_args([])).create_config().structured_outputs_config.jump_forward
    args = engine_args_from_namespace(parser.parse_args(["--jump-forward"]))
    assert args.create_config().structured_outputs_config.jump_forward
    cfg = EngineArgs(structured_outputs_config={"jump_forward": True}).create_config()
    assert cfg.structured_outputs_config.jump_forward
