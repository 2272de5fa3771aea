"""The built-in tool-call parsers, registered through the same hook as a plugin's."""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 1)


@hookimpl
def vllite_register_tool_parsers() -> dict[str, type]:
    from vllite_core.tool_parsers.deepseek import DeepSeekV3ToolParser
    from vllite_core.tool_parsers.hermes import HermesToolParser
    from vllite_core.tool_parsers.llama3_json import Llama3JsonToolParser
    from vllite_core.tool_parsers.mistral import MistralToolParser
    from vllite_core.tool_parsers.openai_harmony import OpenAIToolParser
    from vllite_core.tool_parsers.pythonic import PythonicToolParser
    from vllite_core.tool_parsers.tagged_json import GraniteToolParser
    from vllite_core.tool_parsers.xml_calls import Glm45ToolParser, Qwen3CoderToolParser

    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
            "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser, "glm45": Glm45ToolParser,
            "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV3ToolParser, "granite": GraniteToolParser,
            "openai": OpenAIToolParser}
