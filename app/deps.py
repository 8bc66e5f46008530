"""Typed dependencies shared by the routers: the running service, the job service, and the two key
checks (BERT_API_KEY for inference and operations, BERT_ADMIN_KEY for /jobs and /datasets), which
share one bearer-key comparison.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import ServiceError
from .job_service import JobService
from .service import Service

Credentials = HTTPAuthorizationCredentials | None
_api_bearer = HTTPBearer(auto_error=False, description="BERT_API_KEY, when the service has one.")
_admin_bearer = HTTPBearer(auto_error=False, description="BERT_ADMIN_KEY (or BERT_API_KEY when no admin key is set).")


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


def get_job_service(request: Request) -> JobService:
    """The app's JobService, made on first use (so create_app needs nothing but the include_router lines)."""
    jobs = getattr(request.app.state, "jobs", None)
    if jobs is None:
        service = request.app.state.service
        jobs = request.app.state.jobs = JobService(service.settings, service.settings.data_dir, service.store)
    return jobs


JobServiceDep = Annotated[JobService, Depends(get_job_service)]


def check_bearer_key(credentials: Credentials, key: str | None, refusal: str) -> None:
    """Pass when no key is set or the bearer token equals it (compared in constant time); else 401."""
    if key is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ServiceError("unauthorized", refusal)


async def require_api_key(service: ServiceDep, credentials: Annotated[Credentials, Depends(_api_bearer)]) -> None:
    """When BERT_API_KEY is set, demand `Authorization: Bearer <key>`."""
    check_bearer_key(credentials, service.settings.api_key_value(),
                     "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'")


async def require_admin_key(service: ServiceDep, credentials: Annotated[Credentials, Depends(_admin_bearer)]) -> None:
    """BERT_ADMIN_KEY opens the training routes; without one, BERT_API_KEY does; without either, open."""
    settings = service.settings
    key, which = settings.admin_key_value(), "BERT_ADMIN_KEY"
    if key is None:
        key, which = settings.api_key_value(), "BERT_API_KEY"
    check_bearer_key(credentials, key, f"missing or wrong key: send 'Authorization: Bearer <{which}>'")
