"""Training data: POST /datasets (multipart upload) and GET /uploads. Behind BERT_ADMIN_KEY."""

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response

from app.api.deps import JobServiceDep, require_admin_key
from app.errors import ServiceError, responses
from app.jobs import uploads
from app.schemas import DATASET_UPLOAD_BODY, DatasetInfo, DatasetsResponse
from model.datadir import NAME_PATTERN, read_meta

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_admin_key)])


@router.post(
    "/datasets",
    status_code=201,
    response_model=DatasetInfo,
    openapi_extra=DATASET_UPLOAD_BODY,
    responses=responses("validation", "unauthorized", "too_large", "insufficient_storage"),
)
async def upload_dataset(request: Request, jobs: JobServiceDep) -> Any:
    """Upload a training file (multipart: file, name, kind); size-capped, format-checked, stored whole."""
    return await uploads.receive_upload(request, jobs.data_dir, jobs.settings)


@router.get("/datasets", response_model=DatasetsResponse, responses=responses("unauthorized"))
async def list_datasets(jobs: JobServiceDep):
    """Every uploaded dataset with its kind, size, checksum and counts."""
    return Response(await asyncio.to_thread(uploads.listing_json, jobs.data_dir), media_type="application/json")


@router.get(
    "/datasets/{name}", response_model=DatasetInfo, responses=responses("validation", "unauthorized", "not_found")
)
async def get_dataset(name: Annotated[str, Path(pattern=NAME_PATTERN, max_length=64)], jobs: JobServiceDep):
    """One dataset's description."""
    meta = await asyncio.to_thread(read_meta, jobs.data_dir, name)
    if meta is None:
        raise ServiceError("not_found", f"dataset '{name}' not found")
    return meta
