"""OpenAI request fields -> SamplingParams.

One place decides what the server accepts: fields SamplingParams has are passed
on (and validated there, so the 400 names the field); options vllite does not
implement yet are refused by name rather than silently ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol import _SamplingRequest
from vllite_core.sampling_params import SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}

# request field -> (SamplingParams field, the value that means "off")
_OPTIONAL = {
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "logit_bias": ("logit_bias", None),
    "bad_words": ("bad_words", None),
    "allowed_token_ids": ("allowed_token_ids", None),
}


def to_sampling_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                       defaults: dict[str, Any] | None = None) -> SamplingParams:
    """``defaults``: the model's generation-config values (``LLMEngine.default_sampling_params``) for the
    fields the request leaves unset; its max_tokens caps the request's, as in vLLM."""
    defaults = defaults or {}
    if defaults.get("max_tokens") is not None:
        max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
    kw: dict[str, Any] = dict(
        n=req.n, temperature=_pick(req.temperature, defaults, "temperature", 1.0),
        top_p=_pick(req.top_p, defaults, "top_p", 1.0), seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
        min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens, spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, best_of=req.best_of,
        logits_processors=req.logits_processors)
    for name in ("top_k", "min_p"):
        value = _pick(getattr(req, name), defaults, name, None)
        if value is not None:
            kw[name] = value
    for name, (field, off) in _OPTIONAL.items():
        value = getattr(req, name)
        if value is None and name in defaults:
            value = defaults[name]
        if value is None or value == off or (off is None and not value):
            continue
        if field not in _PARAM_FIELDS:
            raise bad_request(f"{name} is not supported by this server yet", name, "unsupported_parameter")
        if name == "logit_bias":
            try:
                value = {int(k): v for k, v in value.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids", name) from None
        kw[field] = value
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    return SamplingParams(**kw)


def _pick(value: Any, defaults: dict[str, Any], name: str, neutral: Any) -> Any:
    """The request's value; unset, the model's default; else the neutral one."""
    if value is not None:
        return value
    return defaults.get(name, neutral)
