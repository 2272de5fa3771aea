"""The built-in model plugin: registers vllite's own architectures through the public hook."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllite_core.plugins import hookimpl

if TYPE_CHECKING:
    from model_registry.registry import ModelRegistry

VLLITE_PLUGIN_API = (1, 4)
PLUGIN_NAME = "vllite-builtin-models"

_LLAMA = "model_registry.models.llama:LlamaForCausalLM"

# One implementation covers the Llama family (Qwen2: qkv bias; Mistral: sliding window).
BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    # The dense families on the shared decoder (model_registry/models/dense.py), one short file each.
    "Qwen3ForCausalLM": "model_registry.models.qwen3:Qwen3ForCausalLM",
    "Olmo2ForCausalLM": "model_registry.models.olmo2:Olmo2ForCausalLM",
    "GraniteForCausalLM": "model_registry.models.granite:GraniteForCausalLM",
    "Glm4ForCausalLM": "model_registry.models.glm4:Glm4ForCausalLM",
    "Phi3ForCausalLM": "model_registry.models.phi3:Phi3ForCausalLM",
    "Gemma2ForCausalLM": "model_registry.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "model_registry.models.gemma:Gemma3ForCausalLM",
    "SmolLM3ForCausalLM": "model_registry.models.smollm3:SmolLM3ForCausalLM",
    "Exaone4ForCausalLM": "model_registry.models.exaone4:Exaone4ForCausalLM",
    # Pooling models (embed / classify / score; vllite_core.pooling).
    "LlamaModel": "model_registry.models.llama_pooling:LlamaEmbeddingModel",
    "Qwen2Model": "model_registry.models.llama_pooling:LlamaEmbeddingModel",
    "LlamaForSequenceClassification": "model_registry.models.llama_pooling:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "model_registry.models.llama_pooling:LlamaForSequenceClassification",
    "MistralForSequenceClassification": "model_registry.models.llama_pooling:LlamaForSequenceClassification",
    "Qwen3Model": "model_registry.models.dense_pooling:Qwen3EmbeddingModel",
    "Qwen3ForSequenceClassification": "model_registry.models.dense_pooling:Qwen3ForSequenceClassification",
    "BertModel": "model_registry.models.bert:BertModel",
    "BertForSequenceClassification": "model_registry.models.bert:BertForSequenceClassification",
    "RobertaModel": "model_registry.models.roberta:XLMRobertaModel",
    "XLMRobertaModel": "model_registry.models.roberta:XLMRobertaModel",
    "RobertaForSequenceClassification": "model_registry.models.roberta:XLMRobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": "model_registry.models.roberta:XLMRobertaForSequenceClassification",
    "ModernBertModel": "model_registry.models.modernbert:ModernBertModel",
    "ModernBertForSequenceClassification": "model_registry.models.modernbert:ModernBertForSequenceClassification",
    "GteModel": "model_registry.models.rope_bert:GteModel",
    "GteForSequenceClassification": "model_registry.models.rope_bert:GteForSequenceClassification",
    "NomicBertModel": "model_registry.models.rope_bert:NomicBertModel",
    # Multimodal decoders: images in the prompt.
    "LlavaForConditionalGeneration": "model_registry.models.llava:LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "model_registry.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "model_registry.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "model_registry.models.idefics3:Idefics3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "model_registry.models.mistral3:Mistral3ForConditionalGeneration",
    "InternVLForConditionalGeneration": "model_registry.models.internvl:InternVLForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "model_registry.models.gemma3_mm:Gemma3ForConditionalGeneration",
    # State-space models and hybrids: a per-request recurrent state (vllite_core/state_cache.py).
    "MambaForCausalLM": "model_registry.models.mamba:MambaForCausalLM",
    "FalconMambaForCausalLM": "model_registry.models.mamba:FalconMambaForCausalLM",
    "Mamba2ForCausalLM": "model_registry.models.mamba2:Mamba2ForCausalLM",
    "JambaForCausalLM": "model_registry.models.jamba:JambaForCausalLM",
    "Lfm2ForCausalLM": "model_registry.models.lfm2:Lfm2ForCausalLM",
    "NemotronHForCausalLM": "model_registry.models.nemotron_h:NemotronHForCausalLM",
    "GraniteMoeHybridForCausalLM": "model_registry.models.granite_moe_hybrid:GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM": "model_registry.models.falcon_h1:FalconH1ForCausalLM",
    "Zamba2ForCausalLM": "model_registry.models.zamba2:Zamba2ForCausalLM",
    # Mixtures of experts (model_registry/models/moe_decoder.py and one short file per family).
    "MixtralForCausalLM": "model_registry.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "model_registry.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "model_registry.models.qwen_moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "model_registry.models.olmoe:OlmoeForCausalLM",
    "GraniteMoeForCausalLM": "model_registry.models.granite_moe:GraniteMoeForCausalLM",
    "DeepseekV2ForCausalLM": "model_registry.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "model_registry.models.deepseek:DeepseekV3ForCausalLM",
    "GptOssForCausalLM": "model_registry.models.gpt_oss:GptOssForCausalLM",
    # Encoder-decoder: speech in, text out.
    "WhisperForConditionalGeneration": "model_registry.models.whisper:WhisperForConditionalGeneration",
}


@hookimpl
def vllite_register_models(registry: "ModelRegistry") -> None:
    for architecture, target in BUILTIN_MODELS.items():
        registry.register(architecture, target, plugin=PLUGIN_NAME)
