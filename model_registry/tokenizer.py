"""Tokenizer loading, with a disk cache for tokenizers converted from GGUF.

Converting a GGUF vocabulary into a fast tokenizer takes transformers several
seconds (SmolLM2: ~5-7 s on two cores) while loading the saved result takes a
few hundred milliseconds, so the converted tokenizer is saved once under
``$VLLITE_CACHE_DIR`` (default ``~/.cache/vllite``), keyed by the file's path,
size and mtime and the transformers version.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from model_registry.source import ModelNotFoundError, ModelSource, open_gguf, resolve_model_source

logger = logging.getLogger("vllite.model_registry")

_COMPLETE_MARKER = ".vllite-complete"


def cache_dir() -> Path:
    """vllite's on-disk cache root."""
    env = os.environ.get("VLLITE_CACHE_DIR")
    if env:
        return Path(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(os.path.expanduser(xdg)) / "vllite" if xdg else Path.home() / ".cache" / "vllite"


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None, trust_remote_code: bool = False) -> Any:
    """The tokenizer for ``source``, or the one at ``tokenizer_path`` (a folder or a .gguf file) when given."""
    from transformers import AutoTokenizer

    if tokenizer_path is not None:
        try:
            source = resolve_model_source(tokenizer_path, weights=False)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"tokenizer: {e}") from None
        if source.kind == "hf":  # a folder with config.json: tokenizer files live next to it
            return AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    elif source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    return _load_gguf_tokenizer(source)


def _cache_key(gguf_path: str) -> str:
    import transformers

    st = os.stat(gguf_path)
    raw = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _load_gguf_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    assert source.gguf_file is not None
    target = cache_dir() / "tokenizers" / _cache_key(source.gguf_file)
    if (target / _COMPLETE_MARKER).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(target))
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("cached tokenizer at %s is unreadable (%s); converting again", target, e)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_name)
    if not getattr(tokenizer, "chat_template", None):
        template = open_gguf(source).metadata.get("tokenizer.chat_template")
        if template:
            tokenizer.chat_template = str(template)
    _save_to_cache(tokenizer, target)
    return tokenizer


def _save_to_cache(tokenizer: Any, target: Path) -> None:
    """Save atomically (write to a temp folder, then rename) so concurrent processes never see half a tokenizer."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the converted tokenizer under %s: %s", target.parent, e)
