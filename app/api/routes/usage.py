"""GET /usage (the scope admin): each key's requests, tokens, rate-limit refusals (this replica's
counters) and the worker time of its jobs (from the job records)."""

import asyncio

from fastapi import APIRouter, Depends

from app.api.deps import JobServiceDep, ServiceDep, require_admin
from app.errors import responses
from app.jobs.job_service import JobService
from app.prometheus import Metrics
from app.schemas.usage import KeyUsage, UsageResponse

router = APIRouter(tags=["keys"], dependencies=[Depends(require_admin)])


async def count_job_seconds(jobs: JobService, metrics: Metrics) -> None:
    """Bring the job gauges up to date from the job records: each key's job-seconds, jobs by state, heartbeats."""
    records = await asyncio.to_thread(jobs.records.list)
    for name, seconds in jobs.job_seconds(records).items():
        metrics.key_job_seconds.labels(name).set(seconds)
    metrics.observe_jobs(records)


@router.get("/usage", response_model=UsageResponse, responses=responses("unauthorized", "forbidden"))
async def usage(service: ServiceDep, jobs: JobServiceDep) -> UsageResponse:
    """Usage per key: requests, tokens and 429s since this replica started, and its jobs' worker time."""
    await count_job_seconds(jobs, service.metrics)
    per_key = service.metrics.per_key()
    return UsageResponse(keys={name: KeyUsage(**values) for name, values in sorted(per_key.items())})
