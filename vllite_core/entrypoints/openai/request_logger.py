"""--enable-log-requests: one INFO line per engine request when it is added, as vLLM writes it
(``Received request <id>: params: <sampling params>, lora_request: <adapter>.``), and its prompt at
DEBUG, cut to --max-log-len characters / token ids."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from vllite_core.lora.request import LoRARequest
from vllite_core.pooling.params import PoolingParams
from vllite_core.sampling_params import SamplingParams

logger = logging.getLogger("vllite.requests")


@dataclass
class RequestLogger:
    max_log_len: int | None = None  # None: whole prompts in the DEBUG line

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   params: SamplingParams | PoolingParams, lora_request: LoRARequest | None) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            n = self.max_log_len
            logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s.", request_id,
                         prompt[:n] if prompt is not None and n is not None else prompt,
                         prompt_token_ids[:n] if n is not None else prompt_token_ids)
        logger.info("Received request %s: params: %s, lora_request: %s.", request_id, params, lora_request)
