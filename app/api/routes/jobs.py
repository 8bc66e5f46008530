"""Training and mining jobs: POST /jobs (202 + id), GET /jobs, GET /jobs/{id}, GET /jobs/{id}/metrics,
GET /jobs/{id}/events (Server-Sent Events, app/jobs/events.py), POST /jobs/{id}/cancel, DELETE /jobs/{id}. They need
the scope jobs; a key sees and cancels its own jobs only (another's is a 404), the scope admin every job. State lives in DATA_DIR/jobs/<id>/ (datadir);
GET never blocks on a worker, it reads the record the worker keeps current.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from app.api.auditing import audited
from app.api.deps import CallerDep, JobServiceDep, ServiceDep, require_jobs
from app.errors import responses
from app.jobs.events import job_events
from app.jobs.job_service import JobService
from app.keys.keyring import ANONYMOUS
from app.schemas.jobs import (
    CREATE_EXAMPLE,
    MINE_EXAMPLE,
    CreateJobRequest,
    CreateJobResponse,
    JobMetricsResponse,
    JobsResponse,
    JobState,
    JobStatus,
    MineNegativesJobRequest,
)
from app.schemas.shared import DeletedResponse
from datadir import JOB_ID_PATTERN, JobNotFound

router = APIRouter(tags=["jobs"], dependencies=[Depends(require_jobs)])

JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, max_length=40, description="As POST /jobs returned it.")]


@router.post(
    "/jobs",
    status_code=202,
    response_model=CreateJobResponse,
    responses=responses("validation", "unauthorized", "conflict", "unavailable", "insufficient_storage"),
)
async def create_job(
    req: Annotated[
        CreateJobRequest,
        Body(openapi_examples={"finetune": {"value": CREATE_EXAMPLE}, "mine-negatives": {"value": MINE_EXAMPLE}}),
    ],
    jobs: JobServiceDep,
    response: Response,
    caller: CallerDep,
    request: Request,
) -> CreateJobResponse:
    """Queue a pretraining, fine-tuning or mining job; everything is validated first (422), nothing half-queued."""
    name = req.name if isinstance(req, MineNegativesJobRequest) else req.model_name  # a dataset, or a model
    async with audited(request, "job.submit", name) as entry:
        record = await jobs.submit(req, caller)
        made = "dataset" if isinstance(req, MineNegativesJobRequest) else "model"
        entry["target"] = f"job {record['id']} ({req.kind} of {made} {name})"
    response.headers["Location"] = f"/jobs/{record['id']}"
    return CreateJobResponse(id=record["id"], state=record["state"], status_url=f"/jobs/{record['id']}")


@router.get("/jobs", response_model=JobsResponse, responses=responses("validation", "unauthorized"))
async def list_jobs(
    jobs: JobServiceDep,
    caller: CallerDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
) -> JobsResponse:
    """The key's jobs (every job for the scope admin), newest first; `?state=running` (queued, running,
    succeeded, failed, cancelled) filters."""
    records = await asyncio.to_thread(jobs.list_for, caller, state)
    sizes = await asyncio.to_thread(lambda: [_disk_bytes(jobs, r["id"]) for r in records])
    return JobsResponse(jobs=[JobStatus.from_record(r, size) for r, size in zip(records, sizes, strict=True)])


@router.get("/jobs/{job_id}", response_model=JobStatus, responses=responses("validation", "unauthorized", "not_found"))
async def get_job(job_id: JobId, jobs: JobServiceDep, caller: CallerDep) -> JobStatus:
    """A job's state, progress (step, loss, lr, tokens/s, ETA), checkpoint, attempts, error; queued: its place in line."""
    record = await asyncio.to_thread(jobs.find, job_id, caller)
    place = await asyncio.to_thread(jobs.queue_place, record, caller)
    return JobStatus.from_record(record, await asyncio.to_thread(_disk_bytes, jobs, job_id), place)


def _disk_bytes(jobs: JobService, job_id: str) -> int:
    return jobs.records.disk_bytes(job_id)


@router.get(
    "/jobs/{job_id}/metrics",
    response_model=JobMetricsResponse,
    responses=responses("validation", "unauthorized", "not_found"),
)
async def get_job_metrics(job_id: JobId, jobs: JobServiceDep, caller: CallerDep) -> JobMetricsResponse:
    """The whole training curve: every logged step, evaluation and resume, in order."""
    await asyncio.to_thread(jobs.find, job_id, caller)  # another key's job: a 404
    try:
        records = await asyncio.to_thread(jobs.records.metrics, job_id)
    except JobNotFound:
        await asyncio.to_thread(jobs.find, job_id)  # raises the 404
        raise
    return JobMetricsResponse(id=job_id, records=records)


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "progress, state, metrics, reset and end events (see the documentation, docs/training.md)",
        },
        **responses("validation", "unauthorized", "not_found", "overloaded"),
    },
)
async def stream_job_events(
    job_id: JobId,
    jobs: JobServiceDep,
    request: Request,
    caller: CallerDep,
    service: ServiceDep,
    since: Annotated[
        int | None, Query(ge=0, description="Metrics records from this step on (earlier ones are not sent).")
    ] = None,
    last_event_id: Annotated[
        str | None,
        Header(
            max_length=20,
            description="The `id` of the last metrics event a reconnecting client got: go on from its step.",
        ),
    ] = None,
) -> StreamingResponse:
    """Server-Sent Events: the job's progress, state changes and metrics records as they come; ends with the job."""
    await asyncio.to_thread(jobs.find, job_id, caller)  # a 404 now, before the stream starts
    if since is None and last_event_id is not None and last_event_id.strip().isdigit():
        since = int(last_event_id)
    key = None if caller is ANONYMOUS else caller.name  # a service without keys: no key's limit
    release = jobs.event_streams.open(job_id, key)  # a 429 past the limits
    settings = jobs.settings

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in job_events(
                jobs.records,
                job_id,
                request.is_disconnected,
                since=since,
                max_seconds=settings.event_stream_max_seconds,
                replay=jobs.event_streams.replay,
                stopping=lambda: service.leaving,
                named=jobs.visible(caller),
            ):
                yield chunk
        finally:
            release()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        background=BackgroundTask(release),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post(
    "/jobs/{job_id}/cancel",
    status_code=202,
    response_model=JobStatus,
    responses=responses("validation", "unauthorized", "not_found", "conflict"),
)
async def cancel_job(job_id: JobId, jobs: JobServiceDep, caller: CallerDep, request: Request) -> JobStatus:
    """Cancel: a queued job at once; a running one stops at its next step with a checkpoint; a finished one is 409."""
    async with audited(request, "job.cancel", f"job {job_id}"):
        record = await asyncio.to_thread(jobs.cancel, job_id, caller)
    return JobStatus.from_record(record, await asyncio.to_thread(_disk_bytes, jobs, job_id))


@router.delete(
    "/jobs/{job_id}",
    response_model=DeletedResponse,
    responses=responses("validation", "unauthorized", "not_found", "conflict"),
)
async def delete_job(job_id: JobId, jobs: JobServiceDep, caller: CallerDep, request: Request) -> DeletedResponse:
    """Delete a finished job with its checkpoints and metrics (409 while it is queued or running)."""
    async with audited(request, "job.delete", f"job {job_id}"):
        freed = await asyncio.to_thread(jobs.delete_job, job_id, caller)
    return DeletedResponse(deleted="job", name=job_id, freed_bytes=freed)
