"""OpenAI-style error answers: the APIError exception, its JSON body, and the app's exception handlers.

Every error the server returns has the body {"error": {"message", "type", "param", "code"}}.
`param` names the offending request field (or is null) and `code` is machine-readable; both come
from typed sources (pydantic's error location, the engine's `RequestError` event), never from
parsing message text.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.messages import EngineFatal, RequestError, RequestFailed

logger = logging.getLogger(__name__)

DEFAULT_CODE = "invalid_value"  # a 400 for a field whose value is wrong, when no more specific code applies


class APIError(Exception):
    """An error answer: HTTP status, OpenAI error type and code, the offending field, extra headers."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: Optional[str] = None,
        code: Optional[str] = None,
        err_type: str = "invalid_request_error",
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.err_type = message, status, param, code, err_type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def server_error(message: str, status: int = 500, headers: Optional[dict[str, str]] = None) -> APIError:
    return APIError(message, status, err_type="server_error", headers=headers)


def from_engine_rejection(event: RequestError, names: Optional[dict[str, str]] = None) -> APIError:
    """The engine refused a request (bad input): a 400 with the engine's field and code."""
    return api_rejection(event.message, event.param, event.code, names or {})


def api_rejection(message: str, param: Optional[str], code: Optional[str], names: dict[str, str]) -> APIError:
    """A 400 for a rejected request, naming the API's field (`names` maps the engine's field names to the API's)."""
    api_param = names.get(param, param) if param else None
    if param and api_param:
        message = message.replace(param, api_param, 1)
    return APIError(message, 400, param=api_param, code=code or DEFAULT_CODE)


def from_request_failure(event: RequestFailed) -> APIError:
    """The engine failed this request alone (its host work raised): a 500 naming the request."""
    return server_error(f"request {event.rid} failed: {event.message.splitlines()[0]}")


def from_engine_fatal(event: EngineFatal) -> APIError:
    """The engine stopped while the request was open: a 500 with the first line of its report."""
    return server_error(f"engine failed: {event.message.splitlines()[0]}")


class FieldError(ValueError):
    """A request check spanning fields (a pydantic model validator) that names the field to blame."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming the field (json_invalid: the body is not JSON)."""
    # The deepest error is the informative one: for a union field (a string or a list of strings)
    # it is the member the value got furthest into, and a wrong value beats a wrong member type.
    err: dict[str, Any] = max(errors, key=_relevance) if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    if err.get("type") == "json_invalid":
        return APIError(
            f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json"
        )
    if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return APIError("request body: must be a JSON object (send Content-Type: application/json)", code=DEFAULT_CODE)
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    raised = err.get("ctx", {}).get("error")
    if isinstance(raised, FieldError):  # a whole-request check that names its field
        return APIError(f"{raised.param}: {raised}", param=raised.param, code=DEFAULT_CODE)
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the API or not supported by specserve)"
    return APIError(f"{param}: {msg}" if param else msg, param=param, code=DEFAULT_CODE)


def _relevance(err: dict) -> tuple[int, bool]:
    return len(err.get("loc", ())), not str(err.get("type", "")).endswith("_type")


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member in an error's location (`int`, `list[constrained-str]`): not a field."""
    return isinstance(part, str) and (
        part in ("int", "float", "str", "bool", "list", "dict", "none") or any(c in part for c in "[-")
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a route raises answers in the OpenAI error format; unexpected ones as a 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(str(exc.detail), exc.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return server_error(f"internal error: {type(exc).__name__}").response()
