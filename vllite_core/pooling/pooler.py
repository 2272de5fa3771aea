"""Pooling a request's hidden states, and the per-request finish (matryoshka cut, normalisation,
activation) that turns a model's raw pooled output into what the task returns."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from vllite_core.pooling.config import PoolerConfig
from vllite_core.pooling.params import PoolingParams


def pool_tokens(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One request's pooled state from its hidden rows (the whole prompt unless the type is LAST)."""
    if pooling_type == "LAST":
        return hidden[-1]
    if pooling_type == "CLS":
        return hidden[0]
    if pooling_type == "MEAN":
        return hidden.float().mean(dim=0).to(hidden.dtype)
    if pooling_type == "ALL":
        return hidden
    raise ValueError(f"pooling type {pooling_type!r} is not supported")


def class_activation(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities: softmax over several labels, sigmoid for a single one (as cross-encoders score)."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def finish(raw: torch.Tensor, params: PoolingParams, cfg: PoolerConfig) -> torch.Tensor:
    """The request's result on the host, in float32."""
    x = raw.float()
    task = params.task or cfg.task
    task = {"token_embed": "embed", "token_classify": "classify"}.get(task, task)  # each row as that task
    if task == "encode" and cfg.task == "embed":  # an embedding model's pooled output is its embedding
        task = "embed"
    if task == "embed":
        if params.dimensions is not None:
            x = x[..., :params.dimensions]
        if cfg.normalize if params.normalize is None else params.normalize:
            x = F.normalize(x, p=2, dim=-1)
    elif task in ("classify", "score"):
        if params.activation is None or params.activation:
            x = class_activation(x)
    elif task == "reward":
        if params.activation:
            x = class_activation(x)
    elif params.activation:  # encode on a classifier: raw logits unless asked
        x = class_activation(x)
    return x.cpu()


def pooled_outputs(model: Any, cfg: PoolerConfig, segments: list[tuple[str, torch.Tensor]],
                   params: dict[str, PoolingParams], per_token: set[str]) -> dict[str, torch.Tensor]:
    """``segments``: (request id, its hidden rows) of each request whose prompt ends in this step (the whole
    prompt for the requests in ``per_token``, pooled with ALL whatever the model's type)."""
    out: dict[str, torch.Tensor] = {}
    for all_tokens in (False, True):
        group = [(rid, h) for rid, h in segments if (rid in per_token) == all_tokens]
        if group:
            how = dataclasses.replace(cfg, pooling_type="ALL") if all_tokens else cfg
            raw = model.pool([h for _, h in group], how)
            out.update({rid: finish(r, params[rid], cfg) for (rid, _), r in zip(group, raw)})
    return out
