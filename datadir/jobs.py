"""Training-job records: DATA_DIR/jobs/<id>/, the source of truth for every job (the broker only
carries its id), so a job outlives Redis.

    DATA_DIR/jobs/<id>/job.json        the record: spec, state, attempts, progress, timestamps, error
    DATA_DIR/jobs/<id>/metrics.jsonl   the trainer's curve (model.training.callbacks), plus resume marks
    DATA_DIR/jobs/<id>/checkpoints/    step-N directories (model.training.checkpoint), written atomically
    DATA_DIR/jobs/<id>/cancel          present once a cancel was asked for (the training loop polls it)
    DATA_DIR/jobs/<id>/.lease          flock'ed by the one process training the job (lease.py)
    DATA_DIR/jobs/<id>/.record.lock    flock'ed around every read-modify-write of job.json
    DATA_DIR/jobs/.submit.lock         flock'ed while a new job is checked and created (any process)

job.json is only ever replaced by rename (temp file, fsync, rename), so readers never see half of it
and need no lock; writers serialise on `.record.lock` so two updates never lose each other.

A job's `state` and its `events` change only here, through the named transitions below (as Celery's
own task states are set in one place): TRANSITIONS declares every (state, event) -> state move; a
transition raises IllegalTransition, before it changes anything, for a move the table lacks.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import fcntl
import json
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypedDict, cast

from datadir.files import (
    METRICS_FILE,
    TMP_PREFIX,
    atomic_write_bytes,
    fsync_dir,
    fsync_tree,
    read_jsonl,
    remove_tree,
    rewrite_jsonl,
    tree_bytes,
)
from datadir.layout import DataDir, iso, new_job_id, now_iso, valid_job_id

SUBMIT_LOCK = ".submit.lock"
CHECKPOINTS = "checkpoints"  # a run directory's step-N checkpoints (model/training/checkpoint.py writes them)
RECORD, CANCEL, LEASE, RECORD_LOCK = "job.json", "cancel", ".lease", ".record.lock"
METRICS = METRICS_FILE  # the trainer writes it: the job directory is the run directory
_created = {"last": ""}  # the created_at of this process's newest job
_created_lock = threading.Lock()

# import: a model import the API runs (app/jobs/imports.py); batch: an inference batch the API runs
# (app/serving/batch_jobs.py); mine-negatives: hard negatives mined with a served model, published as a pairs
# dataset (app/jobs/mining.py)
JOB_KINDS = ("pretrain", "finetune", "import", "batch", "mine-negatives")
API_KINDS = frozenset(
    {"import", "batch", "mine-negatives"}
)  # run and resumed by the API process, never sent to the workers
TRAINING_KINDS = frozenset(JOB_KINDS) - API_KINDS  # run and resumed by the workers
PUBLISHING_KINDS = frozenset({"pretrain", "finetune", "import"})  # jobs whose model_name is a model they will publish
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
FORMAT_VERSION = 1
MAX_EVENTS = 100  # a job that is redelivered many times keeps only its latest events


class JobRecord(TypedDict, total=False):
    """job.json, as create() writes it and the transitions below change it (a plain dict on disk and
    in the API's responses). The spec's keys (kind, model_name, base_model, dataset, params, estimate)
    come from the app; runtime_s and lost_attempt appear once the worker writes them."""

    format_version: int
    id: str
    kind: str  # one of JOB_KINDS: the one place a job's kind is kept (the worker reads it here)
    model_name: str
    base_model: str | None
    dataset: str | None  # None for an import or a batch
    eval_dataset: str  # a fine-tuning job's evaluation data when it names one (else it holds some of `dataset` out)
    source: dict[str, Any]  # an import's source: {"kind": "hub", "repo", "revision"} or {"kind": "archive", "file"}
    params: dict[str, Any]
    estimate: dict[str, Any]
    state: str
    attempts: int
    created_at: str
    updated_at: str
    enqueued_at: str | None
    started_at: str | None
    finished_at: str | None
    heartbeat_at: str | None
    worker: str | None
    progress: dict[str, Any]
    eval: dict[str, Any] | None
    latest_checkpoint: str | None
    cancel_requested: bool
    error: str | None
    result: dict[str, Any] | None
    events: list[dict[str, str]]
    runtime_s: float
    lost_attempt: dict[str, Any]
    owner: str  # the name of the API key that made the job; records from before keys had names lack it
    priority: int  # the queue's order (datadir/scheduling.py); absent in older records: 0
    worker_share: float | None  # the owner's key's share of worker time when it submitted the job
    preempted_for: str | None  # the job this one last handed itself back for, while it waits again
    trace: str  # the W3C traceparent of the request that submitted it (with tracing on): its run's spans join it


LEGACY_OWNER = "admin"  # the owner of a record without one: it was made with the admin key, or with none
OPEN_OWNER = "anonymous"  # the owner of what a caller made where no key is needed (an open service)
# Owners whose models and datasets every key may use when their model.json or meta.json does not say: what was
# made before things had owners, or on an open service.
SHARED_OWNERS = frozenset({LEGACY_OWNER, OPEN_OWNER})


def owner_of(record: Mapping[str, Any]) -> str:
    return record.get("owner") or LEGACY_OWNER


class JobNotFound(KeyError):
    pass


class IllegalTransition(Exception):
    """A job in `state` cannot take `event` (TRANSITIONS has no such move); nothing was changed."""

    def __init__(self, job_id: str, state: str, event: str):
        super().__init__(job_id, state, event)
        self.job_id, self.state, self.event = job_id, state, event

    def __str__(self) -> str:
        return f"job {self.job_id} is {self.state}: '{self.event}' is not a move from {self.state}"


class JobFinished(IllegalTransition):
    """What was asked of a job (a cancel) needs it unfinished, and it is `state`."""

    def __init__(self, job_id: str, state: str, event: str = "cancel requested"):
        super().__init__(job_id, state, event)

    def __str__(self) -> str:
        return f"job {self.job_id} is {self.state}"


class JobUnfinished(Exception):
    """What was asked of a job (deleting it) needs it finished, and it is `state`."""

    def __init__(self, job_id: str, state: str):
        super().__init__(f"job {job_id} is {state}")
        self.job_id, self.state = job_id, state


class JobRecords:
    """The jobs below DATA_DIR/jobs: create, read, list, update (locked), cancel, metrics."""

    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = Path(data_dir)
        self.root = DataDir(data_dir).jobs

    def job_dir(self, job_id: str) -> Path:
        if not valid_job_id(job_id):
            raise JobNotFound(job_id)
        return self.root / job_id

    @contextlib.contextmanager
    def submitting(self) -> Iterator[None]:
        """Hold DATA_DIR/jobs/.submit.lock (flock) around the checks a new record depends on (a name in
        use, a key's count of jobs) and its creation: one submission at a time across every process of
        the data directory, API replicas included."""
        self.root.mkdir(parents=True, exist_ok=True)
        with _flocked(self.root / SUBMIT_LOCK):
            yield

    # -- records ----------------------------------------------------------------------------------

    def create(self, spec: dict[str, Any]) -> JobRecord:
        """Write a new job in state "queued" (atomically: the directory appears with its record)."""
        job_id = new_job_id()
        now = _creation_time()
        record = cast(
            JobRecord,
            {
                "format_version": FORMAT_VERSION,
                "id": job_id,
                **spec,
                "state": "queued",
                "attempts": 0,
                "created_at": now,
                "updated_at": now,
                "enqueued_at": None,
                "started_at": None,
                "finished_at": None,
                "heartbeat_at": None,
                "worker": None,
                "progress": {},
                "eval": None,
                "latest_checkpoint": None,
                "cancel_requested": False,
                "error": None,
                "result": None,
                "events": [],
            },
        )
        _add_event(record, "created")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{job_id}"
        tmp.mkdir()
        (tmp / RECORD).write_bytes(encode(record))
        fsync_tree(tmp)
        os.rename(tmp, self.root / job_id)
        fsync_dir(self.root)
        return record

    def read(self, job_id: str) -> JobRecord:
        try:
            return json.loads((self.job_dir(job_id) / RECORD).read_bytes())
        except FileNotFoundError:
            raise JobNotFound(job_id) from None

    def exists(self, job_id: str) -> bool:
        return valid_job_id(job_id) and (self.root / job_id / RECORD).is_file()

    def list(self, state: str | None = None) -> builtins.list[JobRecord]:
        """Every job (newest first), optionally only those in `state`. Unreadable ones are skipped."""
        if not self.root.is_dir():
            return []
        records: builtins.list[JobRecord] = []
        for child in sorted(self.root.iterdir(), reverse=True):
            if not valid_job_id(child.name):
                continue
            try:
                record = self.read(child.name)
            except (JobNotFound, ValueError):  # vanished since the listing, or not JSON: not a job
                continue
            if state is None or record.get("state") == state:
                records.append(record)
        return records

    def unfinished_job_for_model(self, name: str) -> JobRecord | None:
        """The queued or running job that will publish model `name`, if there is one."""
        return next(
            (
                r
                for r in self.list()
                if r.get("kind", "pretrain") in PUBLISHING_KINDS
                and r.get("model_name") == name
                and r["state"] not in TERMINAL
            ),
            None,
        )

    def delete(self, job_id: str) -> int:
        """Remove a finished job's directory (record, metrics, checkpoints); the bytes freed.

        The state is checked and the directory renamed away under the record lock, so no transition
        lands in between; JobUnfinished for a queued or running job, JobNotFound when there is none."""
        job_dir = self.job_dir(job_id)
        if not (job_dir / RECORD).is_file():
            raise JobNotFound(job_id)
        doomed = self.root / f"{TMP_PREFIX}deleted-{job_id}-{secrets.token_hex(4)}"
        with _flocked(job_dir / RECORD_LOCK):
            state = self.read(job_id)["state"]
            if state not in TERMINAL:
                raise JobUnfinished(job_id, state)
            os.rename(job_dir, doomed)
        fsync_dir(self.root)
        freed = tree_bytes(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return freed

    def expire_checkpoints(self, max_age_s: float, now: dt.datetime | None = None) -> dict[str, int]:
        """Remove the checkpoints of the cancelled and failed jobs that ended more than `max_age_s` ago (their
        records, curves and final models stay); {job id: bytes freed}."""
        cutoff = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(seconds=max_age_s)
        freed: dict[str, int] = {}
        for record in self.list():
            if record["state"] not in ("cancelled", "failed") or not _ended_before(record, cutoff):
                continue
            if not (self.job_dir(record["id"]) / CHECKPOINTS).is_dir():
                continue

            def expire(r: JobRecord) -> None:
                checkpoints = self.job_dir(r["id"]) / CHECKPOINTS
                if r["state"] in ("cancelled", "failed") and checkpoints.is_dir():  # not restarted meanwhile
                    freed[r["id"]] = remove_tree(checkpoints)
                    checkpoints_removed(r, freed[r["id"]])

            with contextlib.suppress(JobNotFound, IllegalTransition):
                self.update(record["id"], expire)
        return freed

    def disk_bytes(self, job_id: str) -> int:
        """Bytes a job's directory holds (its checkpoints, mostly)."""
        return tree_bytes(self.job_dir(job_id))

    def update(self, job_id: str, change: Callable[[JobRecord], Any]) -> JobRecord:
        """Read-modify-write job.json under its lock; `change` edits the record in place."""
        job_dir = self.job_dir(job_id)
        if not (job_dir / RECORD).is_file():
            raise JobNotFound(job_id)
        with _flocked(job_dir / RECORD_LOCK):
            record = json.loads((job_dir / RECORD).read_bytes())
            change(record)
            record["updated_at"] = now_iso()
            atomic_write_bytes(job_dir / RECORD, encode(record))
        return record

    def move(self, job_id: str, transition: Callable[..., None], *args: Any) -> JobRecord:
        """One named transition (below), written under the record lock; IllegalTransition leaves
        job.json as it was."""
        return self.update(job_id, lambda record: transition(record, *args))

    def discard_unclaimed(self, job_id: str, why: str) -> bool:
        """Remove a job whose message never left (publishing failed); True if it was removed.

        The record is closed first, under its lock, so a worker that found it anyway (a recovery
        sweep) sees a finished job and leaves it alone; a job a worker already started is kept.
        """
        unclaimed = False

        def close(record: JobRecord) -> None:
            nonlocal unclaimed
            if record["state"] == "queued" and record["attempts"] == 0:
                unclaimed = True
                discard(record, why)

        self.update(job_id, close)
        if unclaimed:
            job_dir = self.job_dir(job_id)
            doomed = job_dir.parent / f"{TMP_PREFIX}discard-{job_id}-{secrets.token_hex(3)}"
            job_dir.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        return unclaimed

    # -- cancel -----------------------------------------------------------------------------------

    def request_cancel(self, job_id: str) -> JobRecord:
        """Cooperative cancel: a queued job is cancelled now; a running one when its loop next looks.
        Raises JobFinished for a job that has already succeeded, failed or been cancelled."""
        job_dir = self.job_dir(job_id)

        def change(record: JobRecord) -> None:
            ask_to_cancel(record)  # raises JobFinished before anything is written
            (job_dir / CANCEL).touch()

        return self.update(job_id, change)

    def restart(self, job_id: str) -> JobRecord:
        """Queue a cancelled or failed job again (IllegalTransition otherwise); its cancel request goes."""
        job_dir = self.job_dir(job_id)

        def change(record: JobRecord) -> None:
            restart(record)  # raises before anything is written
            (job_dir / CANCEL).unlink(missing_ok=True)

        return self.update(job_id, change)

    def cancel_requested(self, job_id: str) -> bool:
        return (self.job_dir(job_id) / CANCEL).exists()

    # -- metrics ----------------------------------------------------------------------------------

    def metrics(self, job_id: str) -> builtins.list[dict[str, Any]]:
        """The job's metrics.jsonl records; a torn last line (a killed writer) is skipped."""
        if not self.exists(job_id):
            raise JobNotFound(job_id)
        return read_jsonl(self.job_dir(job_id) / METRICS)

    def repair_metrics(self, job_id: str) -> None:
        """Rewrite metrics.jsonl without lines a killed writer left torn (the trainer reparses it on resume)."""
        rewrite_jsonl(self.job_dir(job_id) / METRICS)

    def append_metric(self, job_id: str, record: dict[str, Any]) -> None:
        with open(self.job_dir(job_id) / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def steps_of(record: Mapping[str, Any]) -> tuple[int, int]:
    """(steps done, total steps) of a job as its latest progress report has them (until the first report,
    the max_steps its request set, else 0: a run of `epochs` knows its length once its data is read)."""
    progress = record.get("progress") or {}
    return progress.get("step") or 0, progress.get("total_steps") or record["params"].get("max_steps") or 0


def with_phase(progress: Mapping[str, Any], phase: str, done: int | None = None, total: int | None = None) -> dict:
    """A record's `progress` while its attempt gets ready to train: `phase`, what it does in words, and how
    far where it can tell (`phase_done` of `phase_total` bytes read). The steps of an earlier attempt stay;
    their ETA goes, as it no longer holds. The first step report replaces the whole (the phase with it)."""
    return {**progress, "eta_s": None, "phase": phase, "phase_done": done, "phase_total": total}


def phase_of(record: Mapping[str, Any]) -> str | None:
    """What a running job does before its first step report, in words ('tokenising the corpus: 1,048,576 of
    4,825,178 bytes read'); None once it reports steps, and for a job that is not running."""
    progress = record.get("progress") or {}
    phase = progress.get("phase")
    if not phase or record.get("state") != "running":
        return None
    done, total = progress.get("phase_done"), progress.get("phase_total")
    return f"{phase}: {done:,} of {total:,} bytes read" if done is not None and total else phase


def _ended_before(record: Mapping[str, Any], cutoff: dt.datetime) -> bool:
    ended = record.get("finished_at")
    if not isinstance(ended, str):
        return False
    try:
        return dt.datetime.fromisoformat(ended.replace("Z", "+00:00")) < cutoff
    except ValueError:
        return False


def encode(record: Mapping[str, Any]) -> bytes:
    """A record as its file holds it: indented JSON, one trailing newline."""
    return (json.dumps(record, indent=1, sort_keys=False) + "\n").encode()


# -- the lifecycle ------------------------------------------------------------------------------
#
# Every move a job makes, as (state, event) -> state: the one declaration of the lifecycle. An event
# is also what the move appends to the record's `events`. The functions below are the named
# transitions; each changes a record in memory (callers run it inside JobRecords.update or JobRecords.move,
# which write it atomically under the record lock) and raises IllegalTransition before changing
# anything when the table has no such move.

TRANSITIONS: dict[tuple[str, str], str] = {
    # The app notes the send after it, by when a quick worker (or a cancel) may have moved the job on.
    **{(state, "enqueued"): state for state in STATES},
    # A delivery that found the lease held: the holder has the job in whatever state.
    **{(state, "duplicate delivery ignored"): state for state in STATES},
    ("queued", "re-enqueued"): "queued",  # recovery sweep, or sent again after a hand-back
    ("running", "re-enqueued"): "running",  # recovery sweep (its worker died), or after lost ranks
    ("queued", "started"): "running",
    ("running", "started"): "running",  # a new attempt after one whose process died
    ("running", "attempt did not finish"): "running",  # noted by the next delivery, before it starts
    ("running", "worker process lost"): "running",  # noted by the worker's main process (the OOM killer)
    ("running", "training processes lost"): "running",  # a data-parallel rank died
    ("running", "resumed"): "running",  # from the latest checkpoint
    ("running", "cancel requested"): "running",  # the loop stops at its next step
    ("running", "handed back"): "queued",  # the worker shuts down: not a failed attempt
    ("running", "made way"): "queued",  # for a job of higher priority (scheduling.py): not a failed attempt
    ("cancelled", "restarted"): "queued",  # started again (the bootstrap job): resumes its checkpoint
    ("failed", "restarted"): "queued",
    ("running", "succeeded"): "succeeded",
    ("running", "failed"): "failed",
    ("queued", "time limit"): "failed",  # earlier attempts used up max_runtime
    ("running", "time limit"): "failed",
    ("queued", "too many attempts"): "failed",
    ("running", "too many attempts"): "failed",
    ("queued", "cancelled"): "cancelled",  # cancelled while queued
    ("running", "cancelled"): "cancelled",  # the loop saw the cancel request
    ("queued", "cancelled before it could run"): "cancelled",
    ("running", "cancelled before it could run"): "cancelled",
    ("queued", "discarded"): "failed",  # its message never left: the record is removed next
    # Past BERT_CHECKPOINT_RETENTION_DAYS (JobRecords.expire_checkpoints): the record, curve and final model stay.
    ("cancelled", "checkpoints removed"): "cancelled",
    ("failed", "checkpoints removed"): "failed",
}


def _move(
    record: JobRecord, event: str, detail: str | None = None, *, noted: Mapping[str, Any] | None = None, **fields: Any
) -> None:
    """Take the move TRANSITIONS has for (state, event), or raise before changing anything.
    Entering a finished state stamps finished_at and clears the heartbeat. `noted`: more fields of the
    event's entry in `events`."""
    state = record["state"]
    to = TRANSITIONS.get((state, event))
    if to is None:
        raise (JobFinished if state in TERMINAL else IllegalTransition)(record["id"], state, event)
    record.update(cast(JobRecord, fields))
    if to in TERMINAL and state not in TERMINAL:
        record["finished_at"], record["heartbeat_at"] = now_iso(), None
    record["state"] = to
    _add_event(record, event, detail, **(noted or {}))


def enqueued(record: JobRecord) -> None:
    """The app sent the job's message."""
    _move(record, "enqueued", enqueued_at=now_iso())


def requeued(record: JobRecord, detail: str) -> None:
    """A worker sent the unfinished job's message again."""
    _move(record, "re-enqueued", detail, enqueued_at=now_iso())


def duplicate_ignored(record: JobRecord, detail: str) -> None:
    _move(record, "duplicate delivery ignored", detail)


def start(record: JobRecord, worker: str) -> None:
    """A new attempt, on `worker`, now holding the lease."""
    attempt = record["attempts"] + 1
    _move(
        record,
        "started",
        f"attempt {attempt} on {worker}",
        attempts=attempt,
        worker=worker,
        heartbeat_at=now_iso(),
        started_at=record.get("started_at") or now_iso(),
        preempted_for=None,
    )


def attempt_did_not_finish(record: JobRecord) -> None:
    """Say why the last attempt's process is gone, if the worker's main process saw it die
    (worker_process_lost), and keep that as the job's error until it succeeds."""
    lost = record.get("lost_attempt") or {}
    reason = lost.get("reason") if lost.get("attempt") == record["attempts"] else None
    error = f"attempt {record['attempts']} did not finish: {reason or 'the worker died'}"
    _move(record, "attempt did not finish", error, error=error)


def worker_process_lost(record: JobRecord, reason: str) -> None:
    """The pool process running the attempt died (seen by the worker's main process)."""
    _lost(record, "worker process lost", reason)


def ranks_lost(record: JobRecord, reason: str) -> None:
    """A data-parallel attempt ended without an outcome (a rank died)."""
    _lost(record, "training processes lost", reason)


def _lost(record: JobRecord, event: str, reason: str) -> None:  # read by the next start's attempt_did_not_finish
    _move(record, event, reason, lost_attempt={"attempt": record["attempts"], "reason": reason, "at": now_iso()})


def resumed(record: JobRecord, checkpoint: str) -> None:
    _move(record, "resumed", f"from {checkpoint}")


def ask_to_cancel(record: JobRecord) -> None:
    """Cooperative cancel: a queued job is cancelled now; a running one when its loop next looks.
    Raises JobFinished for a finished job."""
    if record["state"] == "queued":
        _move(record, "cancelled", "while queued", cancel_requested=True)
    else:
        _move(record, "cancel requested", cancel_requested=True)


def hand_back(record: JobRecord, detail: str) -> None:
    """The worker is shutting down: the job is queued again, and the attempt is not counted."""
    _move(record, "handed back", detail, worker=None, heartbeat_at=None, attempts=max(0, record["attempts"] - 1))


def make_way(record: JobRecord, for_job: str, detail: str, for_owner: str | None = None) -> None:
    """The job handed itself back for job `for_job` (owned by `for_owner`), of higher priority: queued
    again, the attempt not counted. The event names both, so the records say how often each owner's jobs
    made others make way (scheduling.preemptions), even once that job is gone."""
    _move(
        record,
        "made way",
        detail,
        noted={"preempted_for": for_job, **({"preempted_for_owner": for_owner} if for_owner is not None else {})},
        worker=None,
        heartbeat_at=None,
        attempts=max(0, record["attempts"] - 1),
        preempted_for=for_job,
    )


def restart(record: JobRecord) -> None:
    """A cancelled or failed job queued again, with fresh attempts; it resumes from its latest checkpoint."""
    _move(
        record,
        "restarted",
        f"was {record['state']}" + (f": {record['error']}" if record.get("error") else ""),
        attempts=0,
        error=None,
        result=None,
        finished_at=None,
        cancel_requested=False,
        lost_attempt={},
    )


def succeed(record: JobRecord, result: dict, detail: str) -> None:
    _move(record, "succeeded", detail, result=result, error=None)


def fail(record: JobRecord, error: str) -> None:
    """The attempt raised (`error` is what it raised, in words)."""
    _move(record, "failed", error[:500], error=error)


def time_out(record: JobRecord, error: str, detail: str | None = None) -> None:
    """The job's max_runtime (or the worker's soft time limit) is used up."""
    _move(record, "time limit", detail, error=error)


def give_up(record: JobRecord, error: str) -> None:
    """Too many attempts (BERT_JOB_MAX_ATTEMPTS)."""
    _move(record, "too many attempts", error=error)


def cancel(record: JobRecord, detail: str) -> None:
    """The training loop stopped on the job's cancel request."""
    _move(record, "cancelled", detail)


def cancel_before_start(record: JobRecord) -> None:
    """A delivery found the cancel request before it started the job."""
    _move(record, "cancelled before it could run")


def discard(record: JobRecord, why: str) -> None:
    """The job's message never left: closed (then removed by JobRecords.discard_unclaimed)."""
    _move(record, "discarded", why, error=f"{why}; the job was never queued")


def checkpoints_removed(record: JobRecord, freed: int) -> None:
    """A cancelled or failed job's checkpoints were removed, its retention past: it restarts from scratch."""
    _move(record, "checkpoints removed", f"{freed} bytes freed", latest_checkpoint=None)


def _add_event(record: JobRecord, event: str, detail: str | None = None, **noted: Any) -> None:
    entry = {"at": now_iso(), "event": event}
    if detail:
        entry["detail"] = detail
    entry.update(noted)
    record.setdefault("events", []).append(entry)
    del record["events"][:-MAX_EVENTS]


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _creation_time() -> str:
    """now_iso(), a millisecond past this process's previous job's created_at where the clock has not moved on:
    the queue orders equal priorities by created_at (scheduling.order_key), so jobs one process submits within one
    millisecond keep the order they were submitted in rather than their ids' random part."""
    with _created_lock:
        now = now_iso()
        if now <= _created["last"]:
            now = iso(dt.datetime.fromisoformat(_created["last"]) + dt.timedelta(milliseconds=1))
        _created["last"] = now
        return now
