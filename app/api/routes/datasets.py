"""Training data: POST /datasets (multipart upload), GET /datasets, GET and DELETE /datasets/{name}.
They need the scope jobs (admin holds it too). Each dataset records the name of the key that uploaded it
(`owner`): a key lists, reads and trains on its own and those an admin uploaded, and deletes its own; another
key's is a 404, as its jobs are (app/keys/ownership.py). An admin sees and deletes every dataset."""

import asyncio
import functools
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response

from app.api.auditing import audited
from app.api.deps import CallerDep, CatalogDep, require_jobs
from app.errors import ServiceError, responses
from app.jobs import uploads
from app.jobs.quota import check_room
from app.keys.ownership import may_read_dataset
from app.schemas.datasets import DATASET_UPLOAD_BODY, DatasetInfo, DatasetsResponse
from app.schemas.shared import DeletedResponse
from datadir import NAME_MAX_LENGTH, NAME_PATTERN, read_meta
from datadir.datasets import dataset_bytes

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_jobs)])

DatasetName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]


@router.post(
    "/datasets",
    status_code=201,
    response_model=DatasetInfo,
    openapi_extra=DATASET_UPLOAD_BODY,
    responses=responses("validation", "unauthorized", "conflict", "too_large", "insufficient_storage"),
)
async def upload_dataset(request: Request, catalog: CatalogDep, caller: CallerDep) -> dict[str, Any]:
    """Upload a training file (multipart: file, name, kind); size-capped, format-checked, stored whole."""
    async with audited(request, "dataset.upload", "dataset") as entry:
        room = functools.partial(check_room, catalog.data_dir, caller, what="this dataset")
        declared = request.headers.get("content-length", "")
        await asyncio.to_thread(room, int(declared) if declared.isdigit() else 0)  # before it streams in
        meta = await uploads.receive_upload(
            request, catalog.data_dir, catalog.settings, caller.name, caller.is_admin, check_room=room
        )
        entry["target"] = f"dataset {meta['name']}"
    return {**meta, "disk_bytes": await asyncio.to_thread(dataset_bytes, catalog.data_dir, meta["name"])}


@router.get("/datasets", response_model=DatasetsResponse, responses=responses("unauthorized"))
async def list_datasets(catalog: CatalogDep, caller: CallerDep) -> Response:
    """Every dataset the key may train on (an admin: every one) with its kind, size, checksum and counts."""
    visible = None if caller.is_admin else (lambda meta: may_read_dataset(caller, meta))
    body = await asyncio.to_thread(uploads.listing_json, catalog.data_dir, visible)
    return Response(body, media_type="application/json")


@router.get(
    "/datasets/{name}", response_model=DatasetInfo, responses=responses("validation", "unauthorized", "not_found")
)
async def get_dataset(name: DatasetName, catalog: CatalogDep, caller: CallerDep) -> dict[str, Any]:
    """One dataset's description."""
    meta = await asyncio.to_thread(read_meta, catalog.data_dir, name)
    if meta is None or not may_read_dataset(caller, meta):
        raise ServiceError("not_found", f"dataset '{name}' not found")
    return {**meta, "disk_bytes": await asyncio.to_thread(dataset_bytes, catalog.data_dir, name)}


@router.delete(
    "/datasets/{name}",
    response_model=DeletedResponse,
    responses=responses("validation", "unauthorized", "not_found", "conflict"),
)
async def delete_dataset(
    name: DatasetName, catalog: CatalogDep, caller: CallerDep, request: Request
) -> DeletedResponse:
    """Delete a dataset of the key's and its token caches (409 while a queued or running job uses it)."""
    async with audited(request, "dataset.delete", f"dataset {name}"):
        freed = await catalog.delete_dataset(name, caller)
    return DeletedResponse(deleted="dataset", name=name, freed_bytes=freed)
