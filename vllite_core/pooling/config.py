"""How a pooling model pools: the task it serves, the pooling type, normalisation, and what that means
for scheduling. Read once at engine start from the model class and the checkpoint folder (a
sentence-transformers ``modules.json`` / ``1_Pooling/config.json`` / ``Normalize`` module wins over the
class's defaults, as in sentence-transformers itself)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllite.pooling")

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")
# The engine tasks each model task serves (LLM.encode serves any model with its raw pooled output).
TASKS_OF = {"embed": ("embed", "encode"), "classify": ("classify", "score", "encode"),
            "reward": ("reward", "encode")}


@dataclass(frozen=True)
class PoolerConfig:
    task: str  # the model's task: "embed" | "classify" | "reward"
    pooling_type: str  # "CLS" | "MEAN" | "LAST" | "ALL"
    normalize: bool  # embeddings: L2-normalised unless a request says otherwise
    bidirectional: bool  # every token sees the whole prompt (BERT)
    is_matryoshka: bool = False  # accepts `dimensions` below its hidden size
    max_seq_length: int | None = None  # sentence-transformers' limit (sentence_bert_config.json)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        # Per-token logits need a head that maps each token alone: a causal model's score head.
        token = {"embed": ("token_embed",), "classify": () if self.bidirectional else ("token_classify",)}
        return TASKS_OF[self.task] + token.get(self.task, ())

    @property
    def needs_whole_prompt(self) -> bool:
        """A causal model pooling its last token or every token can be chunked: the runner keeps each chunk's
        rows until the prompt is complete (ALL), or the last chunk holds the pooled state (LAST)."""
        return self.bidirectional or self.pooling_type not in ("LAST", "ALL")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# sentence-transformers' pooling modes that vllite pools as: its name -> ours.
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


def _pooling_modes(cfg: dict[str, Any]) -> list[str]:
    """The pooling modes of a 1_Pooling/config.json: sentence-transformers 6 writes ``"pooling_mode": "mean"``
    (a list when several are concatenated); earlier versions one boolean per mode (``pooling_mode_mean_tokens``)."""
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        return [mode]
    if isinstance(mode, list):
        return [str(m) for m in mode]
    legacy = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
    return [name for key, name in legacy.items() if cfg.get(key)]


def _sentence_transformers(folder: Path) -> tuple[str | None, bool | None, int | None]:
    """(pooling type, normalize, max_seq_length) from a sentence-transformers folder; None where unsaid."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None, None, None
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            cfg = _read_json(folder / m.get("path", "") / "config.json") or {}
            modes = _pooling_modes(cfg)
            if len(modes) != 1 or modes[0] not in _ST_MODES:
                raise ValueError(f"{folder}: sentence-transformers pooling {modes} is not supported "
                                 "(one of cls, mean or lasttoken)")
            pooling = _ST_MODES[modes[0]]
    st = _read_json(folder / "sentence_bert_config.json") or {}
    return pooling, normalize, st.get("max_seq_length")


def resolve_pooler_config(folder: str | None, hf_config: Any, model_cls: type) -> PoolerConfig:
    task = model_cls.pooling_task
    pooling = model_cls.default_pooling_type
    normalize = task == "embed"
    max_seq = None
    if folder and Path(folder).is_dir():
        st_pooling, st_normalize, max_seq = _sentence_transformers(Path(folder))
        if st_pooling is not None:
            pooling, normalize = st_pooling, bool(st_normalize) and task == "embed"
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions",
                                                                             None))
    cfg = PoolerConfig(task=task, pooling_type=pooling, normalize=normalize,
                       bidirectional=bool(model_cls.is_bidirectional), is_matryoshka=matryoshka,
                       max_seq_length=int(max_seq) if max_seq else None)
    logger.info("pooling model: task %s, %s pooling%s%s", task, pooling, ", normalized" if normalize else "",
                ", bidirectional" if cfg.bidirectional else "")
    return cfg


def apply_pooling_rules(config: Any, pooler: PoolerConfig) -> None:
    """Scheduling rules a pooling model needs, applied before the engine is sized."""
    cc, sc = config.cache_config, config.scheduler_config
    if pooler.needs_whole_prompt and (sc.enable_chunked_prefill or cc.enable_prefix_caching):
        why = "bidirectional attention" if pooler.bidirectional else f"{pooler.pooling_type} pooling"
        logger.warning("pooling model with %s needs every prompt in one step: chunked prefill and prefix caching "
                       "are turned off", why)
        sc.enable_chunked_prefill = False
        cc.enable_prefix_caching = False
    elif pooler.pooling_type == "ALL" and cc.enable_prefix_caching:
        # Every request wants each token's state, which a cache hit skips: lookups would never be used.
        logger.warning("pooling model with ALL pooling: prefix caching is turned off")
        cc.enable_prefix_caching = False
