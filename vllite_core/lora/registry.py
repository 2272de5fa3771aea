"""The frontend's adapter checks: LoRARequest -> checked LoRAAdapter, at most ``max_cpu_loras`` kept.

Requests are validated before they are queued, so a bad adapter is refused there (a typed
``LoRAError``) and rarely reaches the step; the adapter's file digest becomes the request's
prefix-cache identity. Only the ``LoRARequest`` goes on to the engine core: each worker loads its
own shard (``worker_cache.py``). Checked adapters are cached by ``lora_int_id`` (vLLM's rule: a new
id is a new load), against the whole model's layout (``sharding.full_layout``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from vllite_core.config import LoRAConfig
from vllite_core.lora.adapter import LoRAAdapter, load_adapter
from vllite_core.lora.errors import LoRAError
from vllite_core.lora.request import LoRARequest

logger = logging.getLogger("vllite.lora")


def layer_widths(module: Any) -> tuple[int, int]:
    """(out, in) features of a target layer on this rank: ``local_features`` where the layer keeps them
    (model_registry's parallel linears, whose ``weight`` may be int8 values or GGUF blocks), else its
    weight's shape (a plain ``nn.Linear``)."""
    widths = getattr(module, "local_features", None)
    return tuple(widths) if widths is not None else tuple(module.weight.shape)


class LoRARegistry:
    def __init__(self, layout: tuple[dict, dict], config: LoRAConfig) -> None:
        self.config = config
        self.targets, self.in_features = layout
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.load_times: dict[str, float] = {}  # adapter name -> seconds of its last load from disk

    def resolve(self, lora_request: Any) -> LoRAAdapter:
        """The adapter for a request (loaded once per ``lora_int_id``), or LoRAError naming what is wrong."""
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(str(getattr(lora_request, "lora_name", lora_request)), "lora_request",
                            f"must be a LoRARequest, got {type(lora_request).__name__}")
        with self._lock:
            hit = self._cache.get(lora_request.lora_int_id)
            if hit is not None:
                if hit.name != lora_request.lora_name:
                    raise LoRAError(lora_request.lora_name, "lora_int_id",
                                    f"{lora_request.lora_int_id} is already adapter {hit.name!r}")
                self._cache.move_to_end(lora_request.lora_int_id)
                return hit
            t0 = time.perf_counter()
            adapter = load_adapter(lora_request, self.targets, self.in_features, self.config.max_lora_rank)
            self.load_times[adapter.name] = time.perf_counter() - t0
            self._cache[adapter.int_id] = adapter
            while len(self._cache) > (self.config.max_cpu_loras or self.config.max_loras):
                self._cache.popitem(last=False)
            logger.info("loaded LoRA adapter %r (id %d, rank %d, %d layers) in %.3fs", adapter.name, adapter.int_id,
                        adapter.rank, len(adapter.modules), self.load_times[adapter.name])
            return adapter

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._cache.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        with self._lock:
            return list(self._cache)
