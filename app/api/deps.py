"""Typed dependencies shared by the routers: the running service, the job service, and the two key
checks (BERT_API_KEY for inference and operations, BERT_ADMIN_KEY for /jobs and /datasets), which
share one bearer-key comparison. app/api/middleware.py's KeyMiddleware runs the same checks before a
request's body is read.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from app.errors import ServiceError
from app.jobs.imports import Imports
from app.jobs.job_service import JobService
from app.serving.service import Service
from app.settings import Settings

Credentials = HTTPAuthorizationCredentials | None
_api_bearer = HTTPBearer(auto_error=False, description="BERT_API_KEY, when the service has one.")
_admin_bearer = HTTPBearer(auto_error=False, description="BERT_ADMIN_KEY (or BERT_API_KEY when no admin key is set).")


# The dependencies are `async def`: FastAPI runs a plain `def` one in its thread pool, a thread hop
# per request for an attribute read.


async def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


async def get_job_service(request: Request) -> JobService:
    """The app's JobService, made on first use (so create_app needs nothing but the include_router lines)."""
    jobs = getattr(request.app.state, "jobs", None)
    if jobs is None:
        service = request.app.state.service
        jobs = request.app.state.jobs = JobService(service.settings, service.settings.data_dir, service.store)
    return jobs


JobServiceDep = Annotated[JobService, Depends(get_job_service)]


async def get_imports(request: Request) -> Imports:
    """The app's model imports (app/jobs/imports.py), made at start by create_app's lifespan."""
    return request.app.state.imports


ImportsDep = Annotated[Imports, Depends(get_imports)]


def api_key(settings: Settings) -> tuple[str | None, str]:
    """The key that opens inference and operations (None: open), and the refusal that names it."""
    return settings.api_key_value(), "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'"


def admin_key(settings: Settings) -> tuple[str | None, str]:
    """BERT_ADMIN_KEY opens the training routes; without one, BERT_API_KEY does; without either, open."""
    key, which = settings.admin_key_value(), "BERT_ADMIN_KEY"
    if key is None:
        key, which = settings.api_key_value(), "BERT_API_KEY"
    return key, f"missing or wrong key: send 'Authorization: Bearer <{which}>'"


def check_bearer_key(token: str | None, key: str | None, refusal: str) -> None:
    """Pass when no key is set or the bearer token equals it (compared in constant time); else 401."""
    if key is None:
        return
    if not hmac.compare_digest((token or "").encode(), key.encode()):
        raise ServiceError("unauthorized", refusal)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (as HTTPBearer reads it), else None."""
    scheme, token = get_authorization_scheme_param(authorization)
    return token if scheme.lower() == "bearer" and token else None


# The key checks proper run in app/api/middleware.py's KeyMiddleware, from the headers alone, before the
# body is read; these dependencies declare them (OpenAPI's security scheme, the middleware reads
# which key a route needs off them) and check again where the route runs.


async def require_api_key(service: ServiceDep, credentials: Annotated[Credentials, Depends(_api_bearer)]) -> None:
    """When BERT_API_KEY is set, demand `Authorization: Bearer <key>`."""
    check_bearer_key(credentials.credentials if credentials else None, *api_key(service.settings))


async def require_admin_key(service: ServiceDep, credentials: Annotated[Credentials, Depends(_admin_bearer)]) -> None:
    """BERT_ADMIN_KEY opens the training routes; without one, BERT_API_KEY does; without either, open."""
    check_bearer_key(credentials.credentials if credentials else None, *admin_key(service.settings))


# Which key each dependency demands, for the middleware.
KEY_OF = {require_api_key: api_key, require_admin_key: admin_key}
