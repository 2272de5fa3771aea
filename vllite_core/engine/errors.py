"""The request errors, kept importable from here (``vllite_core.errors`` defines them)."""
from vllite_core.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, RequestFailedError

__all__ = ["EngineDeadError", "InvalidRequestError", "PromptTooLongError", "RequestFailedError"]
