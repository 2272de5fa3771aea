"""The built-in structured output backends, registered through the same hook as a plugin's."""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 1)


@hookimpl
def vllite_register_structured_output_backends() -> dict[str, type]:
    from vllite_core.structured_output.guidance_backend import GuidanceBackend
    from vllite_core.structured_output.outlines_backend import OutlinesBackend
    from vllite_core.structured_output.xgrammar_backend import XgrammarBackend

    return {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend, "outlines": OutlinesBackend}
