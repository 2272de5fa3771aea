"""The server's one error translation: every exception a route raises becomes a JSON error in the
shape of the API its path belongs to (Anthropic's under /v1/messages, OpenAI's elsewhere), and the
server keeps serving. Registered once on the app (``install``)."""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from vllite_core.entrypoints.openai.errors import APIError, bad_request, from_exception
from vllite_core.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from vllite_core.sampling_params import SamplingParamsError

logger = logging.getLogger("vllite.server")

# The engine's typed request errors (from_exception maps them): handled where the route raised them.
TYPED_ERRORS: tuple[type[Exception], ...] = (APIError, InvalidRequestError, SamplingParamsError, EngineDeadError,
                                             RequestFailedError)


def route_path(scope: Scope) -> str:
    """The path the app routes on: without the ``--root-path`` prefix a proxy may have left on it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def error_response_for(path: str, err: APIError) -> Response:
    """``err`` in the shape of the API ``path`` belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    if path.startswith("/v1/messages"):
        from vllite_core.entrypoints.anthropic.protocol import error_response

        return error_response(err)
    return err.response()


def as_api_error(exc: Exception) -> APIError:
    """Any exception as the APIError the client gets: typed engine errors -> 4xx / 503, the rest 500."""
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail))
    if isinstance(exc, RequestValidationError):
        return bad_request(str(exc))
    return from_exception(exc)


async def translate(request: Request, exc: Exception) -> Response:
    err = as_api_error(exc)
    if isinstance(exc, (APIError, StarletteHTTPException, RequestValidationError)):
        pass  # the server's own refusals: the answer says it all
    elif err.code == "request_failed":  # the engine logged the cause already; no traceback here
        logger.error("%s", err.message)
    elif err.status >= 500 and isinstance(exc, TYPED_ERRORS):
        logger.exception("request failed", exc_info=exc)
    # (an untyped exception is logged by uvicorn, with its traceback, after this answer)
    return error_response_for(route_path(request.scope), err)


def install(app: FastAPI) -> None:
    """Register ``translate`` for every exception a route can raise."""
    for kind in (*TYPED_ERRORS, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(kind, translate)
