"""Training data: POST /datasets (multipart upload) and GET /datasets. Behind BERT_ADMIN_KEY."""

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel

from model.datadir import NAME_PATTERN, list_datasets as list_dataset_metas, read_meta
from model.datadir.datasets import KINDS

from .. import datasets
from ..errors import ServiceError, responses
from ..job_service import JobsDep, require_admin_key

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_admin_key)])

UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "corpus: .txt or .jsonl (a 'text' field); labelled: .csv, .tsv or .jsonl "
                                "with 'text' and 'label' (and optionally 'text_pair')"},
        "name": {"type": "string", "pattern": NAME_PATTERN, "description": "Default: the file name's stem."},
        "kind": {"type": "string", "enum": list(KINDS),
                 "description": "Default: from the extension (.jsonl: labelled if rows have 'label')."},
    }}}}}}


class DatasetInfo(BaseModel):
    name: str
    kind: Literal["corpus", "labelled"]
    format: str
    file: str
    original_filename: str
    bytes: int
    sha256: str
    created_at: str
    documents: int | None = None
    sentences: int | None = None
    rows: int | None = None
    labels: list[str] | None = None
    label_counts: dict[str, int] | None = None
    is_pair: bool | None = None


class DatasetsResponse(BaseModel):
    datasets: list[DatasetInfo]


@router.post("/datasets", status_code=201, response_model=DatasetInfo, openapi_extra=UPLOAD_BODY,
             responses=responses("validation", "unauthorized", "too_large"))
async def upload_dataset(request: Request, jobs: JobsDep) -> Any:
    """Upload a training file (multipart: file, name, kind); size-capped, format-checked, stored whole."""
    return await datasets.receive_upload(request, jobs.data_dir, jobs.settings.max_dataset_bytes)


@router.get("/datasets", response_model=DatasetsResponse, responses=responses("unauthorized"))
async def list_datasets(jobs: JobsDep):
    """Every uploaded dataset with its kind, size, checksum and counts."""
    return DatasetsResponse(datasets=await asyncio.to_thread(list_dataset_metas, jobs.data_dir))


@router.get("/datasets/{name}", response_model=DatasetInfo,
            responses=responses("validation", "unauthorized", "not_found"))
async def get_dataset(name: Annotated[str, Path(pattern=NAME_PATTERN, max_length=64)], jobs: JobsDep):
    """One dataset's description."""
    meta = await asyncio.to_thread(read_meta, jobs.data_dir, name)
    if meta is None:
        raise ServiceError("not_found", f"dataset '{name}' not found")
    return meta
