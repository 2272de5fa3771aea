"""Models from the Hugging Face Hub: a repo id becomes a local folder of the files the engine reads.

Downloads go through ``huggingface_hub``'s own ``snapshot_download`` / ``hf_hub_download``, so
resuming a partial file, checking its size, the cache layout, ``HF_ENDPOINT``, ``HF_TOKEN``,
``HF_HUB_OFFLINE`` and the progress bar are the hub library's. A file lands in the cache only once
it is complete (the library writes ``*.incomplete`` and renames it), and a snapshot is returned only
when every requested file is there, so nothing half-downloaded is used.

What is fetched: the config, tokenizer and generation-config files plus the weights (the shards a
safetensors index names, else every top-level ``*.safetensors``, else ``pytorch_model*.bin``), or
exactly one GGUF file: named (``gguf_file``) or picked by quant (``org/name-GGUF:Q4_K_M``).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from model_registry.source import ModelNotFoundError

logger = logging.getLogger("vllite.model_registry")

# Exact top-level names (no subfolders): what configs, tokenizers and chat templates are made of.
METADATA_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
]
SAFETENSORS_INDEX = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(ModelNotFoundError):
    """A model asked for by repo id cannot be had from the Hub (or its cache); the message says why."""


class HubRepoNotFoundError(HubError):
    """No such repo (or a private one the token cannot see)."""


class HubRevisionNotFoundError(HubError):
    """The repo exists; the revision (branch, tag or commit) does not."""


class HubAccessError(HubError):
    """The Hub refused access (401/403): a gated or private repo without a (valid) token."""


class HubFileNotFoundError(HubError):
    """A named file (``gguf_file``), or a file matching a GGUF quant, is not in the repo."""


class ModelNotCachedError(HubError):
    """Offline (``HF_HUB_OFFLINE=1``) and the model's files are not all in the local cache."""


@dataclass(frozen=True)
class HubModelRef:
    """``org/name`` with an optional llama.cpp-style ``:QUANT`` suffix."""

    repo_id: str
    quant: str | None = None


def parse_repo_ref(model: str) -> HubModelRef | None:
    """``model`` as a Hub reference, or None when it does not look like one (local paths never do)."""
    if model.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(model)):
        return None
    repo_id, _, quant = model.partition(":")
    if not _REPO_ID.match(repo_id) or (quant and not re.fullmatch(r"[\w.-]+", quant)):
        return None
    return HubModelRef(repo_id, quant or None)


@dataclass(frozen=True)
class Downloaded:
    """Where the files are: the snapshot folder, and the GGUF file inside it for a GGUF model."""

    folder: str
    gguf_file: str | None = None


def download_model(ref: HubModelRef, revision: str | None = None, download_dir: str | None = None,
                   gguf_file: str | None = None, weights: bool = True) -> Downloaded:
    """Fetch (or, offline, find in the cache) what the engine needs of ``ref``. ``weights=False``: only the
    config and tokenizer files (a tokenizer given by repo id)."""
    where = ref.repo_id + (f"@{revision}" if revision else "")
    try:
        if gguf_file is None and ref.quant is not None:
            gguf_file = _pick_quant(ref, revision, download_dir, where)
        if gguf_file is not None:
            return _download_gguf(ref.repo_id, gguf_file, revision, download_dir)
        folder = _snapshot(ref.repo_id, revision, download_dir, METADATA_FILES)
        if not (Path(folder) / "config.json").is_file():
            ggufs = [f for f in _repo_files(ref.repo_id, revision, download_dir) if f.lower().endswith(".gguf")]
            if len(ggufs) == 1:
                return _download_gguf(ref.repo_id, ggufs[0], revision, download_dir)
            if ggufs:
                raise HubFileNotFoundError(
                    f"model {where!r} holds several GGUF files ({', '.join(sorted(ggufs))}): pick one with "
                    f"{ref.repo_id}:QUANT (e.g. :Q4_K_M) or --gguf-file NAME")
            raise HubFileNotFoundError(f"model {where!r} has neither config.json nor a .gguf file")
        if weights:
            folder = _snapshot(ref.repo_id, revision, download_dir, _weight_patterns(folder))
            _fallback_to_bin(ref.repo_id, revision, download_dir, folder)
        return Downloaded(folder)
    except HubError:
        raise
    except Exception as e:
        raise _typed_error(e, where) from e


