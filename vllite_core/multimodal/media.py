"""Image URLs in chat messages: ``data:`` URLs always, http(s) only from domains the server allows, with a
timeout and a size cap; anything else is a MediaError naming the field."""
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
        return decode_image(_data_url_bytes(url, config, param), config, param)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, config, param), config, param)
    raise MediaError(param, f"unsupported URL scheme {scheme or '(none)'!r}: use a data: URL"
                     + (" or http(s)" if config.allowed_media_domains else ""))


def _data_url_bytes(url: str, config: MultiModalConfig, param: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(param, "a data URL must look like data:image/png;base64,...")
    if not header.startswith("image/"):
        raise MediaError(param, f"the data URL's media type {header[:-7]!r} is not an image")
    if len(payload) * 3 // 4 > config.max_media_bytes:
        raise MediaError(param, f"the image is larger than max_media_bytes={config.max_media_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(param, f"the data URL is not valid base64: {e}") from None


def _allowed(host: str, domains: list[str]) -> bool:
    host = host.lower()
    return "*" in domains or any(host == d or host.endswith("." + d) for d in domains)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a redirect could leave the allowed domains
        return None


def _fetch(url: str, config: MultiModalConfig, param: str) -> bytes:
    domains = config.allowed_media_domains
    if not domains:
        raise MediaError(param, "http(s) image URLs are off on this server (start it with "
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
        raise MediaError(param, f"fetching the image failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise MediaError(param, f"fetching the image failed: {reason}") from None
    if len(data) > cap:
        raise MediaError(param, f"the image is larger than max_media_bytes={cap}")
    return data
