"""Imports the API runs itself: POST /models queues a job record of kind "import" and a thread of the API
process runs it (a download does not wait behind training on the workers); POST /datasets with a Hub repo id
queues one too, whose `dataset` names the dataset it makes (app/jobs/dataset_imports.py) and whose
`model_name` is null.

The record lives in DATA_DIR/jobs/<id>/ like a training job's and moves through the same named
transitions (datadir/jobs.py); GET /jobs/{id} shows it and POST /jobs/{id}/cancel stops it
between downloaded chunks. The thread runs it through datadir/runner.py, holding the job's lease as a
worker does, so at API start every queued or running import whose lease is free is run again: the Hub
cache makes a restart cheap. An uploaded archive is kept in the job's directory until it ran. An import
is checked against the model memory budget (model.model_dir.check_config) before its weights are read.

    params   {"source": "<repo id or archive file name>", "revision": "<rev or null>"}, and "pooling" when
             the request sent it ("splade": model.model_dir.import_model); a dataset's adds
             "subset", "split", "columns" and "kind"
    source   {"kind": "hub", "repo", "revision"} or {"kind": "archive", "file"} (upload: job dir file), each
             with "pooling" when sent;
             {"kind": "hub-dataset", "shared"} for a dataset (what to import is in params)
    progress {"downloaded_bytes", "total_bytes"} (written at most PROGRESS_EVERY_S apart)
    result   {"model", "version", "path", "source"} (the card's source, with the resolved commit);
             {"dataset", "kind", "source"} for a dataset (its meta.json's source)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from python_multipart.multipart import parse_options_header

from app.errors import ServiceError, suggest_fields, without_data_dir
from app.jobs import uploads
from app.jobs.dataset_imports import SOURCE_KIND, DatasetImport, import_dataset
from app.jobs.quota import check_job_limit, check_room
from app.keys.keyfile import Key
from app.schemas.models import ImportModelRequest
from app.settings import Settings
from datadir import NAME_RULE, TERMINAL, JobRecord, JobRecords, runner, valid_name
from datadir.datasets import staging_dir
from datadir.publish import audit_publish, version_of
from model.errors import UserError
from model.options import IMPORT_POOLINGS
from model.sources import ARCHIVE_SUFFIXES, import_source
from worker.telemetry import logs, tracing

log = logging.getLogger("bertserve")

KIND = "import"
UPLOAD = "upload"  # the archive's file name in the job directory: upload<suffix>
STAGING = "dataset"  # the folder in the job directory a dataset import builds its dataset in
PROGRESS_EVERY_S = 0.25


class ImportCancelled(Exception):
    """Raised from the download's progress callback when the job's cancel was asked for."""


class Imports:
    """Queue, run (one thread per import) and resume the import jobs of one data directory; `memory_budget`
    says the bytes the service's models may take when an import runs (None: not known, the fixed cap);
    `settings` bound a dataset import, and `key_named` finds its owner's key (its disk quota) when it runs."""

    def __init__(
        self,
        data_dir: str | Path,
        memory_budget: Callable[[], int | None] = lambda: None,
        settings: Settings | None = None,
        key_named: Callable[[str], Key | None] = lambda name: None,
    ):
        self.data_dir = Path(data_dir)
        self.memory_budget = memory_budget
        self.settings = settings or Settings(data_dir=self.data_dir)
        self.key_named = key_named
        self.records = JobRecords(data_dir)
        self.threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()  # one name's conflict check and record creation at a time

    def unfinished(self, name: str) -> JobRecord | None:
        """The queued or running import of model `name`, if there is one."""
        return next(
            (
                r
                for r in self.records.list()
                if r.get("kind") == KIND and r.get("model_name") == name and r["state"] not in TERMINAL
            ),
            None,
        )

    def submit(
        self, name: str, source: dict[str, Any], upload: Path | None = None, start: bool = True, owner: str = "admin"
    ) -> JobRecord:
        """Write the record (with `upload` moved into its directory) and start its thread (unless not
        `start`: the API runs it when it starts); 409 while another import of `name` is unfinished."""
        with self._lock, self.records.submitting():  # this process's threads, then every replica's
            running = self.unfinished(name)
            if running is not None:
                raise ServiceError("conflict", f"model '{name}' is being imported by job {running['id']}")
            record = self._create(name, source, upload, owner)
        if start:
            self.start(record["id"])
        return record

    def unfinished_dataset(self, name: str) -> JobRecord | None:
        """The queued or running import of dataset `name`, if there is one."""
        return next(
            (
                r
                for r in self.records.list()
                if r.get("kind") == KIND and r.get("dataset") == name and r["state"] not in TERMINAL
            ),
            None,
        )

    def submit_dataset(self, request: DatasetImport, owner: Key, start: bool = True) -> JobRecord:
        """Write a dataset import's record and start its thread: 409 while another import of the name is
        unfinished or a dataset has it, 429 when `owner` has its max_jobs queued or running."""
        with self._lock, self.records.submitting():
            running = self.unfinished_dataset(request.name)
            if running is not None:
                raise ServiceError("conflict", f"dataset '{request.name}' is being imported by job {running['id']}")
            uploads.check_fields({"name": request.name}, self.data_dir)
            check_job_limit(self.records, owner)
            spec = {
                "kind": KIND,
                "model_name": None,
                "base_model": None,
                "dataset": request.name,
                "params": request.params(),
                "source": {"kind": SOURCE_KIND, "shared": owner.is_admin},  # an admin's datasets serve every key
                "owner": owner.name,
                **tracing.job_fields(),  # the import continues this request's trace
            }
            record = self.records.create(spec)
        if start:
            self.start(record["id"])
        return record

    def _create(self, name: str, source: dict[str, Any], upload: Path | None, owner: str) -> JobRecord:
        label = source.get("repo") or source.get("file")
        spec = {
            "kind": KIND,
            "model_name": name,
            "base_model": None,
            "dataset": None,
            "params": {"source": label, "revision": source.get("revision")}
            | ({"pooling": source["pooling"]} if source.get("pooling") else {}),
            "source": source,
            "owner": owner,  # the key that asked for it
            "publish_any": True,  # imports need the admin scope: an admin may publish over any name
            **tracing.job_fields(),  # the import continues this request's trace
        }
        record = self.records.create(spec)
        if upload is not None:
            upload.rename(self.records.job_dir(record["id"]) / f"{UPLOAD}{''.join(upload.suffixes)}")
        return record

    def start(self, job_id: str) -> None:
        thread = threading.Thread(target=self.run, args=(job_id,), daemon=True, name=f"import-{job_id}")
        self.threads[job_id] = thread
        thread.start()

    def resume(self, quiet: bool = False) -> list[str]:
        """Start every unfinished import no process runs (runner.resumable: not here, its lease free). At start,
        and every RESUME_EVERY_S while serving (`quiet`), so the imports of a replica that died go on in another."""
        ids = [r["id"] for r in runner.resumable(self.records, {KIND}, here=self._running_here)]
        for job_id in ids:
            self.start(job_id)
        if ids and not quiet:
            log.info("resuming %d model import(s): %s", len(ids), ", ".join(ids))
        return ids

    def _running_here(self, job_id: str) -> bool:
        thread = self.threads.get(job_id)
        return thread is not None and thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Join the threads started so far (tests, and a clean shutdown)."""
        for thread in list(self.threads.values()):
            thread.join(timeout)

    # -- one import ---------------------------------------------------------------------------------

    def run(self, job_id: str) -> str:
        """One attempt at the import, through the runner (lease, begin, heartbeat, end); its outcome."""
        return runner.run(self.records, job_id, self._import, wait_s=1.0)

    def _import(self, attempt: runner.Attempt) -> str:
        assert attempt.record is not None
        with tracing.job_span(attempt.record, "import"), logs.bound(job_id=attempt.job_id):
            return self._import_attempt(attempt)

    def _import_attempt(self, attempt: runner.Attempt) -> str:
        record = attempt.record
        assert record is not None
        job_id, source = record["id"], record["source"]
        if record["attempts"] > 1:
            log.info("import %s: resuming (the process that ran it stopped)", job_id)
        if source["kind"] == SOURCE_KIND:
            return self._import_dataset(attempt, record)
        try:
            if source["kind"] == "archive":
                uploads = list(self.records.job_dir(job_id).glob(f"{UPLOAD}.*"))
                if not uploads:
                    raise UserError("the uploaded archive is missing from the job's directory")
                what, revision = str(uploads[0]), None
            else:
                what, revision = source["repo"], source.get("revision")
            version, _ = import_source(
                self.data_dir,
                what,
                record["model_name"],
                revision=revision,
                kind=source["kind"],
                import_id=job_id,
                progress=self._progress(job_id),
                card_source={"file": source["file"]} if source["kind"] == "archive" else None,
                memory_budget=self.memory_budget(),
                pooling=source.get("pooling"),
            )
        except ImportCancelled:
            return attempt.cancel("cancelled while downloading")
        except UserError as e:  # the record's error, shown by GET /jobs/{id}: no server path in it
            return attempt.fail(without_data_dir(str(e), self.data_dir))
        finally:
            for upload in self.records.job_dir(job_id).glob(f"{UPLOAD}.*"):
                upload.unlink(missing_ok=True)
        return self._succeed(attempt, record["model_name"], version)

    def _import_dataset(self, attempt: runner.Attempt, record: JobRecord) -> str:
        job_id, request = record["id"], DatasetImport.from_record(dict(record))
        key = self.key_named(record.get("owner") or "")
        room = None if key is None else (lambda n: check_room(self.data_dir, key, n, "this dataset"))
        owner = record.get("owner")
        staging = self.records.job_dir(job_id) / STAGING
        shutil.rmtree(staging, ignore_errors=True)  # what an attempt that did not finish left
        try:
            meta = import_dataset(
                self.data_dir,
                self.settings,
                request,
                owner=owner,
                shared=bool(record["source"].get("shared")),
                check_room=room,
                progress=self._progress(job_id),
                on_rows=lambda rows: self._cancel_point(job_id),
                staging=staging,
            )
        except ImportCancelled:
            return attempt.cancel("cancelled while importing")
        except (UserError, ServiceError) as e:
            message = e.message if isinstance(e, ServiceError) else str(e)
            return attempt.fail(without_data_dir(message, self.data_dir))
        result = {"dataset": meta["name"], "kind": meta["kind"], "source": meta.get("source")}
        return attempt.succeed(result, f"imported dataset '{meta['name']}' ({meta['kind']})")

    def _cancel_point(self, job_id: str) -> None:
        if self.records.cancel_requested(job_id):
            raise ImportCancelled

    def _succeed(self, attempt: runner.Attempt, name: str, version: Path) -> str:
        from datadir.cards import read_card

        number = version_of(version)
        result = {"model": name, "version": number, "path": str(version), "source": read_card(version).get("source")}
        audit_publish(self.data_dir, attempt.job_id, name, version, source="api")
        return attempt.succeed(result, f"published model '{name}' version {number}")

    def _progress(self, job_id: str):
        last = 0.0

        def report(done: int, total: int) -> None:
            nonlocal last
            now = time.monotonic()
            if done < total and now - last < PROGRESS_EVERY_S:
                return
            last = now
            if self.records.cancel_requested(job_id):
                raise ImportCancelled
            progress = {"downloaded_bytes": done, "total_bytes": total}
            self.records.update(job_id, lambda record: record.__setitem__("progress", progress))

        return report


# -- POST /models's body: a Hub repo as JSON, or an archive as multipart ------------------------------

MAX_JSON_BYTES = 16 * 1024
Body = TypeVar("Body", bound=BaseModel)


async def json_body(request: Request, schema: type[Body]) -> Body:
    """A JSON body of at most MAX_JSON_BYTES (POST /models' and POST /datasets' imports, whose routes take
    multipart too), validated as `schema` with FastAPI's 422."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON_BYTES:
            raise ServiceError("too_large", f"request body is larger than the limit of {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        where = f" (character {e.pos})" if isinstance(e, json.JSONDecodeError) else ""
        raise ServiceError("validation", f"the body is not valid JSON{where}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = suggest_fields(e.errors(include_url=False), schema)
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in errors]) from None


