"""OpenAI's files and batch API: /v1/files (batch inputs and outputs) and /v1/batches (app/serving/batch_jobs.py).

Behind the scope batch (an admin holds it too; without BERT_ADMIN_KEY the API key opens them, so OpenAI's
client works with the one key). Files and batches belong to the key that made them: a key lists and reads
its own, and another key's are a 404, as its jobs are; an admin sees every one. A batch is a job: GET /jobs
shows it too.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import FileResponse
from python_multipart.multipart import parse_options_header

from app.api.auditing import audited
from app.api.deps import CallerDep, require_batch
from app.errors import ServiceError, responses
from app.jobs import uploads
from app.keys.keyfile import Key
from app.schemas.openai_batches import BatchList, BatchObject, CreateBatchRequest, FileDeleted, FileList, FileObject
from app.serving.batch_jobs import Batches, batch_view
from datadir import JOB_ID_PATTERN, JobFinished, JobRecord
from datadir.batch_files import FILE_ID_PATTERN, FileNotFound, FileRecord, Files, file_owner
from datadir.files import TMP_PREFIX
from datadir.jobs import owner_of

router = APIRouter(tags=["batches"], dependencies=[Depends(require_batch)])

FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN, max_length=90, description="As POST /v1/files returned it.")]
BatchId = Annotated[str, Path(pattern=JOB_ID_PATTERN, max_length=40, description="As POST /v1/batches returned it.")]
ERRORS = responses("validation", "unauthorized", "not_found", openai=True)


async def get_batches(request: Request) -> Batches:
    """The app's batches (app/serving/batch_jobs.py), made at start by create_app's lifespan."""
    return request.app.state.batches


BatchesDep = Annotated[Batches, Depends(get_batches)]


def _not_found(file_id: str) -> ServiceError:
    return ServiceError("not_found", f"no file '{file_id}'", openai={"code": "file_not_found"})


def _file(batches: Batches, file_id: str, caller: Key) -> FileRecord:
    """The file's record, when `caller` may see it (blocking: call in a thread); else a 404."""
    try:
        record = batches.files.read(file_id)
    except FileNotFound:
        raise _not_found(file_id) from None
    if not batches.may_see(caller, file_owner(record)):
        raise _not_found(file_id)
    return record


def _batch(batches: Batches, batch_id: str, caller: Key) -> JobRecord:
    """The batch's record, when `caller` may see it (blocking: call in a thread); else a 404."""
    record = batches.read(batch_id)
    if not batches.may_see(caller, owner_of(record)):
        raise ServiceError("not_found", f"no batch '{batch_id}'", openai={"code": "batch_not_found"})
    return record


class _BatchUpload(uploads._Upload):
    """A batch input file and its purpose, streamed to disk under BERT_BATCH_MAX_FILE_BYTES."""

    FIELDS = ("purpose",)
    LIMIT = "file is larger than the limit of {} bytes (BERT_BATCH_MAX_FILE_BYTES)"

    def _check_filename(self) -> None:
        self._file = open(self.tmp_dir / "content", "wb")  # noqa: SIM115  (open across the parser's callbacks)

    def check_fields(self) -> None:
        purpose = self.fields.get("purpose")
        if purpose is not None and purpose != "batch":
            raise ServiceError("validation", f"purpose: {purpose[:40]!r} is not supported; send 'batch'")


@router.post(
    "/v1/files",
    response_model=FileObject,
    responses=responses("too_large", "insufficient_storage", openai=True) | ERRORS,
)
async def create_file(request: Request, batches: BatchesDep, caller: CallerDep) -> FileRecord:
    """Upload a batch's input: multipart `file` (JSONL, one request a line) and `purpose=batch`."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise ServiceError(
            "validation", "send the file as multipart/form-data (curl -F purpose=batch -F file=@in.jsonl)"
        )
    max_bytes = batches.settings.batch_max_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + 64 * 1024:
        raise ServiceError("too_large", _BatchUpload.LIMIT.format(max_bytes))
    root = batches.files.root
    tmp = root / f"{TMP_PREFIX}upload-{secrets.token_hex(6)}"
    await asyncio.to_thread(tmp.mkdir, parents=True)
    try:
        upload = await uploads._parse(
            request, options[b"boundary"], tmp, max_bytes, batches.settings.data_dir, _BatchUpload
        )
        if upload.fields.get("purpose") != "batch":
            raise ServiceError("validation", "purpose: send the form field purpose=batch")
        assert upload.filename is not None  # _parse refuses an upload without a file
        name = FsPath(upload.filename).name or "input.jsonl"
        async with audited(request, "file.upload", f"file {name}") as entry:
            added = await asyncio.to_thread(batches.files.add, tmp / "content", name, "batch", None, caller.name)
            entry["target"] = f"file {added['id']} ({name})"
        return added
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)


@router.get("/v1/files", response_model=FileList, responses=ERRORS)
async def list_files(
    batches: BatchesDep, caller: CallerDep, purpose: Annotated[str | None, Query(max_length=40)] = None
) -> FileList:
    """The key's files, newest first; `?purpose=batch` (uploads) or `batch_output` (batch results) filters."""
    await asyncio.to_thread(batches.expire_files)
    files = await asyncio.to_thread(batches.files.list, purpose)
    return FileList(data=[f for f in files if batches.may_see(caller, file_owner(f))])


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=ERRORS)
async def retrieve_file(file_id: FileId, batches: BatchesDep, caller: CallerDep) -> FileRecord:
    """One file's record."""
    return await asyncio.to_thread(_file, batches, file_id, caller)


