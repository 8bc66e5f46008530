"""One error type for the whole service, mapped to HTTP status codes in one place.

Every failure answers `{"error": message, "error_type": error_type}`: ServiceError raised anywhere,
FastAPI's request validation (422), routing misses (404/405) and unexpected exceptions (500). On
/v1/* paths (OpenAI's API) the same failure, with the same status, answers in OpenAI's shape instead,
`{"error": {"message", "type", "param", "code"}}`, so OpenAI's client libraries raise their own errors
(openai.NotFoundError, ...) with our message; `type` is invalid_request_error (4xx) or server_error (5xx).
An unknown field of a request names the known field it looks like, if one does (`suggest_fields`).
429 and 503 say when to come back (Retry-After); 405 lists every method the path has (Allow), and
OPTIONS on a path that exists answers 204 with that list. Bodies carry our own words only: an
unexpected exception's text stays in the log, and a path on the server is told by its place in
DATA_DIR (`without_data_dir`).

The service's log lines quote what requests sent (paths, names, file names): `escape_for_log` keeps each
record one line, so a path with %0A in it cannot forge a line; `OneLine` applies it to every record of
the `bertserve` logger (both live in worker/telemetry/logs.py, with the log formats).
Pattern after text-embeddings-inference's router (one ErrorType -> StatusCode table).
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, TypeAdapter
from pydantic.fields import FieldInfo
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.telemetry.logs import OneLine

log = logging.getLogger("bertserve")


def without_data_dir(message: str, data_dir: Path) -> str:
    """`message` with the paths below DATA_DIR made relative to it (`models/x`), and DATA_DIR itself
    called so: where the server keeps its files is not the client's business."""
    for prefix in sorted({str(data_dir).rstrip("/"), str(Path(data_dir).resolve()).rstrip("/")}, key=len, reverse=True):
        whole = rf"(?<![\w./-]){re.escape(prefix)}"  # the path itself, not a longer one that holds its text
        message = re.sub(rf"{whole}/", "", message)
        message = re.sub(rf"{whole}(?![\w.-])", "DATA_DIR", message)
    return message


ONE_LINE = OneLine()
log.addFilter(ONE_LINE)  # every module of app/ logs through `bertserve` (the model registry adds it to its own)

ErrorType = Literal[
    "validation",
    "overloaded",
    "not_found",
    "method_not_allowed",
    "conflict",
    "unavailable",
    "unauthorized",
    "forbidden",
    "too_large",
    "insufficient_storage",
    "insufficient_memory",
    "internal",
]

STATUS: dict[str, int] = {
    "validation": 422,
    "overloaded": 429,
    "not_found": 404,
    "method_not_allowed": 405,  # the path exists, this method does not
    "conflict": 409,  # the request needs a state the resource has left (cancelling a finished job)
    "unavailable": 503,
    "unauthorized": 401,
    "forbidden": 403,  # a known key without the scope (or the model) the request needs
    "too_large": 413,
    "insufficient_storage": 507,  # the data directory's disk is full (a dataset upload)
    "insufficient_memory": 507,  # a model larger than the model memory budget (less the pinned models)
    "internal": 500,
}
assert set(get_args(ErrorType)) == set(STATUS)

# Retry-After (seconds, RFC 9110 section 10.2.3) on every answer with these statuses: a full queue
# drains within a second or so; a model that is loading, still training or a service that is
# starting or stopping takes longer.
RETRY_AFTER_S = {429: 1, 503: 5}


class JobProgress(BaseModel):
    """The job making a model that is not there yet (a 503's `job`, /ready's `mlm_job`): one still producing
    it, or the cancelled or failed one that was to (app/serving/model_jobs.py)."""

    id: str
    model_name: str = Field(description="The model it makes.")
    state: str
    step: int
    total_steps: int
    phase: str | None = Field(
        description="What it does before its first step report, e.g. 'tokenising the corpus: 1,048,576 of "
        "4,825,178 bytes read'; null once it reports steps, and when it is not running."
    )
    eta_s: float | None = Field(
        description="Seconds to go at the pace of its latest step report; null before its first one, and when it "
        "is not running."
    )
    status_url: str


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: str
    error_type: ErrorType
    job: JobProgress | None = None  # only on 503s for a model a job is still making (or, cancelled or failed, did not)


OPENAI_PREFIX = "/v1/"  # paths that answer errors in OpenAI's shape
# OpenAI's `code` for our error types (the others keep our name): on /v1/* a route's not_found is always an
# unknown model; a routing miss is unknown_url, as OpenAI's own API answers.
OPENAI_CODES: dict[str, str | None] = {
    "not_found": "model_not_found",
    "unauthorized": "invalid_api_key",
    "overloaded": "rate_limit_exceeded",
    "validation": None,  # OpenAI names the field at fault in `param` instead
}


