"""Checking and preparing one pooling request against the engine's pooling model."""
from __future__ import annotations

from typing import Any

from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import ProcessedPrompt
from vllite_core.pooling.params import PoolingParams
from vllite_core.pooling.token_types import plain_token_id, token_type
from vllite_core.sampling_params import SamplingParams

# What a pooling request carries where a generative one has its SamplingParams: nothing is sampled.
POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


def check_task(engine: Any, params: PoolingParams) -> str:
    cfg = engine.config.model_config.pooler_config
    task = params.task
    if cfg is None:
        raise InvalidRequestError("model", f"{engine.model_info.architecture} is a generative model: it serves "
                                  f"no pooling task{f' ({task})' if task else ''}; start it with runner='pooling'")
    task = task or cfg.task
    if task not in cfg.supported_tasks:
        raise InvalidRequestError("task", f"{task} is not supported by this model, whose task is {cfg.task} "
                                  f"(it serves {', '.join(cfg.supported_tasks)})")
    if params.dimensions is not None:
        if task not in ("embed", "token_embed"):
            raise InvalidRequestError("dimensions", f"only embeddings take dimensions, not {task}")
        hidden = int(engine.model_info.hf_config.hidden_size)
        if not cfg.is_matryoshka:
            raise InvalidRequestError("dimensions", "this model does not support matryoshka representation: "
                                      "dimensions must not be set")
        if params.dimensions > hidden:
            raise InvalidRequestError("dimensions", f"{params.dimensions} is more than the model's {hidden}")
    return task


def batch_tokenize(tokenizer: Any, prompts: list[Any]) -> list[Any]:
    """Text prompts tokenized in one call of a fast tokenizer, each as ``{"prompt": text, "prompt_token_ids":
    ids}`` (what ``encode(text)`` gives, with the special tokens): one pass through the Rust tokenizer instead of
    a Python round trip per prompt, which was most of the host time of embedding many short sentences. Other
    prompts, and empty strings (refused by the prompt check), stay as they are."""
    texts = [i for i, p in enumerate(prompts) if isinstance(p, str) and p]
    if len(texts) < 2 or not getattr(tokenizer, "is_fast", False):
        return prompts
    encoded = tokenizer([prompts[i] for i in texts], add_special_tokens=True)["input_ids"]
    out = list(prompts)
    for i, ids in zip(texts, encoded):
        out[i] = {"prompt": prompts[i], "prompt_token_ids": list(ids)}
    return out


def prepare_pooling_prompt(engine: Any, prompt: Any, params: PoolingParams, ctx: Any = None) -> ProcessedPrompt:
    """The prompt's token ids, truncated as asked, checked against the model (a typed error naming the
    field otherwise). ``ctx`` gives another thread's tokenizer."""
    from vllite_core.engine.llm_engine import parse_prompt

    check_task(engine, params)
    tokenizer = (ctx or engine.input_context).tokenizer
    if isinstance(prompt, str) and not prompt:
        raise InvalidRequestError("input", "the input is an empty string")
    text, ids = parse_prompt(prompt, tokenizer)
    limit = engine.max_model_len
    keep = params.truncate_prompt_tokens
    if keep is not None:
        if keep == -1:
            keep = limit
        if keep > limit:
            raise InvalidRequestError("truncate_prompt_tokens", f"{keep} is more than max_model_len={limit}")
        ids = ids[-keep:]
    if not ids:
        raise InvalidRequestError("input", "the input is empty")
    if len(ids) > limit:
        raise InvalidRequestError("input", f"the input has {len(ids)} tokens, more than max_model_len={limit} "
                                  "(set truncate_prompt_tokens to truncate it)")
    vocab = engine.vocab_size
    # Token types (a pair's segment B) ride in the high bits, up to the model's number of types.
    types = max(1, int(getattr(engine.model_info.hf_config, "type_vocab_size", 1) or 1))
    bad = [t for t in ids if not (0 <= plain_token_id(t) < vocab and 0 <= token_type(t) < types)]
    if bad:
        raise InvalidRequestError("prompt_token_ids", f"token id {bad[0]} is out of range [0, {vocab})")
    processed = ProcessedPrompt(prompt_token_ids=ids, prompt=text)
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        from vllite_core.engine.llm_engine import parse_cache_salt

        processed.cache_salt = parse_cache_salt(prompt)
    return processed
