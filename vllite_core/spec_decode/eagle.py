"""``eagle``: an EAGLE-1 head drafts from the target's hidden states (``model_registry/models/llama_eagle.py``).

The head's row at position i reads (the token at i + 1, the target's final hidden state at i), so the
catch-up runs over the positions whose next token is known; each further draft reads the head's own
output feature. Its KV follows the target's block table like a draft model's (``model_proposer.py``).
"""
from __future__ import annotations

from typing import Any

import torch

from vllite_core.errors import ConfigError
from vllite_core.spec_decode.model_proposer import ModelProposer, check_vocab, resolve_draft


class EagleProposer(ModelProposer):
    token_shift = 1

    @classmethod
    def check_config(cls, spec_config: Any, target_hf_config: Any) -> None:
        _, head_hf = resolve_draft(spec_config)
        check_vocab(spec_config, head_hf, target_hf_config)
        hh, th = getattr(head_hf, "hidden_size", None), getattr(target_hf_config, "hidden_size", None)
        if hh != th:
            raise ConfigError(f"speculative_config.model: the EAGLE head's hidden size is {hh}, the target's {th}")

    def load_model(self, runner: Any) -> None:
        from model_registry.models.llama_eagle import load_eagle_head
        from vllite_core.attention.kv_quant import configure_kv_scales

        source, hf_config = resolve_draft(self.spec_config)
        self.head = load_eagle_head(source.path, hf_config, runner.attn_backend, runner.dtype, runner.device)
        self.target = runner.model
        configure_kv_scales(self.head, runner.kv_cache_dtype, runner.config.cache_config.calculate_kv_scales)
        self._set_layer_specs(runner, self.head.get_kv_cache_specs(runner.block_size, runner.kv_cache_dtype))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens[ids]
        return self.target.embed_input_ids(ids)

    def first_forward(self, runner: Any, ids: torch.Tensor, positions: torch.Tensor, md: Any,
                      target_rows: torch.Tensor, target_hidden: torch.Tensor, last: torch.Tensor
                      ) -> tuple[torch.Tensor, Any]:
        g = self.head(self._embed(ids), target_hidden[target_rows], positions, self.kv_caches, [md])[last]
        return self.target.compute_logits(g), g

    def next_forward(self, runner: Any, ids: torch.Tensor, positions: torch.Tensor, md: Any, state: Any,
                     keep: torch.Tensor) -> tuple[torch.Tensor, Any]:
        g = self.head(self._embed(ids), state[keep], positions, self.kv_caches, [md])
        return self.target.compute_logits(g), g