class OpenAIError(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None = Field(None, description="The request field at fault, when one is.")
    code: str | None = Field(description="model_not_found, unknown_url, invalid_api_key, rate_limit_exceeded, or ours.")


class OpenAIErrorResponse(BaseModel):
    """The body of every error answer on /v1/* (OpenAI's API shape)."""

    error: OpenAIError


class ServiceError(Exception):
    def __init__(
        self, error_type: str, message: str, *, headers: Mapping[str, str] | None = None, **details: Any
    ) -> None:
        assert error_type in STATUS, error_type
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.headers = headers  # e.g. a rate limit's own Retry-After
        self.details = details  # extra fields of the body, declared in ErrorResponse

    @property
    def status_code(self) -> int:
        return STATUS[self.error_type]


def error_body(error_type: str, message: str, **details: Any) -> dict:
    return {"error": message, "error_type": error_type, **details}


def openai_error_body(
    error_type: str, message: str, status: int, param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error body: `code` by default from OPENAI_CODES (else our error type)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = code if code is not None else OPENAI_CODES.get(error_type, error_type)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    error_type: str,
    message: str,
    status: int | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    path: str = "",
    openai: Mapping[str, str | None] | None = None,
    **details: Any,
) -> JSONResponse:
    """The answer to a failure on `path`: our body, or OpenAI's on /v1/* (`openai` may set its param and code)."""
    status = status or STATUS[error_type]
    headers = dict(headers or {})
    if error_type == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    if status in RETRY_AFTER_S:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S[status]))
    if path.startswith(OPENAI_PREFIX):
        body = openai_error_body(error_type, message, status, **(openai or {}))
    else:
        body = error_body(error_type, message, **details)
    return JSONResponse(body, status_code=status, headers=headers)


def responses(*error_types: str, openai: bool = False) -> dict:
    """OpenAPI `responses=` entries for the error types a route can answer (openai: a /v1/* route's). A
    route behind a key (unauthorized) also answers a key without its scope (forbidden) and a key over
    its request rate (overloaded)."""
    model = OpenAIErrorResponse if openai else ErrorResponse
    if "unauthorized" in error_types:
        error_types = tuple(dict.fromkeys([*error_types, "forbidden", "overloaded"]))
    return {STATUS[k]: {"model": model, "description": k.replace("_", " ")} for k in error_types}


def suggest_fields(errors: Sequence[Mapping[str, Any]], schema: Any, under: tuple = ()) -> list[dict]:
    """pydantic's `errors` for a value of type `schema` found at `under` in their locs, with the known field
    that an unknown one (extra_forbidden) is a misspelling of named in its message: `max_step: Extra inputs
    are not permitted (did you mean 'max_steps'?)`."""
    adapter: TypeAdapter | None = None
    out = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden" and loc[: len(under)] == under and len(loc) > len(under):
            adapter = adapter or TypeAdapter(schema)
            fields = _fields_at(adapter.core_schema, loc[len(under) : -1], {})
            close = difflib.get_close_matches(str(loc[-1]), fields or [], n=1)
            if close:
                err = {**err, "msg": f"{err['msg']} (did you mean '{close[0]}'?)"}
        out.append(dict(err))
    return out


def _fields_at(schema: Mapping[str, Any], loc: tuple, defs: dict) -> list[str] | None:
    """The field names of the model at `loc` in a value that pydantic's core `schema` validates (the schema
    its errors' locs follow), or None where no model is."""
    kind = schema["type"]
    if kind == "definitions":
        defs = {**defs, **{d["ref"]: d for d in schema["definitions"]}}
    elif kind == "definition-ref":
        target = defs.get(schema["schema_ref"])
        return _fields_at(target, loc, defs) if target is not None else None
    elif kind == "model-fields":
        names = {f.get("validation_alias") or name: f for name, f in schema["fields"].items()}
        if not loc:
            return list(names)
        return _fields_at(names[loc[0]]["schema"], loc[1:], defs) if loc[0] in names else None
    elif kind == "tagged-union":  # the loc names the tag
        return _fields_at(schema["choices"][loc[0]], loc[1:], defs) if loc and loc[0] in schema["choices"] else None
    elif kind == "union":  # the loc names the choice (a model's by its class name), else the first that has loc
        choices = [c if isinstance(c, tuple) else (c, _model_name(c, defs)) for c in schema["choices"]]
        named = [c for c, label in choices if loc and label == loc[0]] or [c for c, _ in choices]
        return next((f for c in named if loc and (f := _fields_at(c, loc[1:], defs)) is not None), None)
    elif kind in ("list", "set", "frozenset", "dict"):  # the loc names the item (index or key)
        items = schema.get("items_schema") or schema.get("values_schema")
        return _fields_at(items, loc[1:], defs) if items and loc else None
    return _fields_at(schema["schema"], loc, defs) if "schema" in schema else None


