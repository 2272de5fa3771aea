"""Each worker's adapter cache: LoRARequest -> this rank's shard of the checked adapter.

Requests cross the executor carrying a ``LoRARequest`` (name, id, path), never tensors; every rank
reads the adapter's files itself, checks them against the whole model's layout (the API process
checked them the same way before queueing) and keeps its own slice (``sharding.py``). Adapters are
cached by ``lora_int_id`` (vLLM's rule: a new id is a new load). An adapter some row of the batch
runs with is pinned; the others are dropped least recently used first past ``max_cpu_loras``
(default ``max_loras``).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from vllite_core.config import LoRAConfig
from vllite_core.lora.adapter import LoRAAdapter, load_adapter
from vllite_core.lora.request import LoRARequest
from vllite_core.lora.sharding import full_layout, model_shards, shard_adapter

logger = logging.getLogger("vllite.lora")


class WorkerLoRACache:
    def __init__(self, model: Any, config: LoRAConfig) -> None:
        self.config = config
        self.targets, self.in_features = full_layout(model)
        self.shards = model_shards(model)
        self.capacity = config.max_cpu_loras or config.max_loras
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._pins: dict[int, int] = {}  # lora_int_id -> rows of the batch running with it
        self._removed: set[int] = set()  # removed while rows still ran with them: dropped at their last release
        self.loads = 0  # adapters read from disk

    def acquire(self, req: LoRARequest) -> LoRAAdapter:
        """This rank's shard of ``req``'s adapter, pinned until ``release``; LoRAError when it cannot load."""
        hit = self._cache.get(req.lora_int_id)
        if hit is None or hit.path != req.lora_path or req.lora_int_id in self._removed:
            self._removed.discard(req.lora_int_id)
            t0 = time.perf_counter()
            full = load_adapter(req, self.targets, self.in_features, self.config.max_lora_rank)
            hit = shard_adapter(full, self.shards)
            self._cache[req.lora_int_id] = hit
            self.loads += 1
            logger.debug("worker loaded LoRA adapter %r (id %d) in %.3fs", req.lora_name, req.lora_int_id,
                         time.perf_counter() - t0)
        self._cache.move_to_end(req.lora_int_id)
        self._pins[req.lora_int_id] = self._pins.get(req.lora_int_id, 0) + 1
        self._evict()
        return hit

    def get(self, lora_int_id: int) -> LoRAAdapter:
        """A pinned adapter (a row of the batch runs with it)."""
        return self._cache[lora_int_id]

    def release(self, lora_int_id: int) -> None:
        n = self._pins.get(lora_int_id, 0) - 1
        if n > 0:
            self._pins[lora_int_id] = n
        else:
            self._pins.pop(lora_int_id, None)
            if lora_int_id in self._removed:
                self._removed.discard(lora_int_id)
                self._cache.pop(lora_int_id, None)
        self._evict()

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded by the server): a later request with its id loads it again. Rows still
        running with it keep it until they leave."""
        if lora_int_id in self._pins:
            self._removed.add(lora_int_id)
            return True
        return self._cache.pop(lora_int_id, None) is not None

    def _evict(self) -> None:
        for int_id in [i for i in self._cache if i not in self._pins][:max(0, len(self._cache) - self.capacity)]:
            del self._cache[int_id]

    def list_loras(self) -> list[int]:
        return list(self._cache)
