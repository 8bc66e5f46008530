"""Typed dependencies shared by the routers: the running service, the job service, the scope each
router demands of the request's key (inference, jobs, batch, admin, metrics, or any key) and the request's
key itself. app/api/middleware.py's KeyMiddleware runs the same checks before a request's body is read;
the keys are app/keys/keyring.py's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from app.jobs.catalog import Catalog
from app.jobs.imports import Imports
from app.jobs.job_service import JobService
from app.keys.keyfile import Key
from app.keys.keyring import ANONYMOUS, ANY
from app.serving.service import Service

Credentials = HTTPAuthorizationCredentials | None
CALLER_KEY = "bertserve.key"  # the ASGI scope's entry for the request's key (KeyMiddleware sets it)


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
        settings, mining = service.settings, request.app.state.mining
        jobs = request.app.state.jobs = JobService(settings, settings.data_dir, service.registry, mining)
    return jobs


JobServiceDep = Annotated[JobService, Depends(get_job_service)]


async def get_catalog(request: Request) -> Catalog:
    """The app's Catalog (promote and delete models and datasets), sharing the JobService's submission lock."""
    catalog = getattr(request.app.state, "catalog", None)
    if catalog is None:
        jobs = await get_job_service(request)
        catalog = request.app.state.catalog = Catalog(jobs.settings, jobs.data_dir, jobs.records, jobs.submit_lock)
    return catalog


CatalogDep = Annotated[Catalog, Depends(get_catalog)]


async def get_imports(request: Request) -> Imports:
    """The app's model imports (app/jobs/imports.py), made at start by create_app's lifespan."""
    return request.app.state.imports


ImportsDep = Annotated[Imports, Depends(get_imports)]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (as HTTPBearer reads it), else None."""
    scheme, token = get_authorization_scheme_param(authorization)
    return token if scheme.lower() == "bearer" and token else None


# The key checks proper run in app/api/middleware.py's KeyMiddleware, from the headers alone, before the
# body is read; these dependencies declare them (OpenAPI's security scheme, the middleware reads
# which scope a route needs off them) and check again where the route runs.


def _requiring(scope: str, bearer: HTTPBearer) -> Callable[[Request, Credentials], Awaitable[None]]:
    # (a default rather than Annotated: the annotations are strings, and `bearer` is this closure's)
    async def require(request: Request, credentials: Credentials = Depends(bearer)) -> None:  # noqa: B008
        token = credentials.credentials if credentials else None
        request.app.state.keyring.authorize(token, scope, f"{request.method} {request.url.path}")

    require.__doc__ = f"Demand a key with the scope '{scope or 'any'}' (when the service has keys)."
    return require


def _bearer(scope: str) -> HTTPBearer:
    what = f"a key with the scope '{scope}'" if scope else "any key"
    return HTTPBearer(auto_error=False, scheme_name=f"key-{scope or 'any'}", description=f"{what.capitalize()}.")


require_inference = _requiring("inference", _bearer("inference"))
require_jobs = _requiring("jobs", _bearer("jobs"))
require_batch = _requiring("batch", _bearer("batch"))
require_admin = _requiring("admin", _bearer("admin"))
require_metrics = _requiring("metrics", _bearer("metrics"))
require_key = _requiring(ANY, _bearer(ANY))

# Which scope each dependency demands, for the middleware.
SCOPE_OF = {
    require_inference: "inference",
    require_jobs: "jobs",
    require_batch: "batch",
    require_admin: "admin",
    require_metrics: "metrics",
    require_key: ANY,
}


async def get_caller(request: Request) -> Key:
    """The key of the request (KeyMiddleware found it); `anonymous` where no key is needed."""
    return request.scope.get(CALLER_KEY, ANONYMOUS)


CallerDep = Annotated[Key, Depends(get_caller)]