async def receive_request(
    request: Request, data_dir: Path, settings: Settings
) -> tuple[str, dict[str, Any], Path | None]:
    """(name, source, uploaded archive or None) from POST /models's body, the archive streamed to disk."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type == b"application/json":
        req = await json_body(request, ImportModelRequest)
        source = {"kind": "hub", "repo": req.source, "revision": req.revision}
        return req.name, source | ({"pooling": req.pooling} if req.pooling else {}), None
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise ServiceError(
            "validation",
            'send JSON {"name": ..., "source": "<Hub repo id>"}, or an archive as multipart/form-data '
            "(curl -F file=@model.tar.gz -F name=NAME)",
        )
    max_bytes = settings.max_model_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + 64 * 1024:
        raise ServiceError("too_large", _ArchiveUpload.LIMIT.format(max_bytes))
    tmp = await asyncio.to_thread(staging_dir, data_dir, "model-upload")
    try:
        upload = await uploads._parse(request, options[b"boundary"], tmp, max_bytes, data_dir, _ArchiveUpload)
        name = upload.fields.get("name")
        if not name:
            raise ServiceError("validation", "name: send the model's name in the form field 'name'")
        assert upload.filename is not None  # _parse refuses an upload without a file
        path = next(tmp.iterdir())
        source = {"kind": "archive", "file": Path(upload.filename).name}
        pooling = upload.fields.get("pooling")
        return name, source | ({"pooling": pooling} if pooling else {}), path
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in uploads.DISK_FULL:
            raise ServiceError(
                "insufficient_storage", f"not enough disk space to store the archive ({os.strerror(e.errno)})"
            ) from None
        raise


class _ArchiveUpload(uploads._Upload):
    """A model archive and its name, streamed to disk under BERT_MAX_MODEL_UPLOAD_BYTES."""

    FIELDS = ("name", "pooling")
    LIMIT = "archive is larger than the limit of {} bytes (BERT_MAX_MODEL_UPLOAD_BYTES)"

    def _check_filename(self) -> None:
        filename = self.filename or ""
        suffix = next((s for s in ARCHIVE_SUFFIXES if filename.lower().endswith(s)), None)
        if suffix is None:
            raise ServiceError(
                "validation", f"file {filename[:80]!r}: expected a {', '.join(ARCHIVE_SUFFIXES)} archive"
            )
        self._file = open(self.tmp_dir / f"model{suffix}", "wb")  # noqa: SIM115  (open across the parser's callbacks)

    def check_fields(self) -> None:
        name = self.fields.get("name")
        if name is not None and not valid_name(name):
            raise ServiceError("validation", f"name: {name[:80]!r} {NAME_RULE}")
        pooling = self.fields.get("pooling")
        if pooling is not None and pooling not in IMPORT_POOLINGS:
            raise ServiceError(
                "validation", f"pooling: {pooling[:80]!r} is not one of {', '.join(IMPORT_POOLINGS)} (or leave it out)"
            )
