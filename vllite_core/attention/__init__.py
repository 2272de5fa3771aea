"""The attention-backend contract between models and platforms."""
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
