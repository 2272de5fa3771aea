"""``draft_model``: a smaller model with the target's vocabulary proposes k tokens a step, one forward per
draft position for the whole batch (``model_proposer.py`` runs it)."""
from __future__ import annotations

from typing import Any

import torch

from vllite_core.spec_decode.model_proposer import ModelProposer, resolve_draft


class DraftModelProposer(ModelProposer):
    def load_model(self, runner: Any) -> None:
        from model_registry.loader import load_model
        from model_registry.registry import build_registry
        from vllite_core.attention.kv_quant import configure_kv_scales
        from vllite_core.plugins.manager import get_plugin_manager

        source, hf_config = resolve_draft(self.spec_config)
        _, model_cls = build_registry(get_plugin_manager()).resolve_for_config(hf_config)
        self.model = load_model(source, hf_config, model_cls, runner.attn_backend, runner.dtype, runner.device)
        if hasattr(self.model, "ensure_positions"):
            self.model.ensure_positions(runner.max_model_len)
        configure_kv_scales(self.model, runner.kv_cache_dtype, runner.config.cache_config.calculate_kv_scales)
        self._set_layer_specs(runner, self.model.get_kv_cache_specs(runner.block_size, runner.kv_cache_dtype))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, md: Any) -> torch.Tensor:
        return self.model(ids, positions, self.kv_caches, [md] * len(self.kv_caches))

    def first_forward(self, runner: Any, ids: torch.Tensor, positions: torch.Tensor, md: Any,
                      target_rows: torch.Tensor, target_hidden: torch.Tensor, last: torch.Tensor
                      ) -> tuple[torch.Tensor, Any]:
        return self.model.compute_logits(self._forward(ids, positions, md)[last]), None

    def next_forward(self, runner: Any, ids: torch.Tensor, positions: torch.Tensor, md: Any, state: Any,
                     keep: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.model.compute_logits(self._forward(ids, positions, md)), None
