"""The typed error of bad media input (an InvalidRequestError: HTTP 400 naming the field)."""
from __future__ import annotations

from vllite_core.errors import InvalidRequestError


class MediaError(InvalidRequestError):
    """An image that cannot be used: undecodable bytes, over the pixel cap, too many, an unsupported modality,
    a URL that may not or could not be fetched. ``param`` names the request field at fault."""