@router.get(
    "/v1/files/{file_id}/content",
    response_class=FileResponse,
    responses={**ERRORS, 200: {"content": {"application/octet-stream": {}}}},
)
async def file_content(file_id: FileId, batches: BatchesDep, caller: CallerDep) -> FileResponse:
    """A file's bytes (a batch's output: one JSON answer a line)."""
    files: Files = batches.files
    await asyncio.to_thread(_file, batches, file_id, caller)
    try:
        path = await asyncio.to_thread(files.content, file_id)
    except FileNotFound:
        raise _not_found(file_id) from None
    return FileResponse(path, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=ERRORS)
async def delete_file(file_id: FileId, batches: BatchesDep, caller: CallerDep, request: Request) -> FileDeleted:
    """Delete a file (a batch that uses it as input keeps its own copy)."""
    async with audited(request, "file.delete", f"file {file_id}"):
        await asyncio.to_thread(_file, batches, file_id, caller)
        try:
            await asyncio.to_thread(batches.files.delete, file_id)
        except FileNotFound:
            raise _not_found(file_id) from None
    return FileDeleted(id=file_id, deleted=True)


@router.post("/v1/batches", response_model=BatchObject, responses=responses("too_large", openai=True) | ERRORS)
async def create_batch(
    req: CreateBatchRequest, batches: BatchesDep, caller: CallerDep, request: Request
) -> dict[str, Any]:
    """Check an uploaded input whole (bad lines go to the error file) and queue the batch."""
    async with audited(request, "batch.submit", f"batch of file {req.input_file_id}") as entry:
        record, lines = await asyncio.to_thread(batches.create, req, caller)
        entry["target"] = f"batch {record['id']} (file {req.input_file_id})"
    batches.start(record["id"], lines)
    return batch_view(record)


@router.get("/v1/batches", response_model=BatchList, responses=ERRORS)
async def list_batches(
    batches: BatchesDep,
    caller: CallerDep,
    after: Annotated[str | None, Query(max_length=40, description="A batch id: list the ones older than it.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    """The key's batches, newest first, `limit` at a time (OpenAI's cursor: `after`)."""
    records = [r for r in await asyncio.to_thread(batches.batches) if batches.may_see(caller, owner_of(r))]
    if after is not None:
        records = [r for r in records if r["id"] < after]
    page = [batch_view(r) for r in records[:limit]]
    return BatchList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(records) > limit,
    )


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=ERRORS)
async def retrieve_batch(batch_id: BatchId, batches: BatchesDep, caller: CallerDep) -> dict[str, Any]:
    """One batch: status, request counts, output and error file ids."""
    return batch_view(await asyncio.to_thread(_batch, batches, batch_id, caller))


@router.post(
    "/v1/batches/{batch_id}/cancel",
    response_model=BatchObject,
    responses=responses("conflict", openai=True) | ERRORS,
)
async def cancel_batch(batch_id: BatchId, batches: BatchesDep, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Cancel a batch: a queued one now, a running one after its chunk in flight (its output so far is kept)."""
    async with audited(request, "batch.cancel", f"batch {batch_id}"):
        await asyncio.to_thread(_batch, batches, batch_id, caller)
        try:
            record = await asyncio.to_thread(batches.records.request_cancel, batch_id)
        except JobFinished as e:
            raise ServiceError("conflict", f"batch {batch_id} is {e.state}: it cannot be cancelled") from None
    return batch_view(record)
