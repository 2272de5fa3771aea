"""A causal LM used as a pooling model (vLLM's ``convert``): the decoder runs unchanged, its final normed
hidden state is pooled (the last token by default, as gte-Qwen2 / Qwen3-Embedding do), and a
``score`` head (``*ForSequenceClassification`` checkpoints; ``num_labels`` = 1 for a reward model) maps
it to class logits. The language-model head is dropped; with ``classifier_from_token`` the head is made from
some of its rows (``vllite_core.pooling.from_token``: Qwen3-Reranker's yes/no)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllite_core.model_interfaces import IsPooling
from vllite_core.pooling.from_token import token_classifier
from vllite_core.pooling.pooler import pool_tokens

_HEAD_NAMES = ("score.weight", "classifier.weight")


class _CausalPooling:
    pooling_task = "embed"
    default_pooling_type = "LAST"
    is_bidirectional = False

    uses_token_classifier = True  # classifier_from_token builds the score head (load_weights)

    def __init__(self, hf_config: Any, attn_backend: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config, attn_backend, dtype)  # type: ignore[call-arg]
        self.from_token = token_classifier(hf_config) if self.pooling_task != "embed" else None
        del self.lm_head  # a pooling model has no language-model head (tied or not)
        self.score: nn.Parameter | None = None
        if self.pooling_task != "embed":
            labels = 1 if self.pooling_task == "reward" else int(getattr(hf_config, "num_labels", 2))
            self.num_labels = labels
            self.score = nn.Parameter(torch.empty(labels, hf_config.hidden_size, dtype=dtype), requires_grad=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Class logits from pooled states (an embedding model: the states themselves)."""
        if self.score is None:
            return hidden_states.float()
        return (hidden_states @ self.score.t()).float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        pooled = [pool_tokens(h, cfg.pooling_type) for h in hidden]
        if self.score is None:
            return pooled
        return [self.compute_logits(p) for p in pooled]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head: list[torch.Tensor] = []
        lm_rows: dict[str, torch.Tensor] = {}  # classifier_from_token: the tokens' rows of the LM head / embedding
        ids = list(self.from_token.token_ids) if self.from_token is not None else None

        def body() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ids is not None and (name == "lm_head.weight" or name.endswith("embed_tokens.weight")):
                    lm_rows["lm_head" if name.startswith("lm_head") else "embed"] = tensor[ids].clone()
                if name in ("lm_head.weight", "lm_head"):
                    continue
                if name in _HEAD_NAMES:
                    head.append(tensor)
                    continue
                yield name, tensor

        loaded = super().load_weights(body())  # type: ignore[misc]
        loaded.discard("lm_head")
        if self.from_token is not None and self.score is not None:
            rows = lm_rows.get("lm_head", lm_rows.get("embed"))  # a tied LM head is the embedding
            if rows is None:
                raise ValueError("classifier_from_token: the checkpoint has no lm_head.weight or embedding to "
                                 "take the tokens' rows from")
            head = [self.from_token.head(rows.float()).to(self.score.dtype)]
        if self.score is not None and head:
            if tuple(head[0].shape) != tuple(self.score.shape):
                raise ValueError(f"weight score.weight: checkpoint shape {tuple(head[0].shape)} does not match "
                                 f"the model's {tuple(self.score.shape)}")
            with torch.no_grad():
                self.score.copy_(head[0])
            loaded.add("score")
        return loaded


# Adapted classes are made at run time; each is named by a key that this module's ``__getattr__`` rebuilds it
# from, so pickle finds the same class by reference in any process (the engine core sends its model class to
# the front end): "as_<task>:<module with / for .>:<class>" and "with_<task>:<module>:<class>".
_MADE: dict[str, type] = {}


def _key(kind: str, task: str, model_cls: type) -> str:
    return f"{kind}_{task}:{model_cls.__module__.replace('.', '/')}:{model_cls.__qualname__}"


def as_pooling_model(model_cls: type, task: str) -> type:
    """``model_cls`` (a causal LM engine model) serving ``task``: embed, classify or reward."""
    key = _key("as", task, model_cls)
    if key not in _MADE:
        suffix = {"embed": "EmbeddingModel", "classify": "ForSequenceClassification", "reward": "ForReward"}[task]
        base = model_cls.__name__.removesuffix("ForCausalLM")
        # IsPooling last: a Protocol base before nn.Module would take over __init__.
        _MADE[key] = type(f"{base}{suffix}", (_CausalPooling, model_cls, IsPooling),
                          {"pooling_task": task, "__module__": __name__, "__qualname__": key})
    return _MADE[key]


def with_task(model_cls: type, task: str) -> type:
    """A pooling class serving another task with the same head (convert="reward" on a one-label classifier)."""
    if model_cls.pooling_task == task:
        return model_cls
    key = _key("with", task, model_cls)
    if key not in _MADE:
        _MADE[key] = type(f"{model_cls.__name__}As{task.title()}", (model_cls,),
                          {"pooling_task": task, "__module__": __name__, "__qualname__": key})
    return _MADE[key]


def __getattr__(name: str) -> type:
    """An adapted class by its key (see ``_MADE``), made here if this process has not made it yet."""
    kind_task, sep, rest = name.partition(":")
    kind, _, task = kind_task.partition("_")
    module, sep2, qualname = rest.partition(":")
    if not (sep and sep2) or kind not in ("as", "with"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    base = getattr(importlib.import_module(module.replace("/", ".")), qualname)
    return as_pooling_model(base, task) if kind == "as" else with_task(base, task)
