"""The built-in reasoning parsers, registered through the same hook as a plugin's."""
from __future__ import annotations

from vllite_core.plugins import hookimpl
from vllite_core.reasoning.parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

VLLITE_PLUGIN_API = (1, 1)


@hookimpl
def vllite_register_reasoning_parsers() -> dict[str, type]:
    from vllite_core.reasoning.families import (
        Glm45ReasoningParser,
        GptOssReasoningParser,
        GraniteReasoningParser,
        MistralReasoningParser,
    )

    return {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser,
            "granite": GraniteReasoningParser, "mistral": MistralReasoningParser, "glm45": Glm45ReasoningParser,
            "openai_gptoss": GptOssReasoningParser}
