"""A causal LM used as a pooling model (vLLM's ``convert``): the decoder runs unchanged, its final normed
hidden state is pooled (the last token by default, as gte-Qwen2 / Qwen3-Embedding do), and a
``score`` head (``*ForSequenceClassification`` checkpoints; ``num_labels`` = 1 for a reward model) maps
it to class logits. The language-model head is dropped."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllite_core.model_interfaces import IsPooling
from vllite_core.pooling.pooler import pool_tokens

_HEAD_NAMES = ("score.weight", "classifier.weight")


class _CausalPooling:
    pooling_task = "embed"
    default_pooling_type = "LAST"
    is_bidirectional = False

    def __init__(self, hf_config: Any, attn_backend: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config, attn_backend, dtype)  # type: ignore[call-arg]
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

        def body() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in ("lm_head.weight", "lm_head"):
                    continue
                if name in _HEAD_NAMES:
                    head.append(tensor)
                    continue
                yield name, tensor

        loaded = super().load_weights(body())  # type: ignore[misc]
        loaded.discard("lm_head")
        if self.score is not None and head:
            if tuple(head[0].shape) != tuple(self.score.shape):
                raise ValueError(f"weight score.weight: checkpoint shape {tuple(head[0].shape)} does not match "
                                 f"the model's {tuple(self.score.shape)}")
            with torch.no_grad():
                self.score.copy_(head[0])
            loaded.add("score")
        return loaded


def as_pooling_model(model_cls: type, task: str) -> type:
    """``model_cls`` (a causal LM engine model) serving ``task``: embed, classify or reward."""
    suffix = {"embed": "EmbeddingModel", "classify": "ForSequenceClassification", "reward": "ForReward"}[task]
    base = model_cls.__name__.removesuffix("ForCausalLM")
    # IsPooling last: a Protocol base before nn.Module would take over __init__.
    return type(f"{base}{suffix}", (_CausalPooling, model_cls, IsPooling),
                {"pooling_task": task, "__module__": model_cls.__module__})


def with_task(model_cls: type, task: str) -> type:
    """A pooling class serving another task with the same head (convert="reward" on a one-label classifier)."""
    if model_cls.pooling_task == task:
        return model_cls
    return type(f"{model_cls.__name__}As{task.title()}", (model_cls,), {"pooling_task": task,
                                                                          "__module__": model_cls.__module__})
