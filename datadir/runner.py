"""Leased work: one attempt at a job under its lease, the same for every kind of job and every process.

Training jobs (a Celery pool process, and the torchrun ranks it starts), model imports (threads of the API)
and batches (tasks on the API's event loop) all run through here, as Celery's own tasks leave retries, acks
and heartbeats to one place:

    take      flock DATA_DIR/jobs/<id>/.lease (lease.py); held elsewhere: RUNNING_ELSEWHERE, nothing done
    begin     decided under the record lock (`begin`): a finished job -> "already <state>"; a cancel asked
              for -> "cancelled"; a running record whose lease was free -> its attempt did not finish;
              too many attempts, or the job's max_runtime used up -> "failed"; else "run": started here
    beat      job.json's heartbeat_at every `heartbeat_s` (HEARTBEAT_S) while the body runs
    body      the kind's own work, given the Attempt; it ends the attempt through it (succeed, fail, cancel,
              hand back, or any other named transition with `end`) and returns the outcome in words
    end       an exception the body lets out fails the job, naming it; a cancelled asyncio task hands the
              job back; the lease is released, and only then `after_release` runs (send the job again)

`run` drives a blocking body (a thread, a pool process), `run_async` a coroutine (the API's loop). A rank of a
data-parallel run holds no lease (its launcher's process does): it ends the attempt through `Attempt.joined`.

`resumable` is the one resume rule: the unfinished jobs of some kinds whose lease is free. Each process asks it
for the kinds it runs (the worker: training jobs; the API: imports and batches) and starts them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from datadir import jobs
from datadir.jobs import TERMINAL, IllegalTransition, JobRecord, JobRecords
from datadir.lease import Lease, lease_is_free, worker_identity

log = logging.getLogger("bertserve.jobs")

HEARTBEAT_S = 10.0  # the lease heartbeat of every kind of job (the worker's BERT_JOB_HEARTBEAT_S defaults to it)
RUNNING_ELSEWHERE = "running elsewhere"
ERROR_LOG = "error.log"  # the traceback of the exception that failed a job, in its directory


def _always(record: JobRecord) -> bool:
    return True


class Attempt:
    """One attempt at job `job_id` by this process: its lease, and the transitions that end it."""

    def __init__(self, records: JobRecords, job_id: str, heartbeat_s: float = HEARTBEAT_S):
        self.records, self.job_id, self.heartbeat_s = records, job_id, heartbeat_s
        self.lease: Lease | None = Lease(records, job_id)
        self.record: JobRecord | None = None  # as `begin` wrote it

    @classmethod
    def joined(cls, records: JobRecords, record: JobRecord) -> Attempt:
        """The attempt another process began and holds the lease of (a data-parallel run's rank 0)."""
        attempt = cls(records, record["id"], heartbeat_s=0)
        attempt.lease, attempt.record = None, record
        return attempt

    def take(self, wait_s: float = 0.0) -> bool:
        """The lease, retried for up to `wait_s` (a resume probe holds it for an instant); False: held elsewhere."""
        assert self.lease is not None, "a joined attempt holds no lease"
        return self.lease.try_acquire(wait_s)

    def begin(self, max_attempts: int | None = None, may_cancel: Callable[[JobRecord], bool] = _always) -> str:
        """Decide what this attempt does (see the module docstring); "run" starts the job and its heartbeat."""
        assert self.lease is not None and self.lease.held, "begin holds the lease"
        outcome, self.record = begin(self.records, self.job_id, worker_identity(), max_attempts, may_cancel)
        if outcome == "run":
            self.lease.start_heartbeat(self.heartbeat_s)
        return outcome

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    # -- how an attempt ends ----------------------------------------------------------------------

    def end(self, transition: Callable[..., None], *args: Any, **fields: Any) -> JobRecord:
        """A named transition of datadir/jobs.py, with `fields` (runtime_s, progress...) written with it."""

        def change(record: JobRecord) -> None:
            record.update(fields)  # type: ignore[typeddict-item]
            transition(record, *args)

        return self.records.update(self.job_id, change)

    def succeed(self, result: dict[str, Any], detail: str, **fields: Any) -> str:
        return self.end(jobs.succeed, result, detail, **fields)["state"]

    def cancel(self, detail: str, **fields: Any) -> str:
        return self.end(jobs.cancel, detail, **fields)["state"]

    def fail(self, error: BaseException | str, message: str | None = None, **fields: Any) -> str:
        """Failed with `error`: an exception's traceback is kept in ERROR_LOG, and the record names it with its
        type (or says `message`, for an error a user can fix)."""
        if isinstance(error, BaseException):
            with contextlib.suppress(OSError):
                (self.records.job_dir(self.job_id) / ERROR_LOG).write_text("".join(traceback.format_exception(error)))
            message = message or f"{type(error).__name__}: {error}"
        return self.end(jobs.fail, message or str(error), **fields)["state"]

    def hand_back(self, detail: str) -> None:
        """Queued again, the attempt not counted (the process is stopping); nothing when it finished meanwhile."""
        with contextlib.suppress(IllegalTransition):
            self.end(jobs.hand_back, detail)


def begin(
    records: JobRecords,
    job_id: str,
    owner: str,
    max_attempts: int | None = None,
    may_cancel: Callable[[JobRecord], bool] = _always,
) -> tuple[str, JobRecord]:
    """For the process that has just taken a job's lease: decide under the record lock, and start the job
    by `owner` when the outcome is "run". With the record as it was written."""
    cancel_flag = records.cancel_requested(job_id)
    outcome = "run"

    def change(record: JobRecord) -> None:
        nonlocal outcome
        if record["state"] in TERMINAL:
            outcome = f"already {record['state']}"
        elif (cancel_flag or record.get("cancel_requested")) and may_cancel(record):
            jobs.cancel_before_start(record)
            outcome = "cancelled"
        else:
            if record["state"] == "running":  # its lease was free, so that attempt's process is gone
                jobs.attempt_did_not_finish(record)
            outcome = _start(record, owner, max_attempts)

    record = records.update(job_id, change)
    return outcome, record


def _start(record: JobRecord, owner: str, max_attempts: int | None) -> str:
    if max_attempts is not None and record["attempts"] >= max_attempts:
        last = record.get("error") or "the worker died during the attempt"
        jobs.give_up(record, f"gave up after {record['attempts']} attempts (BERT_JOB_MAX_ATTEMPTS); last: {last}")
        return "failed"
    error = _used_up(record)
    if error:
        jobs.time_out(record, error, error)
        return "failed"
    jobs.start(record, owner)
    return "run"


def _used_up(record: JobRecord) -> str | None:
    """The error when earlier attempts have used the job's whole max_runtime (one was killed past it)."""
    limit = record["params"].get("max_runtime")
    if not limit or (record.get("runtime_s") or 0) < limit:
        return None
    return (
        f"time limit: the job's max_runtime ({limit} s) was used up by its earlier attempts "
        f"({record['runtime_s']:.0f} s); latest checkpoint {record.get('latest_checkpoint')}"
    )


# -- the two drivers --------------------------------------------------------------------------------


def run(
    records: JobRecords,
    job_id: str,
    body: Callable[[Attempt], str],
    *,
    heartbeat_s: float = HEARTBEAT_S,
    wait_s: float = 0.0,
    max_attempts: int | None = None,
    may_cancel: Callable[[JobRecord], bool] = _always,
    after_release: Callable[[str], None] | None = None,
) -> str:
    """One attempt at a job with a blocking body, in this thread; returns the outcome in words."""
    attempt = Attempt(records, job_id, heartbeat_s)
    if not attempt.take(wait_s):
        return RUNNING_ELSEWHERE
    try:
        outcome = attempt.begin(max_attempts, may_cancel)
        if outcome == "run":
            try:
                outcome = body(attempt)
            except Exception as e:  # a bug or a full disk: said in the record and logged whole
                log.exception("job %s failed", job_id)
                outcome = _fail(attempt, e)
    finally:
        attempt.release()
    if after_release is not None:
        after_release(outcome)
    return outcome


async def run_async(
    records: JobRecords,
    job_id: str,
    body: Callable[[Attempt], Awaitable[str]],
    *,
    heartbeat_s: float = HEARTBEAT_S,
    wait_s: float = 0.0,
    may_cancel: Callable[[JobRecord], bool] = _always,
    stopping: str = "the API is stopping",
) -> str:
    """One attempt with a coroutine body, on this event loop (blocking steps in threads). Cancelling the task
    hands the job back (`stopping` says why) and re-raises."""
    attempt = Attempt(records, job_id, heartbeat_s)
    if not await asyncio.to_thread(attempt.take, wait_s):
        return RUNNING_ELSEWHERE
    try:
        outcome = await asyncio.to_thread(attempt.begin, None, may_cancel)
        if outcome == "run":
            outcome = await body(attempt)
    except asyncio.CancelledError:
        await asyncio.shield(asyncio.to_thread(attempt.hand_back, stopping))
        raise
    except Exception as e:
        log.exception("job %s failed", job_id)
        outcome = await asyncio.to_thread(_fail, attempt, e)
    finally:
        await asyncio.to_thread(attempt.release)
    return outcome


def _fail(attempt: Attempt, error: Exception) -> str:
    try:
        return attempt.fail(error)
    except IllegalTransition as e:  # it failed before it started, or ended meanwhile
        return e.state


# -- resuming ---------------------------------------------------------------------------------------


async def resume_here(
    records: JobRecords, kinds: Collection[str], running: Collection[str], start: Callable[[str], Any]
) -> list[str]:
    """For the jobs an API process runs as tasks (batches, mining): `start` each unfinished job of `kinds` that no
    process runs (`resumable`; `running`: the ids of this process's tasks), oldest first; their ids."""
    found = await asyncio.to_thread(resumable, records, kinds, here=running.__contains__)
    ids = sorted(r["id"] for r in found if r["id"] not in running)  # started here meanwhile: not again
    for job_id in ids:
        start(job_id)
    return ids


async def stop_tasks(tasks: Collection[asyncio.Task]) -> None:
    """Cancel an API process's job tasks and wait for them: each attempt hands its job back (run_async)."""
    running = [t for t in tasks if not t.done()]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


def resumable(
    records: JobRecords,
    kinds: Collection[str],
    states: Collection[str] = ("queued", "running"),
    here: Callable[[str], bool] = lambda job_id: False,
) -> list[JobRecord]:
    """The jobs of `kinds` in `states` that no process runs: not `here` (running in this process) and with a
    free lease. A queued job may have lost its message or its process; a running one lost its process."""
    return [
        record
        for record in records.list()
        if record.get("kind", "pretrain") in kinds
        and record["state"] in states
        and not here(record["id"])
        and lease_is_free(records, record["id"])
    ]


def orphans(records: JobRecords, among: list[JobRecord] | None = None) -> list[JobRecord]:
    """Running jobs whose lease is free: their process died; they wait at their place in the queue."""
    listed = records.list() if among is None else among
    return [r for r in listed if r["state"] == "running" and lease_is_free(records, r["id"])]
