"""Request: the engine's one record of a sequence, shared by the scheduler, the KV cache manager and the core."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from vllite_core.lora.request import LoRARequest
from vllite_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllite_core.core.kv_cache_utils import KVCacheBlock


class RequestStatus(enum.IntEnum):
    WAITING_FOR_FSM = -1  # waiting for its structured output grammar to compile (the scheduler skips it)
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # failed inside the engine (a fault of this request alone)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


class TokenList(Sequence[int]):
    """A read-only view of a request's token list: readers index, slice and iterate it, and only the
    request appends (through ``Request.append_output_token_ids``), so block hashes stay in step."""

    __slots__ = ("_data",)

    def __init__(self, data: list[int]) -> None:
        self._data = data

    def __getitem__(self, index):  # type: ignore[override]
        return self._data[index]

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[int]:
        return iter(self._data)

    def __eq__(self, other: object) -> bool:
        return list(self._data) == (list(other) if isinstance(other, (list, tuple, TokenList)) else other)

    def __repr__(self) -> str:
        return f"TokenList({self._data!r})"


# Called with a request whenever its tokens grow; returns the hashes of blocks that became full.
BlockHasher = Callable[["Request"], list[bytes]]


@dataclass(eq=False)
class Request:
    """The one record of a request, read by the scheduler, the KV cache manager and the engine core.

    Tokens grow only through ``append_output_token_ids``; full blocks are hashed as they fill (when the
    KV cache manager attached a ``block_hasher``). The blocks a request holds live here, one list per
    cache group (``kv_blocks``), with how many of each list are in the prefix-cache index."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    max_tokens: int = 16  # resolved from sampling_params and max_model_len by the engine
    # Encoder-decoder models: what the model's encoder consumes (opaque to the core) and its length.
    encoder_inputs: Any = None
    num_encoder_tokens: int = 0
    # Mixed into the first block's hash: requests with different salts never share cached blocks.
    cache_salt: str | None = None
    # Mixed into every block's hash (a LoRA adapter's identity, when LoRA arrives).
    block_extra_keys: tuple = ()
    # A pooling request (vllite_core.pooling): prefill only, finished with its pooled output.
    pooling_params: Any = None
    # Structured output: the request's grammar (vllite_core.structured_output.RequestGrammar), set on add.
    structured_output: Any = None
    # The LoRA adapter the request runs with, by name, id and path (each worker loads it); None: the base model.
    lora_request: LoRARequest | None = None
    # Multimodal: one vllite_core.multimodal.MultiModalFeature per image (placeholder range, content hash, pixels).
    mm_features: list = field(default_factory=list)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def __post_init__(self) -> None:
        self.status = RequestStatus.WAITING
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.all_token_ids = TokenList(self._all_token_ids)
        self.output_token_ids = TokenList(self._output_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None  # time.monotonic() of the first schedule
        # Prompt logprobs and per-token pooling are never served from the cache: recompute the whole prompt
        # (its full blocks are still cached for later requests).
        self.skip_prefix_cache = (self.sampling_params.prompt_logprobs is not None
                                  or bool(getattr(self.pooling_params, "per_token", False)))
        # Owned by the KV cache manager: blocks per cache group, and how many of each are indexed.
        self.kv_blocks: list[list[KVCacheBlock]] = []
        self.num_cached_blocks: list[int] = []
        self.block_hashes: list[bytes] = []  # of every full block, extended as tokens are appended
        self.block_hasher: BlockHasher | None = None
        # Speculative decoding: drafts to verify in the next step. They are not tokens of the request (never
        # hashed, never in all_token_ids) until verification accepts them.
        self.spec_token_ids: list[int] = []
        # Jump-forward (structured output): tokens the scheduler appended without sampling that the model
        # runner has not been told about yet (sent with the request's next schedule).
        self.jumped_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def set_block_hasher(self, hasher: BlockHasher | None) -> None:
        self.block_hasher = hasher
        if hasher is not None:
            self.block_hashes.extend(hasher(self))

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    def block_ids(self, group: int = 0) -> list[int]:
        """The request's block table in one cache group."""
        return [b.block_id for b in self.kv_blocks[group]] if self.kv_blocks else []

    def sort_key(self) -> tuple[int, float]:
        """Order under the priority policy: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)
