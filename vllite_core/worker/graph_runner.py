"""Padded-batch graph dispatch for the model forward.

``ModelForward`` stands where the model runner used to call ``self.model(...)``.
After the KV cache exists, ``capture()`` asks the platform
(``Platform.capture_graphs``) for a runner per decode batch size; from then on a
decode-only step (one token per request) of ``n`` requests is padded up to the
smallest captured size ``>= n`` (``vllite_core.platforms.graphs``: padded requests
write their K/V nowhere and read the null block), run through that size's
runner, and the first ``n`` rows of its output returned. Every other step
(prefill, chunked prefill, mixed, larger than the largest size) runs eagerly, and
so does every step of a model with more than one cache group (sliding window
beside full attention, cross attention): the platform contract captures one
metadata for all layers. ``enforce_eager`` or a platform that captures nothing
leaves it a plain pass-through.

It also keeps counters (graph vs eager steps, capture time and memory) that
``vllite bench`` reports. The capture memory comes after the KV cache was sized,
out of the ``1 - gpu_memory_utilization`` headroom, as in vLLM V1 before its
estimate moved into the profile run.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.platforms.graphs import capture_sizes, decode_inputs, pad_decode_inputs, pick_batch_size
from vllite_core.utils import cdiv

logger = logging.getLogger("vllite.graphs")


class ModelForward:
    def __init__(self, model: torch.nn.Module, attn_backend: AttentionBackend, num_layers: int) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.num_layers = num_layers
        self.runners: dict[int, Any] = {}
        self.sizes: list[int] = []
        self.capture_s: float | None = None
        self.capture_bytes = 0  # device memory the graphs took beyond the KV cache (where the platform measures)
        self.graph_steps = 0
        self.eager_steps = 0
        self.lora: Any = None  # the runner's LoRASlots when LoRA is on

    # ---- set-up ------------------------------------------------------------------------------
    def capture(self, platform: Any, config: Any, kv_caches: list[torch.Tensor], num_groups: int, block_size: int,
                max_model_len: int, device: torch.device, model_read_caches: bool = False) -> None:
        """Ask the platform for decode runners (nothing under ``enforce_eager``, with several cache groups, with
        LoRA on unless every adapted layer's op reads the step's mapping from device tensors alone
        (``ModelOps.lora_graph_safe``: each graph then reads its own mapping buffers, refilled before each
        replay), nor with ``calculate_kv_scales``: a capture would measure its dummy batch and bake the
        scales in, nor for models with a recurrent state: the capture's dummy inputs are attention metadata, nor
        with ``model_read_caches``: layers that read their own cache (MLA, sinks) plan from the metadata's host
        lists, which a replay would not refresh)."""
        lora = self.lora if config.lora_config is not None else None
        if (config.enforce_eager or not kv_caches or num_groups != 1 or (lora is not None and not lora.graph_safe)
                or config.cache_config.calculate_kv_scales or config.model_config.capabilities.is_stateful
                or model_read_caches):
            return
        sizes = capture_sizes(config.scheduler_config.max_num_seqs)
        max_blocks = cdiv(max_model_len, block_size)
        model, num_layers = self.model, self.num_layers

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    metadata: AttentionMetadata) -> torch.Tensor:
            if lora is not None:
                lora.use_static(int(input_ids.shape[0]))
            return model(input_ids, positions, kv_caches, [metadata] * num_layers)

        t0 = time.perf_counter()
        runners = platform.capture_graphs(
            forward, sizes, lambda bs: decode_inputs(bs, max_blocks, kv_caches, block_size, device), config)
        self.capture_s = time.perf_counter() - t0
        if lora is not None:
            lora.clear_step()
        self.runners = dict(runners or {})
        self.sizes = sorted(self.runners)
        self.capture_bytes = sum(int(getattr(r, "memory_bytes", 0)) for r in self.runners.values())
        if self.runners:
            logger.info("graphs: %d decode batch sizes (%s) captured in %.1fs, %.0f MiB", len(self.sizes),
                        _span(self.sizes), self.capture_s, self.capture_bytes / 2**20)

    # ---- the step ----------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 layer_metadata: list[AttentionMetadata]) -> torch.Tensor:
        if self.runners:  # one cache group: every layer has the same metadata
            metadata = layer_metadata[0]
            n = int(input_ids.shape[0])
            if metadata.max_query_len == 1 and n == metadata.num_reqs:
                bs = pick_batch_size(n, self.sizes)
                if bs is not None:
                    if bs > n:
                        inputs = pad_decode_inputs(input_ids, positions, metadata, bs)
                        self.attn_backend.prepare(inputs["metadata"])
                    else:
                        inputs = {"input_ids": input_ids, "positions": positions, "metadata": metadata}
                    if self.lora is not None:
                        self.lora.fill_static(bs)  # this step's adapters into the graph's mapping buffers
                    hidden = self.runners[bs](kv_caches=kv_caches, **inputs)
                    self.graph_steps += 1
                    return hidden[:n]
        self.eager_steps += 1
        return self.model(input_ids, positions, kv_caches, layer_metadata)

    def describe(self) -> dict[str, Any]:
        return {"captured_sizes": _span(self.sizes) if self.sizes else "none (eager)",
                "capture_s": self.capture_s, "capture_MiB": round(self.capture_bytes / 2**20, 1),
                "graph_steps": self.graph_steps, "eager_steps": self.eager_steps}


def _span(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return ",".join(map(str, sizes))
    return f"{sizes[0]},{sizes[1]},{sizes[2]},...,{sizes[-1]}"
