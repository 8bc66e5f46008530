"""Batch inference, OpenAI's batch API: POST /v1/batches checks an uploaded JSONL of requests and queues
a job of kind "batch"; the API process runs its lines through the same pipelines and batching engine as
the online routes (so a line's answer is the one its route gives, its body the route's response model's
JSON as FastAPI writes it), and writes OpenAI's output and error files (/v1/files, datadir/files.py).
Its input's lines are checked and held by app/serving/batch_lines.py. The embedding endpoints take a
chunk's lines in one pipeline call (pipelines._infer_many), each line still checked, answered or failed
on its own; the other endpoints take one call per line.

The record is a job in DATA_DIR/jobs/<id>/ like an import's (app/jobs/imports.py): the same named
transitions, GET /jobs and cancel. The run goes through datadir/runner.py, holding the job's lease; at API
start every unfinished batch whose lease is free runs again. Crash safety: answers are appended to output.jsonl / errors.jsonl in
chunks of BERT_BATCH_CHUNK_LINES (those answered by then in one commit), fsynced, and only then counted
in the record (lines done and the two files' lengths, written atomically); a new attempt first cuts
both files back to those lengths, so a killed process leaves no missing or duplicated line. Memory: a
batch keeps its input checked but small (CheckedLines: offsets, errors, counts) and parses its lines
again a chunk at a time as they run, so it holds the lines in flight, whatever the file's size.

    params   {"endpoint", "input_file_id", "completion_window", "metadata", "total", "invalid", "max_line_bytes"}
    progress {"step": lines done, "total_steps", "completed", "failed", "output_bytes", "error_bytes",
              "finalizing_at", "expired_at"}
    result   {"output_file_id", "error_file_id", "completed", "failed"}

Input lines that are bad (not JSON, no or a duplicate custom_id, another url, a body the route refuses)
are found when the batch is created; they are not a failed batch: each becomes an error-file line,
in its place. A batch still running when its completion window ends (24 hours after it was created:
`expires_at`) runs no more lines: each line not yet run becomes an error-file line `batch_expired`, the
answers so far are published, and the batch is `expired` (a job failed on its time limit).
Reference: https://platform.openai.com/docs/guides/batch
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import datetime as dt
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from typing import Any

from app.errors import ServiceError
from app.keys import ownership
from app.keys.keyfile import Key
from app.keys.keyring import ANONYMOUS
from app.keys.limits import CALLER
from app.schemas.openai_batches import CreateBatchRequest
from app.serving.batch_lines import ENDPOINTS, CheckedLines, Endpoint, Line
from app.serving.service import LANE, Lane, Service
from datadir import JobRecord, JobRecords, now_iso, runner
from datadir import jobs as transitions
from datadir.batch_files import FileNotFound, Files, file_owner
from datadir.jobs import owner_of
from worker.telemetry import logs, tracing

log = logging.getLogger("bertserve")

KIND = "batch"
INPUT, OUTPUT, ERRORS = "input.jsonl", "output.jsonl", "errors.jsonl"
WINDOWS_S = {"24h": 24 * 3600}  # completion_window -> seconds from created_at to expires_at
EXPIRED = "This request could not be executed before the completion window expired."  # OpenAI's words
RETRY_S = 0.05  # a full engine or tokeniser queue (429): the line waits its turn, it does not fail


def unix(iso: str | None) -> int | None:
    """An ISO timestamp of a record (datadir.layout.now_iso) as OpenAI's Unix seconds."""
    if not iso:
        return None
    return int(dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp())


