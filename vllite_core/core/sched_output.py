"""What the scheduler decided for one step: the only thing the model runner receives."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllite_core.lora.request import LoRARequest
from vllite_core.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or lost at preemption): everything to rebuild it."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (a resumed request re-prefills its outputs)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # the block table of each cache group
    num_computed_tokens: int
    eos_token_id: int | None = None
    # Encoder-decoder: the encoder runs in the step that admits the request.
    encoder_inputs: Any = None
    num_encoder_tokens: int = 0
    pooling_params: Any = None  # a pooling request's PoolingParams (it samples nothing)
    lora_request: LoRARequest | None = None  # the adapter by name, id and path (None: the base model)
    mm_features: list = field(default_factory=list)  # vllite_core.multimodal.MultiModalFeature per image


@dataclass
class CachedRequestData:
    """A request already in the runner's batch: only what changed."""

    req_id: str
    new_block_ids: list[list[int]]  # blocks appended to each cache group's table
    num_computed_tokens: int
    # Tokens the scheduler appended without the runner sampling them (jump-forward), to append to its copy.
    new_token_ids: list[int] = field(default_factory=list)
    # Pipeline stages: the tokens this step computes (positions num_computed_tokens on); the stages that do
    # not sample learn the sampled ones here (None with one stage).
    token_ids: list[int] | None = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # the step's {request_id: num_tokens}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # finished/aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: the draft tokens scheduled (after the known tokens) per request, to verify.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured output: allowed tokens of the structured requests that sample (structured_output.GrammarBitmask).
    grammar_bitmask: Any = None
    # Multimodal: images whose encoder runs in this step (MultiModalFeature, data included), and the content
    # hashes the runner's encoder cache drops before that.
    scheduled_encoder_inputs: list = field(default_factory=list)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
