"""Every error the HTTP server answers, in OpenAI's shape.

The body is always `{"error": {"message", "type", "param", "code"}}`. Request
validation (pydantic, FastAPI) answers 400, never 422; arborlm's typed errors map
to a status here, in one table, so the routes only raise. An unexpected exception
is a 500 whose message says only "internal error" and an id: its text (file
paths, torch messages, a tensor's shape) goes to the server log under that id,
never to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from arborlm.entrypoints.request_id import HEADER as REQUEST_ID_HEADER
from arborlm.entrypoints.request_id import new_request_id, request_id_of
from arborlm.errors import (
    ArborError,
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    SchedulerTimeoutError,
    ServerOverloadedError,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An HTTP error answer.

    Parameters
    ----------
    status: HTTP status code.
    message: what went wrong, for people.
    type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
    param: the offending request field, when one is.
    code: a machine-readable code (``model_not_found``, ``invalid_api_key``, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def to_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """The HTTP answer for any exception a route let escape.

    Parameters
    ----------
    exc: the exception.
    request_id: the request's id (`request_id.request_id_of`); None makes a new one
        (an error met inside a stream, where the request is out of reach).

    Returns
    -------
    The typed errors' 4xx/503, or for anything else a 500 with a generic message
    naming the id; the exception and its traceback are logged under that id.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors())
    if isinstance(exc, ServerOverloadedError):
        return APIError(503, str(exc), type="server_error", code="server_overloaded")
    if isinstance(exc, RequestAbortedError):
        return APIError(503, str(exc) or "the request was aborted", type="server_error", code="request_aborted")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead")
    if isinstance(exc, SchedulerTimeoutError):
        return APIError(503, str(exc), type="server_error", code="scheduler_timeout")
    return internal_error(exc, request_id or new_request_id())


def internal_error(exc: BaseException, request_id: str) -> APIError:
    """Log `exc` with its traceback under `request_id`; a 500 that names only the id."""
    logger.error("internal error in request %s", request_id, exc_info=exc)
    return APIError(500, f"internal server error (request id {request_id}; the details are in the server log)",
                    type="server_error", code="internal_error")


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 from pydantic's error list: the first error's location becomes `param`."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _loc_to_param(loc)
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first['msg']}", param)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _loc_to_param(loc: list[Any]) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"; pydantic's union branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in _UNION_TAGS):
            continue  # a union member tag such as "list[int]" or "function-after[...]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors, HTTP errors and stray exceptions in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        error = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    @app.exception_handler(ArborError)
    @app.exception_handler(ValidationError)
    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc, request_id_of(request)).response()

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception) -> JSONResponse:
        # Starlette answers this one outside the app's middlewares, so the header is set here.
        request_id = request_id_of(request) or new_request_id()
        response = to_api_error(exc, request_id).response()
        response.headers.setdefault(REQUEST_ID_HEADER, request_id)
        return response