def batch_view(record: JobRecord) -> dict[str, Any]:
    """A batch job as OpenAI's batch object (app/schemas/openai_batches.py: BatchObject)."""
    params, progress, result = record["params"], record.get("progress") or {}, record.get("result") or {}
    state, cancelling = record["state"], bool(record.get("cancel_requested"))
    events = record.get("events") or []

    def first(event: str) -> int | None:
        return unix(next((e["at"] for e in events if e["event"] == event), None))

    status = {
        "queued": "validating",
        "running": "cancelling" if cancelling else "finalizing" if progress.get("finalizing_at") else "in_progress",
        "succeeded": "completed",
        "failed": "expired" if progress.get("expired_at") else "failed",
        "cancelled": "cancelled",
    }[state]
    created = unix(record["created_at"]) or 0
    finished = unix(record.get("finished_at"))
    return {
        "id": record["id"],
        "object": "batch",
        "endpoint": params["endpoint"],
        "errors": {"object": "list", "data": [{"code": "batch_failed", "message": record.get("error") or ""}]}
        if status == "failed"
        else None,
        "input_file_id": params["input_file_id"],
        "completion_window": params["completion_window"],
        "status": status,
        "output_file_id": result.get("output_file_id"),
        "error_file_id": result.get("error_file_id"),
        "created_at": created,
        "in_progress_at": first("started"),
        "expires_at": created + WINDOWS_S[params["completion_window"]],
        "finalizing_at": unix(progress.get("finalizing_at")),
        "completed_at": finished if state == "succeeded" else None,
        "failed_at": finished if status == "failed" else None,
        "expired_at": finished if status == "expired" else None,
        "cancelling_at": first("cancel requested") or (finished if state == "cancelled" else None),
        "cancelled_at": finished if state == "cancelled" else None,
        "request_counts": {
            "total": params["total"],
            "completed": progress.get("completed", 0),
            "failed": progress.get("failed", 0),
        },
        "metadata": params.get("metadata"),
    }