def _model_name(schema: Mapping[str, Any], defs: dict) -> str | None:
    """The label pydantic gives a union's choice that is a model: its class name."""
    if schema["type"] == "definition-ref":
        schema = defs.get(schema["schema_ref"], schema)
    return schema["cls"].__name__ if schema["type"] == "model" else None


# What a JSON route makes of a body sent without a JSON Content-Type (curl -d's default is a form's): no object.
NOT_AN_OBJECT = {"model_attributes_type", "dict_type", "model_type"}


def _describe_validation(errors: Sequence[Mapping[str, Any]], content_type: str = "") -> str:
    parts = []
    for err in errors:
        if tuple(err.get("loc", ())) == ("body",) and err.get("type") in NOT_AN_OBJECT and "json" not in content_type:
            sent = content_type.split(";")[0].strip() or "none"
            parts.append(
                f"the body must be a JSON object sent with the header 'Content-Type: application/json' (this request's "
                f"Content-Type: {sent}; with curl, add -H 'Content-Type: application/json')"
            )
            continue
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "invalid")
            parts.append(f"the body is not valid JSON: {detail} (character {err['loc'][-1]})")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if not loc and err.get("type") == "invalid":  # a whole-body check that names its own place
            parts.append(err["msg"])
            continue
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    details = dict(exc.details)
    openai = details.pop("openai", None)  # OpenAI's param and code, for /v1/* (e.g. file_not_found)
    return error_response(
        exc.error_type, exc.message, headers=exc.headers, path=request.url.path, openai=openai, **details
    )


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    body = getattr(request.scope.get("route"), "body_field", None)  # FastAPI's field for the route's JSON body
    if body is not None:
        errors = suggest_fields(errors, _body_type(body.field_info), under=("body",))
    loc = [p for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
    param = str(loc[0]) if loc else None  # OpenAI's `param`: the request field at fault
    message = _describe_validation(errors, request.headers.get("content-type", ""))
    return error_response("validation", message, path=request.url.path, openai={"param": param})


def _body_type(info: FieldInfo) -> Any:
    """The type a route's body is validated as: its annotation, with the discriminator of a tagged union."""
    return (
        Annotated[info.annotation, Field(discriminator=info.discriminator)] if info.discriminator else info.annotation
    )


def allowed_methods(request: Request) -> list[str]:
    """Every method some route answers on this path (the router's own 405 names one route's only)."""
    methods = {"OPTIONS"}
    for route in request.app.state.routes:  # app/main.py: every route of the app
        if route.path_regex.match(request.url.path):
            methods |= route.methods
    return sorted(methods)


def _unparsable_body(exc: StarletteHTTPException) -> str:
    """FastAPI answers 400 to a body json.loads raised on other than a syntax error: say which."""
    if isinstance(exc.__cause__, RecursionError):
        return "the body is not valid JSON for this service: it is nested too deeply"
    if isinstance(exc.__cause__, UnicodeDecodeError):
        return "the body is not valid JSON (it must be UTF-8 text)"
    return "the body cannot be parsed as JSON"


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Errors raised by routing and by the framework itself (404, 405, unparsable bodies)."""
    code, path = exc.status_code, request.url.path
    if code == 404:
        return error_response("not_found", f"no route {path}", path=path, openai={"code": "unknown_url"})
    if code == 405:
        allow = {"Allow": ", ".join(allowed_methods(request))}
        if request.method == "OPTIONS":  # what this path answers to (RFC 9110 section 9.3.7)
            return Response(status_code=204, headers=allow)
        message = f"method {request.method} is not allowed on {path}"
        return error_response("method_not_allowed", message, headers=allow, path=path)
    if code == 400:  # FastAPI's answer to a body it cannot decode: a validation error
        return error_response("validation", _unparsable_body(exc), path=path)
    error_type = next((k for k, s in STATUS.items() if s == code), "validation" if code < 500 else "internal")
    return error_response(error_type, str(exc.detail), status=code, headers=exc.headers, path=path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response("internal", "internal server error", path=request.url.path)


def install_handlers(app: FastAPI) -> None:
    # Starlette types a handler as taking any Exception; these take the one they are registered for.
    app.add_exception_handler(ServiceError, _service_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