def pick_gguf_file(files: list[str], quant: str, where: str) -> str:
    """The one GGUF file whose name ends in ``QUANT.gguf`` (after ``-``, ``_`` or ``.``), case-insensitively."""
    pattern = re.compile(rf"(^|[-_.]){re.escape(quant)}\.gguf$", re.IGNORECASE)
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    hits = [f for f in ggufs if pattern.search(os.path.basename(f))]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        have = ", ".join(ggufs) if ggufs else "none"
        raise HubFileNotFoundError(f"model {where!r}: no GGUF file matches quant {quant!r} (GGUF files: {have})")
    raise HubFileNotFoundError(f"model {where!r}: quant {quant!r} matches several GGUF files ({', '.join(hits)}); "
                               f"pick one with --gguf-file NAME")


def _pick_quant(ref: HubModelRef, revision: str | None, download_dir: str | None, where: str) -> str:
    from huggingface_hub import constants

    files = _repo_files(ref.repo_id, revision, download_dir)
    try:
        return pick_gguf_file(files, ref.quant or "", where)
    except HubFileNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotCachedError(f"{e}; HF_HUB_OFFLINE=1: only the files in the local cache were "
                                      "searched") from None
        raise


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download

    logger.info("fetching %s (revision %s): %s", repo_id, revision or "main", ", ".join(patterns[:4])
                + (" ..." if len(patterns) > 4 else ""))
    return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns)


def _download_gguf(repo_id: str, filename: str, revision: str | None, download_dir: str | None) -> Downloaded:
    from huggingface_hub import hf_hub_download

    logger.info("fetching %s (revision %s): %s", repo_id, revision or "main", filename)
    path = hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir)
    return Downloaded(os.path.dirname(path), path)


def _weight_patterns(folder: str) -> list[str]:
    index = Path(folder) / SAFETENSORS_INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["*.safetensors"]


def _fallback_to_bin(repo_id: str, revision: str | None, download_dir: str | None, folder: str) -> None:
    """A repo without safetensors: its PyTorch ``pytorch_model*.bin`` files instead."""
    if not any(Path(folder).glob("*.safetensors")):
        _snapshot(repo_id, revision, download_dir, ["pytorch_model*.bin"])


def _repo_files(repo_id: str, revision: str | None, download_dir: str | None) -> list[str]:
    """The repo's file names: from the Hub, or (offline) those of the cached snapshot."""
    from huggingface_hub import HfApi, constants

    if not constants.HF_HUB_OFFLINE:
        return HfApi().list_repo_files(repo_id, revision=revision)
    snapshot = _cached_snapshot(repo_id, revision, download_dir)
    if snapshot is None:
        raise ModelNotCachedError(f"model {repo_id!r} (revision {revision or 'main'}) is not in the local cache and "
                                  f"HF_HUB_OFFLINE=1 forbids downloading it: download it once online, or unset "
                                  f"HF_HUB_OFFLINE")
    return [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]


def _cached_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path | None:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(download_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    revision = revision or "main"
    ref = storage / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _typed_error(e: Exception, where: str) -> HubError:
    """The hub library's exception as one of ours, naming the repo / revision / file and what to do."""
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):  # before RepositoryNotFoundError: it is one
        return HubAccessError(f"model {where!r} is gated: accept its terms on the Hub and set HF_TOKEN to a token "
                              f"of an account with access ({_status(e)})")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubRevisionNotFoundError(f"model {where!r}: revision not found on the Hub ({_status(e)})")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubRepoNotFoundError(f"model {where!r} not found on the Hub: check the repo id; a private repo needs "
                                    f"HF_TOKEN ({_status(e)})")
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return HubFileNotFoundError(f"model {where!r}: file not found in the repo ({_status(e)})")
    if isinstance(e, errors.HfHubHTTPError) and _code(e) in (401, 403):
        return HubAccessError(f"model {where!r}: the Hub refused access ({_status(e)}); set HF_TOKEN to a valid "
                              f"token with access to the repo")
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return ModelNotCachedError(f"model {where!r} is not (completely) in the local cache and the Hub cannot be "
                                   f"used (HF_HUB_OFFLINE=1, or no connection): {e}")
    return HubError(f"model {where!r}: download failed: {type(e).__name__}: {e}")


def _code(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _status(e: Exception) -> str:
    code = _code(e)
    return f"HTTP {code}" if code is not None else type(e).__name__
