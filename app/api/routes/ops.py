"""Operations: /health, /ready (open), /metrics (behind the API key unless BERT_METRICS_PUBLIC),
/info, /docs and /openapi.json (behind the API key)."""

import importlib.metadata
import platform

import torch
from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from app.api.deps import JobServiceDep, ServiceDep
from app.api.routes.usage import count_job_seconds
from app.errors import JobProgress, ServiceError, responses
from app.schemas.ops import HealthResponse, InfoResponse, ReadyResponse
from app.serving import model_jobs
from model.compute import kernels

router = APIRouter(tags=["operations"])
protected = APIRouter(tags=["operations"])  # app/main.py adds the key (any scope)
metrics_router = APIRouter(tags=["operations"])  # app/main.py adds the key unless BERT_METRICS_PUBLIC


def version() -> str:
    try:
        return importlib.metadata.version("bertserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@router.get("/health", response_model=HealthResponse)
async def health() -> HealthResponse:
    """Liveness: the process answers."""
    return HealthResponse()


@router.get("/ready", response_model=ReadyResponse, responses=responses("unavailable"))
async def ready(service: ServiceDep, request: Request) -> ReadyResponse:
    """Readiness: the default model is loaded and a warm-up forward pass succeeded (else 503); which model
    answers /fill-mask now, and the job still making it."""
    reason = await service.not_ready_reason()
    if reason is not None:
        raise ServiceError("unavailable", reason)
    mlm_model, job = await service.registry.mlm_status()
    if not request.app.state.keyring.is_open("inference"):  # shown as /fill-mask's 503 shows it to a reader
        job = None  # without a key, the one an open route has
    mlm_job = None if job is None else JobProgress(**model_jobs.progress(job))
    return ReadyResponse(model=service.registry.default(), mlm_model=mlm_model, mlm_job=mlm_job)


@metrics_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **responses("unauthorized")},
)
async def metrics(service: ServiceDep, jobs: JobServiceDep) -> Response:
    """Prometheus metrics: requests and latency per route and status, batch sizes, queue depth and wait, tokens,
    each key's requests, tokens, 429s, 5xx and job-seconds, jobs by state, their heartbeats, and readiness."""
    await count_job_seconds(jobs, service.metrics)
    service.metrics.ready.set(0 if await service.not_ready_reason() is not None else 1)
    return Response(service.metrics.render(), media_type=service.metrics.content_type)


@protected.get("/info", response_model=InfoResponse, responses=responses("unauthorized"))
async def info(service: ServiceDep, request: Request) -> InfoResponse:
    """Version, device and the settings that are safe to show."""
    return InfoResponse(
        name="bertserve",
        version=version(),
        device=str(service.device),
        cpu=f"{kernels.cpu().name}: {kernels.cpu().summary()}",
        torch=torch.__version__,
        python=platform.python_version(),
        settings=service.settings.public_dict(),
        keys=request.app.state.keyring.summary(),
    )


@protected.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@protected.get("/docs", include_in_schema=False)
async def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="bertserve API")
