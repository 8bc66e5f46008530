"""One error type for the whole service, mapped to HTTP status codes in one place.

Every failure answers `{"error": message, "error_type": kind}`: ServiceError raised anywhere,
FastAPI's request validation (422), routing misses (404/405) and unexpected exceptions (500).
Pattern after text-embeddings-inference's router (one ErrorType -> StatusCode table).
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("bertserve")

ErrorKind = Literal["validation", "overloaded", "not_found", "unavailable", "unauthorized", "too_large",
                    "insufficient_storage", "internal"]

STATUS: dict[str, int] = {
    "validation": 422,
    "overloaded": 429,
    "not_found": 404,
    "unavailable": 503,
    "unauthorized": 401,
    "too_large": 413,
    "insufficient_storage": 507,  # the data directory's disk is full (a dataset upload)
    "internal": 500,
}
assert set(ErrorKind.__args__) == set(STATUS)


class JobProgress(BaseModel):
    """The training job a 503 is waiting on (a model that a job is still producing)."""

    id: str
    state: str
    step: int
    total_steps: int
    status_url: str


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: str
    error_type: ErrorKind
    job: JobProgress | None = None  # only on 503s for a model that a job is still training


class ServiceError(Exception):
    def __init__(self, kind: str, message: str, **details):
        assert kind in STATUS, kind
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.details = details  # extra fields of the body, declared in ErrorResponse

    @property
    def status_code(self) -> int:
        return STATUS[self.kind]


def error_body(kind: str, message: str, **details) -> dict:
    return {"error": message, "error_type": kind, **details}


def error_response(kind: str, message: str, status: int | None = None, headers: dict | None = None,
                   **details) -> JSONResponse:
    if kind == "unauthorized":
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    if kind == "overloaded":  # a full queue drains within moments
        headers = {"Retry-After": "1", **(headers or {})}
    return JSONResponse(error_body(kind, message, **details), status_code=status or STATUS[kind], headers=headers)


def responses(*kinds: str) -> dict:
    """OpenAPI `responses=` entries for the error kinds a route can answer."""
    return {STATUS[k]: {"model": ErrorResponse, "description": k.replace("_", " ")} for k in kinds}


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "invalid")
            parts.append(f"the body is not valid JSON: {detail} (character {err['loc'][-1]})")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return error_response(exc.kind, exc.message, **exc.details)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response("validation", _describe_validation(exc))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Errors raised by routing and by the framework itself (404, 405, unparsable bodies)."""
    code = exc.status_code
    if code == 404:
        return error_response("not_found", f"no route {request.url.path}")
    if code == 405:  # the path exists, this method does not: still "no such operation"
        message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response("not_found", message, status=405, headers=exc.headers)
    if code == 400:  # FastAPI's answer to a body it cannot decode (not UTF-8): a validation error
        return error_response("validation", "the body is not valid JSON (it must be UTF-8 text)")
    kind = next((k for k, s in STATUS.items() if s == code), "validation" if code < 500 else "internal")
    return error_response(kind, str(exc.detail), status=code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response("internal", "internal server error")


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
