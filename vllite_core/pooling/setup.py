"""Engine start for pooling: which class serves the model (vLLM's ``runner`` / ``convert``), its
PoolerConfig, and the scheduling rules that follow from it."""
from __future__ import annotations

import logging
from typing import Any

from vllite_core.config import AUTO_MAX_MODEL_LEN
from vllite_core.errors import ConfigError
from vllite_core.model_interfaces import IsPooling
from vllite_core.pooling.adapters import as_pooling_model, with_task
from vllite_core.pooling.config import PoolerConfig, apply_pooling_rules, resolve_pooler_config
from vllite_core.utils import cdiv

logger = logging.getLogger("vllite.pooling")

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")


def resolve_model_class(architecture: str, model_cls: type, runner: str, convert: str) -> type:
    if runner not in RUNNERS:
        raise ConfigError(f"runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ConfigError(f"convert: must be one of {', '.join(CONVERTS)}, got {convert!r}")
    is_pooling = IsPooling in model_cls.__mro__
    if runner == "generate":
        if is_pooling or convert not in ("auto", "none"):
            raise ConfigError(f"runner: {architecture} is served as a pooling model, not with runner='generate'")
        return model_cls
    if not (runner == "pooling" or convert in ("embed", "classify", "reward")):
        return model_cls
    if is_pooling:
        return model_cls if convert in ("auto", "none") else with_task(model_cls, convert)
    if convert == "none":
        raise ConfigError(f"convert: {architecture} is a generative model; runner='pooling' needs convert="
                          "'embed', 'classify' or 'reward' (auto: embed)")
    return as_pooling_model(model_cls, "embed" if convert == "auto" else convert)


def setup_pooling(config: Any, folder: str | None, hf_config: Any, model_cls: type) -> PoolerConfig:
    """Before the config is finalised: the PoolerConfig, the prompt-in-one-step rules, and
    sentence-transformers' ``max_seq_length`` as the default context length."""
    pooler = resolve_pooler_config(folder, hf_config, model_cls)
    mc = config.model_config
    if mc.max_model_len in (None, AUTO_MAX_MODEL_LEN) and pooler.max_seq_length:
        mc.max_model_len = pooler.max_seq_length
    apply_pooling_rules(config, pooler)
    if pooler.bidirectional:
        # Its attention plans each step from the metadata's host copies: no captured device graphs.
        config.enforce_eager = True
    mc.pooler_config = pooler
    return pooler


def size_encoder_cache(config: Any, pooler: PoolerConfig) -> None:
    """A bidirectional encoder keeps no K/V; its bookkeeping cache needs only the blocks of one full step
    (its requests finish in the step they run) and one longest prompt."""
    cc, sc = config.cache_config, config.scheduler_config
    if pooler.bidirectional and cc.num_kv_blocks is None:
        bs, max_len = cc.block_size, config.model_config.max_model_len
        cc.num_kv_blocks = cdiv(sc.max_num_batched_tokens, bs) + sc.max_num_seqs + cdiv(max_len, bs) + 1
