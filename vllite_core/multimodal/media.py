"""Image (and audio) URLs in chat messages: ``data:`` URLs always, http(s) only from domains the server allows,
with a timeout and a size cap; anything else is a MediaError naming the field."""
from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request

from vllite_core.multimodal.config import MultiModalConfig
from vllite_core.multimodal.errors import MediaError
from vllite_core.multimodal.images import decode_image

PARAM = "messages.content.image_url"


def load_image_url(url: str, config: MultiModalConfig, param: str = PARAM):
    if not isinstance(url, str) or not url:
        raise MediaError(param, "must be a non-empty URL string")
    if url.startswith("data:"):
        return decode_image(data_url_bytes(url, config, param), config, param)
    return decode_image(fetch_media(url, config, param, "image"), config, param)


def fetch_media(url: str, config: MultiModalConfig, param: str, what: str) -> bytes:
    """The bytes of an http(s) ``url`` (``what``: "image", "audio": named in the errors)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch(url, config, param, what)
    raise MediaError(param, f"unsupported URL scheme {scheme or '(none)'!r}: use a data: URL"
                     + (" or http(s)" if config.allowed_media_domains else ""))


def data_url_bytes(url: str, config: MultiModalConfig, param: str, what: str = "image") -> bytes:
    """The payload of a ``data:<what>/...;base64,`` URL."""
    header, sep, payload = url[5:].partition(",")
    example = "data:image/png;base64,..." if what == "image" else f"data:{what}/wav;base64,..."
    if not sep or not header.endswith(";base64"):
        raise MediaError(param, f"a data URL must look like {example}")
    if not header.startswith(what + "/"):
        noun = "an image" if what == "image" else what
        raise MediaError(param, f"the data URL's media type {header[:-7]!r} is not {noun}")
    return base64_payload(payload, config, param, what)


def base64_payload(payload: str, config: MultiModalConfig, param: str, what: str) -> bytes:
    """Base64 text decoded, refused over ``max_media_bytes`` before decoding."""
    if len(payload) * 3 // 4 > config.max_media_bytes:
        raise MediaError(param, f"the {what} is larger than max_media_bytes={config.max_media_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(param, f"the {what} is not valid base64: {e}") from None


def _allowed(host: str, domains: list[str]) -> bool:
    host = host.lower()
    return "*" in domains or any(host == d or host.endswith("." + d) for d in domains)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a redirect could leave the allowed domains
        return None


def _fetch(url: str, config: MultiModalConfig, param: str, what: str) -> bytes:
    domains = config.allowed_media_domains
    if not domains:
        raise MediaError(param, f"http(s) {what} URLs are off on this server (start it with "
                         "--allowed-media-domains); send a data: URL")
    host = urllib.parse.urlsplit(url).hostname or ""
    if not _allowed(host, domains):
        raise MediaError(param, f"the domain {host!r} is not in --allowed-media-domains")
    opener = urllib.request.build_opener(_NoRedirect)
    cap = config.max_media_bytes
    try:
        with opener.open(url, timeout=config.media_fetch_timeout) as resp:
            data = resp.read(cap + 1)
    except urllib.error.HTTPError as e:
        raise MediaError(param, f"fetching the {what} failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise MediaError(param, f"fetching the {what} failed: {reason}") from None
    if len(data) > cap:
        raise MediaError(param, f"the {what} is larger than max_media_bytes={cap}")
    return data