class Batches:
    """Create, run (one asyncio task per batch, on the API's event loop) and resume the batch jobs."""

    def __init__(self, service: Service):
        self.service = service
        self.settings = service.settings
        self.records = JobRecords(self.settings.data_dir)
        self.files = Files(self.settings.data_dir)
        self.tasks: dict[str, asyncio.Task] = {}
        self._running = asyncio.Semaphore(self.settings.batch_max_running)  # FIFO: the oldest waiting goes next

    # -- records ----------------------------------------------------------------------------------

    def create(self, req: CreateBatchRequest, caller: Key = ANONYMOUS) -> tuple[JobRecord, CheckedLines]:
        """Check the input file whole and write the job (queued), owned by `caller`; 404/422 for a file it
        cannot run (or another key's). With the checked lines, for the run that follows (start), so it does
        not check them again. A line naming a model the key may not use fails alone, as its route would."""
        try:
            meta = self.files.read(req.input_file_id)
        except FileNotFound:
            meta = None
        if meta is None or not self.may_see(caller, file_owner(meta)):
            raise ServiceError("not_found", f"no file '{req.input_file_id}'", openai={"code": "file_not_found"})
        if meta["purpose"] != "batch":
            raise ServiceError("validation", f"file '{req.input_file_id}' has purpose {meta['purpose']!r}, not 'batch'")
        source = self.files.content(req.input_file_id)
        keep = 2 * self.settings.batch_concurrency  # the run's first lines in flight: parsed once, not twice
        lines = CheckedLines.scan(
            source, req.endpoint, self.settings.max_body_bytes, self.settings.batch_max_lines, keep=keep
        )
        if not lines:
            raise ServiceError("validation", f"file '{req.input_file_id}' holds no requests")
        refused = lines.refused = self._refused_models(caller, lines.models)
        invalid = lines.invalid
        spec = {
            "kind": KIND,
            "model_name": "",  # a batch publishes no model
            "base_model": None,
            "dataset": None,
            "params": {
                "endpoint": req.endpoint,
                "input_file_id": req.input_file_id,
                "completion_window": req.completion_window,
                "metadata": req.metadata,
                "total": len(lines),
                "invalid": invalid,
                "max_line_bytes": self.settings.max_body_bytes,  # the same checks on a resume
                "refused_models": refused,  # and the same lines refused
            },
            "owner": caller.name,
            **tracing.job_fields(),  # the batch continues this request's trace
        }
        record = self.records.create(spec)
        job_dir = self.records.job_dir(record["id"])
        try:  # the batch's own reference to the input: deleting the upload leaves it whole
            os.link(source, job_dir / INPUT)
        except OSError:  # a file system without hard links
            shutil.copyfile(source, job_dir / INPUT)

        def queue(r: JobRecord) -> None:  # the API runs it: queued now, as a sent training job would be
            r["progress"] = _progress(0, len(lines))
            transitions.enqueued(r)

        return self.records.update(record["id"], queue), lines

    def _refused_models(self, caller: Key, models: Iterable[str]) -> dict[str, str]:
        """{model: why} for the models the lines name that `caller` may not use (app/keys/ownership.py)."""
        refused = {}
        for name in sorted(models):
            entry = self.service.registry.peek(name)
            if entry is not None:
                try:
                    ownership.check_model(caller, name, entry.access)
                except ServiceError as e:
                    refused[name] = e.message
        return refused

    def may_see(self, caller: Key, owner: str) -> bool:
        """A key sees its own files and batches; an admin every one (another key's are a 404, as jobs are)."""
        return caller.sees_jobs_of(owner)

    def batches(self) -> list[JobRecord]:
        return [r for r in self.records.list() if r.get("kind") == KIND]

    def read(self, batch_id: str) -> JobRecord:
        try:
            record = self.records.read(batch_id)
        except transitions.JobNotFound:
            record = None
        if record is None or record.get("kind") != KIND:
            raise ServiceError("not_found", f"no batch '{batch_id}'", openai={"code": "batch_not_found"})
        return record

    def expire_files(self) -> list[str]:
        """Delete the files older than BERT_BATCH_RETENTION_DAYS (0: none)."""
        days = self.settings.batch_retention_days
        return self.files.expire(days * 86400) if days > 0 else []

    # -- running ----------------------------------------------------------------------------------

    def start(self, job_id: str, lines: CheckedLines | None = None) -> None:
        """Run a batch in this process; `lines`: its input as create() checked it (None: read it again)."""
        context = contextvars.copy_context()
        context.run(CALLER.set, None)  # its lines are not the submitting request's: no key's rates apply
        task = asyncio.get_running_loop().create_task(self.run(job_id, lines), name=f"batch-{job_id}", context=context)
        self.tasks[job_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(job_id, None))

    async def resume(self, quiet: bool = False) -> list[str]:
        """Start every unfinished batch no process runs (runner.resumable: not here, its lease free). At start,
        and every RESUME_EVERY_S while serving (`quiet`), so the batches of a replica that died go on in another."""
        ids = await runner.resume_here(self.records, {KIND}, self.tasks, self.start)
        if ids and not quiet:
            log.info("resuming %d batch(es): %s", len(ids), ", ".join(ids))
        return ids

    async def stop(self) -> None:
        """Stop the runs (before the engine stops): each hands its job back, its unfinished chunk uncounted."""
        await runner.stop_tasks(self.tasks.values())

    async def run(self, job_id: str, lines: CheckedLines | None = None) -> str:
        """One attempt at the batch, through the runner (lease, begin, heartbeat, end); cancelling the task
        hands the job back, its unfinished chunk uncounted."""

        async def body(attempt: runner.Attempt) -> str:
            assert attempt.record is not None
            with tracing.job_span(attempt.record, "batch"), logs.bound(job_id=job_id):
                await asyncio.to_thread(self._prepare, attempt)
                return await self._run(attempt, lines)

        async with self._running:  # at most BERT_BATCH_MAX_RUNNING at once; the others wait, queued, in turn
            return await runner.run_async(self.records, job_id, body, wait_s=1.0, may_cancel=_unstarted)

    def _prepare(self, attempt: runner.Attempt) -> None:
        """Cut the output files of a job that has begun back to what was committed."""
        record, job_id = attempt.record, attempt.job_id
        assert record is not None
        if not record["progress"]:  # the API died between writing the record and its progress
            record["progress"] = _progress(0, record["params"]["total"])
        progress = record["progress"]
        self.records.update(job_id, lambda r: r.__setitem__("progress", progress))
        job_dir = self.records.job_dir(job_id)
        if not progress.get("finalizing_at"):  # else the files were published already (_finish)
            for name, key in ((OUTPUT, "output_bytes"), (ERRORS, "error_bytes")):
                with open(job_dir / name, "ab") as f:  # created if missing
                    if f.tell() > progress[key]:  # an uncommitted tail: the killed attempt's last chunk
                        f.truncate(progress[key])
                        os.fsync(f.fileno())

    async def _run(self, attempt: runner.Attempt, lines: CheckedLines | None) -> str:
        job_id = attempt.job_id
        record = await asyncio.to_thread(self.records.read, job_id)
        params, done = record["params"], record["progress"]["step"]
        ep = ENDPOINTS[params["endpoint"]]
        path = self.records.job_dir(job_id) / INPUT
        if lines is None:  # resumed, or created by another process: checked again, kept small
            lines = await asyncio.to_thread(CheckedLines.scan, path, params["endpoint"], params["max_line_bytes"])
            lines.refused = params.get("refused_models") or {}
        settings = self.settings
        # Lines go to the pipeline together (an endpoint with run_many) in groups of at most the lines in flight.
        chunk, concurrency = settings.batch_chunk_lines, settings.batch_concurrency
        group = min(chunk, concurrency) if ep.run_many is not None else 1
        # Twice `concurrency` lines in flight: the lane sorts and cuts `concurrency` lines' rows at a time while
        # the next ones are tokenised, so when a cut's passes have run the next cut is ready and as large.
        in_flight = 2 * concurrency
        gate = asyncio.Semaphore(max(1, in_flight // group))  # groups in flight
        # This task's lines (the tasks below inherit the context) reach the engine through one lane: few large
        # work items, and a quarter of the tokeniser queue at most, the rest kept for the online routes.
        LANE.set(Lane(self.service, max(1, settings.max_tokenizer_queue // 4), cut_rows=concurrency))
        tag, expires_at = job_id.rsplit("-", 1)[-1], batch_view(record)["expires_at"]
        expired = bool(record["progress"].get("expired_at"))
        # Chunks run ahead of the one being committed (as many as the lines in flight can fill, and one), so
        # the engine has work while a chunk is written and fsynced; commits stay in line order.
        ahead: collections.deque[asyncio.Future] = collections.deque()
        window = -(-in_flight // chunk) + 1
        starts = iter(range(done, len(lines), chunk))

        async def refill() -> None:
            nonlocal expired
            while len(ahead) < window and (start := next(starts, None)) is not None:
                if not expired and time.time() >= expires_at:  # the lines not started are not run: each says so
                    await asyncio.to_thread(self.records.update, job_id, _mark_expired)
                    expired = True
                part = lines[start : start + chunk]
                if expired:
                    answered: asyncio.Future = asyncio.get_running_loop().create_future()
                    answered.set_result([_failure(line, tag, "batch_expired", EXPIRED) for line in part])
                else:
                    answered = asyncio.ensure_future(self._answer_part(ep, part, group, tag, gate))
                ahead.append(answered)

        try:
            while True:
                await refill()
                if not ahead:
                    break
                if await asyncio.to_thread(self.records.cancel_requested, job_id):
                    return await asyncio.to_thread(self._finish, attempt, cancelled=True)
                answers = await ahead.popleft()
                # The chunks answered meanwhile go in the same commit (one fsync), and as many new ones start at
                # once: the lines in flight stay as many while the commit is written.
                while ahead and ahead[0].done() and not ahead[0].cancelled() and ahead[0].exception() is None:
                    answers += ahead.popleft().result()
                await refill()
                await asyncio.to_thread(self._commit, job_id, answers)
        finally:
            for answered in ahead:  # stopped or cancelled: the lines under way are dropped, uncounted
                answered.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)
        return await asyncio.to_thread(self._finish, attempt, cancelled=False)

    async def _answer_part(
        self, ep: Endpoint, part: list[Line], group: int, tag: str, gate: asyncio.Semaphore
    ) -> list[tuple[bool, bytes]]:
        """(answered, the output or error-file line) for each line of a chunk, its lines run in groups."""
        answers = await asyncio.gather(
            *(self._answer(ep, part[i : i + group], tag, gate) for i in range(0, len(part), group))
        )
        return [answer for answered in answers for answer in answered]

    async def _answer(
        self, ep: Endpoint, lines: list[Line], tag: str, gate: asyncio.Semaphore
    ) -> list[tuple[bool, bytes]]:
        """(answered, the output or error-file line) for each of `lines`, run by one pipeline call."""
        answers = {line.index: _failure(line, tag, *line.error) for line in lines if line.error is not None}
        todo = [line for line in lines if line.error is None]
        async with gate:
            while todo:
                retry = []
                for line, value in zip(todo, await self._run_lines(ep, [line.request for line in todo])):
                    if isinstance(value, ServiceError) and value.error_type == "overloaded":
                        retry.append(line)  # a full engine or tokeniser queue: the line waits its turn
                    else:
                        answers[line.index] = self._settle(ep, line, tag, value)
                if todo := retry:
                    await asyncio.sleep(RETRY_S)
        return [answers[line.index] for line in lines]

    async def _run_lines(self, ep: Endpoint, requests: list) -> list:
        """Per request its answer or its error: one call of the route's function for them all."""
        try:
            if ep.run_many is not None:
                return await ep.run_many(self.service, requests)
            return [await ep.run(self.service, request) for request in requests]
        except Exception as e:
            return [e] * len(requests)

    def _settle(self, ep: Endpoint, line: Line, tag: str, value: Any) -> tuple[bool, bytes]:
        """A line's answer, or its error, as its output or error-file line."""
        if isinstance(value, ServiceError):
            return _failure(line, tag, value.error_type, value.message)
        if not isinstance(value, Exception):
            try:  # as the route answers (FastAPI's dump_json of its response model): the same bytes
                body = ep.response.dump_json(
                    ep.response.validate_python(value, from_attributes=True), exclude_none=ep.exclude_none
                )
                return True, _output_line(line, tag, body)
            except Exception as e:
                value = e
        # a bug: this line's answer, in words, and the log has it whole
        log.error("batch line %s failed", line.index, exc_info=value)
        return _failure(line, tag, "internal", f"{type(value).__name__}: {value}")

    def _commit(self, job_id: str, answers: list[tuple[bool, bytes]]) -> None:
        """Append a chunk's answers, fsync both files, then count them in the record (atomically)."""
        job_dir = self.records.job_dir(job_id)
        sizes = {}
        for name, ok in ((OUTPUT, True), (ERRORS, False)):
            with open(job_dir / name, "ab") as f:
                f.write(b"".join(entry for answered, entry in answers if answered == ok))
                f.flush()
                os.fsync(f.fileno())
                sizes[name] = f.tell()
        completed = sum(answered for answered, _ in answers)

        def count(record: JobRecord) -> None:
            p = record["progress"]
            p["step"] += len(answers)
            p["completed"] += completed
            p["failed"] += len(answers) - completed
            p["output_bytes"], p["error_bytes"] = sizes[OUTPUT], sizes[ERRORS]

        self.records.update(job_id, count)

    def _finish(self, attempt: runner.Attempt, cancelled: bool) -> str:
        """Publish the output and error files (as /v1/files; idempotent by id) and end the attempt."""
        job_id = attempt.job_id
        self.records.update(job_id, lambda r: r["progress"].setdefault("finalizing_at", now_iso()))
        record = self.records.read(job_id)
        progress, job_dir = record["progress"], self.records.job_dir(job_id)
        result: dict[str, Any] = {"completed": progress["completed"], "failed": progress["failed"]}
        for name, key, count in ((OUTPUT, "output_file_id", "completed"), (ERRORS, "error_file_id", "failed")):
            file_id = f"file-{job_id}-{name.split('.')[0]}"
            result[key] = (
                self.files.add(job_dir / name, f"{job_id}_{name}", "batch_output", file_id, owner_of(record))["id"]
                if progress[count]
                else None
            )
        if progress.get("expired_at"):
            window = record["params"]["completion_window"]
            error = (
                f"the batch did not finish within its completion window ({window}): {progress['completed']} of "
                f"{progress['total_steps']} lines answered; the lines not run are in the error file as batch_expired"
            )
            return attempt.end(transitions.time_out, error, "completion window expired", result=result)["state"]
        if cancelled:
            return attempt.cancel(
                f"cancelled after {progress['step']} of {progress['total_steps']} lines", result=result
            )
        return attempt.succeed(result, f"{progress['completed']} lines answered, {progress['failed']} failed")


def _unstarted(record: JobRecord) -> bool:
    """A cancel asked for before the batch began is taken at once; one that has answered lines publishes them."""
    return record["state"] == "queued" and not (record.get("progress") or {}).get("step")


def _output_line(line: Line, tag: str, body: bytes) -> bytes:
    """An output-file line, in OpenAI's shape, around the body's JSON as the route wrote it."""
    request_id = f"batch_req_{tag}_{line.index}"
    head = json.dumps({"id": request_id, "custom_id": line.custom_id})[:-1]  # open: the response follows
    response = f'"response": {{"status_code": 200, "request_id": "{request_id}", "body": '
    return f"{head}, {response}".encode() + body + b'}, "error": null}\n'


def _failure(line: Line, tag: str, code: str, message: str) -> tuple[bool, bytes]:
    """An error-file line, in OpenAI's shape."""
    entry = {"id": f"batch_req_{tag}_{line.index}", "custom_id": line.custom_id}
    return False, json.dumps({**entry, "response": None, "error": {"code": code, "message": message}}).encode() + b"\n"


def _mark_expired(record: JobRecord) -> None:
    record["progress"].setdefault("expired_at", now_iso())


def _progress(done: int, total: int) -> dict[str, Any]:
    return {"step": done, "total_steps": total, "completed": 0, "failed": 0, "output_bytes": 0, "error_bytes": 0}
