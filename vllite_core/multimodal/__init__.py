"""Multimodal inputs (images) for decoder models: what a prompt's media become on the request.

A model that declares ``SupportsMultiModal`` expands each image's placeholder token into as
many tokens as its encoder produces embeddings, and records one ``MultiModalFeature`` per image
on the request: where its placeholders sit in the prompt, how many there are, the content hash
that keys the encoder cache and the block hashes, and the processed pixels (opaque to the core).
"""
from __future__ import annotations

from vllite_core.multimodal.config import MultiModalConfig
from vllite_core.multimodal.errors import MediaError
from vllite_core.multimodal.features import MultiModalFeature, expand_placeholders, mm_block_keys

__all__ = ["MediaError", "MultiModalConfig", "MultiModalFeature", "expand_placeholders", "mm_block_keys"]
