"""Training data: POST /datasets (a multipart upload, or JSON naming a Hugging Face Hub dataset repo: an import
job), GET /datasets, GET and DELETE /datasets/{name}. They need the scope jobs (admin holds it too). Each dataset records the name of the key that uploaded it
(`owner`): a key lists, reads and trains on its own and those an admin uploaded, and deletes its own; another
key's is a 404, as its jobs are (app/keys/ownership.py). An admin sees and deletes every dataset."""

import asyncio
import functools
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse
from python_multipart.multipart import parse_options_header

from app.api.auditing import audited
from app.api.deps import CallerDep, CatalogDep, ImportsDep, require_jobs
from app.errors import ServiceError, responses
from app.jobs import uploads
from app.jobs.dataset_imports import DatasetImport
from app.jobs.imports import json_body
from app.jobs.quota import check_room
from app.keys.ownership import may_read_dataset
from app.schemas.datasets import DATASET_UPLOAD_BODY, DatasetInfo, DatasetsResponse, ImportDatasetRequest
from app.schemas.jobs import JobStatus
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
    responses={
        202: {"model": JobStatus, "description": "An import from the Hub, queued as a job (GET /jobs/{id})."},
        **responses("validation", "unauthorized", "conflict", "too_large", "overloaded", "insufficient_storage"),
    },
)
async def upload_dataset(
    request: Request, catalog: CatalogDep, imports: ImportsDep, caller: CallerDep
) -> dict[str, Any] | Response:
    """Upload a training file (multipart: file, name, kind), or import a Hub dataset's split (JSON) as a job."""
    content_type, _ = parse_options_header(request.headers.get("content-type", ""))
    if content_type == b"application/json":
        return await _import(request, imports, caller)
    async with audited(request, "dataset.upload", "dataset") as entry:
        room = functools.partial(check_room, catalog.data_dir, caller, what="this dataset")
        declared = request.headers.get("content-length", "")
        await asyncio.to_thread(room, int(declared) if declared.isdigit() else 0)  # before it streams in
        meta = await uploads.receive_upload(
            request, catalog.data_dir, catalog.settings, caller.name, caller.is_admin, check_room=room
        )
        entry["target"] = f"dataset {meta['name']}"
    return {**meta, "disk_bytes": await asyncio.to_thread(dataset_bytes, catalog.data_dir, meta["name"])}


async def _import(request: Request, imports: ImportsDep, caller: CallerDep) -> Response:
    async with audited(request, "dataset.import", "dataset") as entry:
        req = await json_body(request, ImportDatasetRequest)
        entry["target"] = f"dataset {req.name} from {req.source}"
        what = DatasetImport(req.name, req.source, req.revision, req.subset, req.split, req.columns, req.kind)
        record = await asyncio.to_thread(imports.submit_dataset, what, caller)
        entry["target"] = f"dataset {req.name} from {req.source} (job {record['id']})"
    body = JobStatus.from_record(record).model_dump(mode="json")
    return JSONResponse(body, status_code=202, headers={"Location": f"/jobs/{record['id']}"})


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
