"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes goes through ``APIError`` so clients (the openai
package among them) see the same body whatever went wrong, and the server keeps
serving.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 503: "server_error", 504: "server_error", 500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        headers.update(self.headers or {})
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_exception(exc: BaseException) -> APIError:
    """Map the engine's typed request errors (they carry ``.param``) to 400s."""
    from vllite_core.engine.async_llm import EngineDeadError
    from vllite_core.errors import EngineSleepingError, InvalidRequestError, PromptTooLongError, RequestFailedError
    from vllite_core.sampling_params import SamplingParamsError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), exc.param, "context_length_exceeded")
    if isinstance(exc, (InvalidRequestError, SamplingParamsError)):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, EngineSleepingError):
        return APIError(503, str(exc), code="engine_sleeping")
    if isinstance(exc, RequestFailedError):  # this request alone failed in the engine; the rest go on
        msg = exc.message
        if msg.startswith("structured_outputs") and "compile" in msg:
            # the request's own constraint did not compile (or not within compile_timeout_s): a 400
            code = "grammar_compile_timeout" if "did not compile in" in msg else "grammar_compile_failed"
            return APIError(400, str(exc), msg.split(":", 1)[0], code)
        return APIError(500, str(exc), code="request_failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
