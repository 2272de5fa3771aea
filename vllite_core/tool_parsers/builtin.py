"""The built-in tool-call parsers, registered through the same hook as a plugin's."""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 1)


@hookimpl
def vllite_register_tool_parsers() -> dict[str, type]:
    from vllite_core.tool_parsers.hermes import HermesToolParser
    from vllite_core.tool_parsers.llama3_json import Llama3JsonToolParser

    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
