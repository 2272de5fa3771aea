"""The built-in proposers, registered through the same hook as a plugin's."""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 2)


@hookimpl
def vllite_register_spec_proposers() -> dict[str, object]:
    from vllite_core.spec_decode.draft_model import DraftModelProposer
    from vllite_core.spec_decode.eagle import EagleProposer
    from vllite_core.spec_decode.ngram import NgramProposer

    return {"ngram": NgramProposer, "draft_model": DraftModelProposer, "eagle": EagleProposer}
