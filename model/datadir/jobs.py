"""Training-job records: DATA_DIR/jobs/<id>/, the source of truth for every job (the broker only
carries its id), so a job outlives Redis.

    DATA_DIR/jobs/<id>/job.json        the record: spec, state, attempts, progress, timestamps, error
    DATA_DIR/jobs/<id>/metrics.jsonl   the trainer's curve (model.callbacks), plus resume marks
    DATA_DIR/jobs/<id>/checkpoints/    step-N directories (model.checkpoint), written atomically
    DATA_DIR/jobs/<id>/cancel          present once a cancel was asked for (the training loop polls it)
    DATA_DIR/jobs/<id>/.lease          flock'ed by the one process training the job (lease.py)
    DATA_DIR/jobs/<id>/.record.lock    flock'ed around every read-modify-write of job.json

job.json is only ever replaced by rename (temp file, fsync, rename), so readers never see half of it
and need no lock; writers serialise on `.record.lock` so two updates never lose each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from ..files import METRICS_FILE, TMP_PREFIX, atomic_write_bytes, fsync_dir, fsync_tree, read_jsonl, rewrite_jsonl
from .layout import DataDir, new_job_id, now_iso, valid_job_id

RECORD, CANCEL, LEASE, RECORD_LOCK = "job.json", "cancel", ".lease", ".record.lock"
METRICS = METRICS_FILE  # the trainer writes it: the job directory is the run directory

JOB_KINDS = ("pretrain", "finetune")
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
FORMAT_VERSION = 1
MAX_EVENTS = 100  # a job that is redelivered many times keeps only its latest events


class JobNotFound(KeyError):
    pass


class JobFinished(Exception):
    """What was asked of a job (a cancel) needs it unfinished, and it is `state`."""

    def __init__(self, job_id: str, state: str):
        super().__init__(f"job {job_id} is {state}")
        self.job_id, self.state = job_id, state


class JobStore:
    """The jobs below DATA_DIR/jobs: create, read, list, update (locked), cancel, metrics."""

    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = Path(data_dir)
        self.root = DataDir(data_dir).jobs

    def job_dir(self, job_id: str) -> Path:
        if not valid_job_id(job_id):
            raise JobNotFound(job_id)
        return self.root / job_id

    # -- records ----------------------------------------------------------------------------------

    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Write a new job in state "queued" (atomically: the directory appears with its record)."""
        job_id = new_job_id()
        now = now_iso()
        record = {
            "format_version": FORMAT_VERSION, "id": job_id, **spec, "state": "queued", "attempts": 0,
            "created_at": now, "updated_at": now, "enqueued_at": None, "started_at": None, "finished_at": None,
            "heartbeat_at": None, "worker": None, "progress": {}, "eval": None, "latest_checkpoint": None,
            "cancel_requested": False, "error": None, "result": None, "events": [],
        }
        add_event(record, "created")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{job_id}"
        tmp.mkdir()
        (tmp / RECORD).write_bytes(encode(record))
        fsync_tree(tmp)
        os.rename(tmp, self.root / job_id)
        fsync_dir(self.root)
        return record

    def read(self, job_id: str) -> dict[str, Any]:
        try:
            return json.loads((self.job_dir(job_id) / RECORD).read_bytes())
        except FileNotFoundError:
            raise JobNotFound(job_id) from None

    def exists(self, job_id: str) -> bool:
        return valid_job_id(job_id) and (self.root / job_id / RECORD).is_file()

    def list(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every job (newest first), optionally only those in `state`. Unreadable ones are skipped."""
        if not self.root.is_dir():
            return []
        records = []
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

    def unfinished_job_for_model(self, name: str) -> dict[str, Any] | None:
        """The queued or running job that will publish model `name`, if there is one."""
        return next((r for r in self.list() if r.get("model_name") == name and r["state"] not in TERMINAL), None)

    def update(self, job_id: str, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
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

    def discard_unclaimed(self, job_id: str, why: str) -> bool:
        """Remove a job whose message never left (publishing failed); True if it was removed.

        The record is closed first, under its lock, so a worker that found it anyway (a recovery
        sweep) sees a finished job and leaves it alone; a job a worker already started is kept.
        """
        unclaimed = False

        def close(record: dict) -> None:
            nonlocal unclaimed
            if record["state"] == "queued" and record["attempts"] == 0:
                unclaimed = True
                record["state"], record["error"] = "failed", f"{why}; the job was never queued"

        self.update(job_id, close)
        if unclaimed:
            job_dir = self.job_dir(job_id)
            doomed = job_dir.parent / f"{TMP_PREFIX}discard-{job_id}-{secrets.token_hex(3)}"
            job_dir.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        return unclaimed

    # -- cancel -----------------------------------------------------------------------------------

    def request_cancel(self, job_id: str) -> dict[str, Any]:
        """Cooperative cancel: a queued job is cancelled now; a running one when its loop next looks.
        Raises JobFinished for a job that has already succeeded, failed or been cancelled."""
        job_dir = self.job_dir(job_id)

        def change(record: dict) -> None:
            if record["state"] in TERMINAL:
                raise JobFinished(job_id, record["state"])  # before anything is written
            record["cancel_requested"] = True
            if record["state"] == "queued":
                record["state"], record["finished_at"] = "cancelled", now_iso()
                add_event(record, "cancelled", "while queued")
            else:
                add_event(record, "cancel requested")
            (job_dir / CANCEL).touch()

        return self.update(job_id, change)

    def cancel_requested(self, job_id: str) -> bool:
        return (self.job_dir(job_id) / CANCEL).exists()

    # -- metrics ----------------------------------------------------------------------------------

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
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


def steps_of(record: dict) -> tuple[int, int]:
    """(steps done, total steps) of a job as its latest progress report has them (until the first report,
    the max_steps its request set, else 0: a run of `epochs` knows its length once its data is read)."""
    progress = record.get("progress") or {}
    return progress.get("step") or 0, progress.get("total_steps") or record["params"].get("max_steps") or 0


def encode(record: dict) -> bytes:
    """A record as its file holds it: indented JSON, one trailing newline."""
    return (json.dumps(record, indent=1, sort_keys=False) + "\n").encode()


def add_event(record: dict, event: str, detail: str | None = None) -> None:
    entry = {"at": now_iso(), "event": event}
    if detail:
        entry["detail"] = detail
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
