"""Model capabilities are declared by inheritance and checked once: the built-ins' answers, and clear errors for
a declaration without its members or a model missing the core contract."""
from __future__ import annotations

import pytest
import torch

from vllite_core.model_interfaces import (
    ModelCapabilities,
    SupportsEncoderDecoder,
    SupportsLoRA,
    SupportsMultiModal,
    model_capabilities,
)


def test_builtin_and_plugin_models_declare_what_they_are():
    from vllite_plugin_bart.bart import BartForConditionalGeneration
    from vllite_plugin_bart.florence2 import Florence2ForConditionalGeneration

    from model_registry.models.llama import LlamaForCausalLM
    from model_registry.models.whisper import WhisperForConditionalGeneration

    assert model_capabilities(LlamaForCausalLM) == ModelCapabilities(supports_lora=True, supports_tensor_parallel=True)
    assert model_capabilities(WhisperForConditionalGeneration) == ModelCapabilities(
        processes_prompts=True, is_encoder_decoder=True, supports_transcription=True, supports_tensor_parallel=True)
    assert model_capabilities(BartForConditionalGeneration) == ModelCapabilities(
        processes_prompts=True, is_encoder_decoder=True)
    assert model_capabilities(Florence2ForConditionalGeneration) == ModelCapabilities(
        processes_prompts=True, is_encoder_decoder=True, supports_multimodal=True)


class _Decoder(torch.nn.Module):
    def get_kv_cache_specs(self, block_size, dtype):
        return []

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return input_ids

    def compute_logits(self, hidden):
        return hidden

    def load_weights(self, weights):
        return set()


def test_a_declaration_without_its_members_is_refused():
    class HalfEncoderDecoder(_Decoder, SupportsEncoderDecoder):
        @classmethod
        def process_prompt(cls, prompt, ctx):
            return None

    with pytest.raises(TypeError, match="HalfEncoderDecoder declares SupportsEncoderDecoder but does not define "
                                        "get_max_model_len, encode, cross_kv"):
        model_capabilities(HalfEncoderDecoder)

    class Images(_Decoder, SupportsMultiModal):  # process_prompt is only the Protocol's stub
        pass

    with pytest.raises(TypeError, match="Images declares SupportsMultiModal but does not define process_prompt"):
        model_capabilities(Images)


def test_a_model_without_cache_specs_is_refused():
    class Old(torch.nn.Module):  # written against the contract before cache groups
        def forward(self, *args):
            return None

        def compute_logits(self, hidden):
            return hidden

        def load_weights(self, weights):
            return set()

    with pytest.raises(TypeError, match=r"Old does not define get_kv_cache_specs\(\)"):
        model_capabilities(Old)
    assert model_capabilities(_Decoder) == ModelCapabilities()


def test_supports_lora_needs_lora_targets():
    class NoTargets(_Decoder, SupportsLoRA):
        pass

    with pytest.raises(TypeError, match="SupportsLoRA but does not define lora_targets"):
        model_capabilities(NoTargets)
