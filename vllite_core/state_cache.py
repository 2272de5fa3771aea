"""The state cache seen from the runner and the model: where each request's recurrent state lives.

A ``StateSpec`` layer's cache tensor is ``[num_blocks, elems]``: block ``b`` holds, side by side, the
layer's state tensors (``spec.state_shapes``) of the request that owns block ``b`` (its one block in
the state group, taken at admission, freed at finish or preemption). A state layer gets a
``StateMetadata`` where an attention layer gets ``AttentionMetadata``; the model gathers its rows,
runs the step's tokens through them (the model ops update them in place) and scatters them back. A
request whose state block is fresh (nothing computed yet: new, or recomputing after preemption)
starts from zeros, whatever the block held before.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllite_core.core.kv_cache_spec import KVCacheGroup, StateSpec
from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.state_cache")


@dataclass
class StateMetadata:
    """One step's view of a state group: the requests' token ranges and their state rows."""

    num_actual_tokens: int
    query_start_loc_cpu: list[int]  # R + 1 offsets into the flattened tokens
    state_indices: torch.Tensor  # [R] int64: each request's block in the state group
    has_initial_state: torch.Tensor  # [R] bool: False starts the request from zero state
    max_query_len: int
    any_fresh: bool = True  # some request starts from zero state (host copy: no device sync to skip zeroing)

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc_cpu) - 1


def state_tensor_shape(spec: StateSpec, num_blocks: int) -> tuple[int, int]:
    return (num_blocks, sum(math.prod(s) for s in spec.state_shapes))


def build_state_metadata(state_blocks: np.ndarray, num_computed: np.ndarray, query_start_loc: np.ndarray,
                         max_query_len: int, num_tokens: int, device: torch.device) -> StateMetadata:
    """``state_blocks`` [R]: each scheduled request's state block; ``num_computed`` [R]: tokens it had
    before this step (0: a fresh state)."""
    return StateMetadata(
        num_actual_tokens=num_tokens, query_start_loc_cpu=query_start_loc.tolist(),
        state_indices=torch.as_tensor(state_blocks.astype(np.int64), device=device),
        has_initial_state=torch.as_tensor(num_computed > 0, device=device), max_query_len=int(max_query_len),
        any_fresh=bool((num_computed == 0).any()))


class GatheredStates(list):
    """The step's requests' state tensors, ``[R, *shape]`` views into one gathered copy of their rows
    (``rows``); the ops update the views in place, so writing ``rows`` back returns every state at once."""

    rows: torch.Tensor


def gather_states(cache: torch.Tensor, md: StateMetadata, shapes: tuple[tuple[int, ...], ...]) -> GatheredStates:
    """Copies of the step's requests' state tensors, ``[R, *shape]`` each, zero for fresh requests."""
    rows = cache.index_select(0, md.state_indices)  # one contiguous copy of every state of the layer
    if md.any_fresh:
        rows.mul_(md.has_initial_state[:, None].to(rows.dtype))
    out, start = GatheredStates(), 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(rows[:, start:start + n].view(-1, *shape))
        start += n
    out.rows = rows
    return out


def scatter_states(cache: torch.Tensor, md: StateMetadata, states: GatheredStates) -> None:
    """Write the (updated in place) states back to the requests' blocks."""
    cache.index_copy_(0, md.state_indices, states.rows)


# ---- engine start-up ------------------------------------------------------------------------------

def check_state_options(config: Any, architecture: str) -> None:
    """Options a recurrent-state model cannot honour: a ConfigError naming the model and the option; prefix
    caching is turned off with a log line that names the model (a state cannot be rebuilt from cached KV)."""
    cc = config.cache_config
    if cc.enable_prefix_caching:
        logger.warning("enable_prefix_caching: %s keeps a recurrent state per request, which cannot be "
                       "prefix-cached: prefix caching is turned off", architecture)
        cc.enable_prefix_caching = False
    kv_dtype = cc.kv_cache_dtype
    if kv_dtype != "auto":
        raise ConfigError(f"kv_cache_dtype: {architecture} keeps a recurrent state (Mamba layers) that is not "
                          f"quantised; kv_cache_dtype={kv_dtype!r} is not supported for it, use 'auto'")


def limit_max_num_seqs(config: Any, groups: list[KVCacheGroup], num_blocks: int) -> None:
    """Every running request holds one block in each state group for its whole life, so at most
    ``(num_blocks - 1) // num_state_groups`` requests (the null block aside) can run at once:
    ``max_num_seqs`` is lowered to that, and the start-up log says so."""
    state = [g for g in groups if isinstance(g.spec, StateSpec)]
    if not state:
        return
    per_request = sum(g.spec.state_bytes * len(g.layers) for g in state)
    fit = (num_blocks - 1) // len(state)
    sc = config.scheduler_config
    logger.info("state cache: %d bytes of recurrent state per request (%d state layers); %d blocks hold the "
                "states of %d concurrent requests", per_request, sum(len(g.layers) for g in state), num_blocks,
                fit)
    if fit < sc.max_num_seqs:
        logger.warning("max_num_seqs lowered from %d to %d: the state cache fits no more concurrent requests",
                       sc.max_num_seqs, fit)
        sc.max_num_seqs = fit
