"""Training jobs on the shared data directory: the record format, crash-safe updates and the lease.

The data directory, not the broker, is the source of truth, so a job outlives Redis:

    DATA_DIR/jobs/<id>/job.json        the record: spec, state, attempts, progress, timestamps, error
    DATA_DIR/jobs/<id>/metrics.jsonl   the trainer's curve (model.trainer.MetricsLog), plus resume marks
    DATA_DIR/jobs/<id>/checkpoints/    step-N directories (model.checkpoint), written atomically
    DATA_DIR/jobs/<id>/cancel          present once a cancel was asked for (the loop polls it)
    DATA_DIR/jobs/<id>/.lease          flock'ed by the one process training the job
    DATA_DIR/jobs/<id>/.record.lock    flock'ed around every read-modify-write of job.json

The app (HTTP side) and the worker both import this module; it needs only the standard library and
model.io, never fastapi or celery.

Exactly-once in effect: whoever trains a job holds an exclusive `flock` on its `.lease` for the whole
run. The kernel drops the lock when the process dies (SIGKILL, OOM, power), so "lock free while the
state says running" means "its worker died": the job may be resumed from its latest checkpoint. A
second delivery of the same job finds the lock taken (or the job finished) and does nothing. flock
needs no server, so it works the same with Redis and with the embedded (sqlite/filesystem) broker;
on NFS, Linux maps flock to NFS byte-range locks, which are shared between clients.

job.json is only ever replaced by rename (temp file, fsync, rename), so readers never see half of it
and need no lock; writers serialise on `.record.lock` so two updates never lose each other.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .io import TMP_PREFIX, atomic_write_bytes, fsync_dir, fsync_tree, read_jsonl

JOBS, MODELS, DATASETS = "jobs", "models", "datasets"
RECORD, METRICS, CANCEL, LEASE, RECORD_LOCK = "job.json", "metrics.jsonl", "cancel", ".lease", ".record.lock"
PROVENANCE = "bertserve_job.json"  # written into a published model: which job made it

KINDS = ("pretrain", "finetune")
TASK_NAMES = {"pretrain": "bert.pretrain", "finetune": "bert.finetune"}  # Celery task per job kind
TRAINING_QUEUE = "training"
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
FORMAT_VERSION = 1
MAX_EVENTS = 100  # a job that is redelivered many times keeps only its latest events

# Names of models and datasets: a plain identifier that is also a safe single path component (no
# dots, so no "..", no slashes, not hidden, at most 64 characters). "tmp*" is what atomic writes use.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
JOB_ID_PATTERN = r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{8}$"
_NAME_RE, _JOB_ID_RE = re.compile(NAME_PATTERN), re.compile(JOB_ID_PATTERN)


def valid_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME_RE.match(name)) and not name.lower().startswith("tmp")


def valid_job_id(job_id: object) -> bool:
    return isinstance(job_id, str) and bool(_JOB_ID_RE.match(job_id))


def now_iso() -> str:
    """UTC timestamp with milliseconds, e.g. 2025-01-31T12:00:00.123Z."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_job_id() -> str:
    """Sortable by creation time, unguessable enough to not collide: 20250131T120000-1a2b3c4d."""
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(4)}"


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@contextlib.contextmanager
def _flocked(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor drops the lock


class JobNotFound(KeyError):
    pass


class JobStore:
    """The jobs below DATA_DIR/jobs: create, read, list, update (locked), cancel, metrics."""

    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / JOBS

    # -- paths ------------------------------------------------------------------------------------

    def job_dir(self, job_id: str) -> Path:
        if not valid_job_id(job_id):
            raise JobNotFound(job_id)
        return self.root / job_id

    def model_dir(self, name: str) -> Path:
        assert valid_name(name), name
        return self.data_dir / MODELS / name

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
        (tmp / RECORD).write_bytes(_encode(record))
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
            except (JobNotFound, ValueError):
                continue
            if state is None or record.get("state") == state:
                records.append(record)
        return records

    def update(self, job_id: str, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """Read-modify-write job.json under its lock; `change` edits the record in place."""
        job_dir = self.job_dir(job_id)
        if not (job_dir / RECORD).is_file():
            raise JobNotFound(job_id)
        with _flocked(job_dir / RECORD_LOCK):
            record = json.loads((job_dir / RECORD).read_bytes())
            change(record)
            record["updated_at"] = now_iso()
            atomic_write_bytes(job_dir / RECORD, _encode(record))
        return record

    # -- cancel -----------------------------------------------------------------------------------

    def request_cancel(self, job_id: str) -> dict[str, Any]:
        """Cooperative cancel: a queued job is cancelled now; a running one when its loop next looks."""
        job_dir = self.job_dir(job_id)

        def change(record: dict) -> None:
            if record["state"] in TERMINAL:
                return
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
        path = self.job_dir(job_id) / METRICS
        if not self.exists(job_id):
            raise JobNotFound(job_id)
        return read_jsonl(path)

    def repair_metrics(self, job_id: str) -> None:
        """Rewrite metrics.jsonl without lines a killed writer left torn (the trainer reparses it on resume)."""
        path = self.job_dir(job_id) / METRICS
        if not path.is_file():
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        good = read_jsonl(path)
        if sum(1 for line in text.splitlines() if line.strip()) != len(good) or (text and not text.endswith("\n")):
            atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in good).encode())

    def append_metric(self, job_id: str, record: dict[str, Any]) -> None:
        with open(self.job_dir(job_id) / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _encode(record: dict) -> bytes:
    return (json.dumps(record, indent=1, sort_keys=False) + "\n").encode()


def add_event(record: dict, event: str, detail: str | None = None) -> None:
    entry = {"at": now_iso(), "event": event}
    if detail:
        entry["detail"] = detail
    record.setdefault("events", []).append(entry)
    del record["events"][:-MAX_EVENTS]




# ---------------------------------------------------------------------------- the lease

class Lease:
    """The right to train one job: an exclusive flock on DATA_DIR/jobs/<id>/.lease, held until release
    (or until the process dies, when the kernel drops it). A heartbeat thread stamps job.json so a
    reader can tell a live run from a stale record at a glance."""

    def __init__(self, store: JobStore, job_id: str):
        self.store, self.job_id = store, job_id
        self.path = store.job_dir(job_id) / LEASE
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self, wait_s: float = 0.0) -> bool:
        """Take the lease without blocking (retrying for up to `wait_s`); False when someone holds it."""
        deadline = time.monotonic() + wait_s
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.1)
                continue
            self._fd = fd
            os.ftruncate(fd, 0)
            os.write(fd, f"{worker_identity()} {now_iso()}\n".encode())
            return True

    def start_heartbeat(self, interval_s: float) -> None:
        if interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, args=(interval_s,), daemon=True,
                                        name=f"lease-heartbeat-{self.job_id}")
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.store.update(self.job_id, _stamp_heartbeat)
            except Exception:  # a failed beat must never kill the run; the next one retries
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _stamp_heartbeat(record: dict) -> None:
    if record.get("state") == "running":
        record["heartbeat_at"] = now_iso()


def lease_is_free(store: JobStore, job_id: str) -> bool:
    """True when no process holds the job's lease. Probing takes the lock for an instant, so only the
    worker side may call this (a delivery racing the probe skips, and the prober then re-enqueues)."""
    lease = Lease(store, job_id)
    if lease.try_acquire():
        lease.release()
        return True
    return False


# ---------------------------------------------------------------------------- publishing

def publish_model(store: JobStore, job_id: str, source: Path, name: str) -> Path:
    """Move a finished model directory into DATA_DIR/models/<name> with one rename (same filesystem).

    The model carries a provenance file naming the job, so a retried publish (the worker died between
    the rename and the record update) recognises its own earlier result instead of failing.
    """
    target = store.model_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        if _published_by(target) == job_id:
            shutil.rmtree(source, ignore_errors=True)
            return target
        raise FileExistsError(f"model '{name}' already exists in {target.parent} (made by something else "
                              f"while this job ran); the trained model is kept in {source}")
    provenance = {"job_id": job_id, "published_at": now_iso()}
    atomic_write_bytes(source / PROVENANCE, _encode(provenance))
    try:
        os.rename(source, target)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and _published_by(target) == job_id:
            return target
        raise
    fsync_dir(target.parent)
    return target


def _published_by(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / PROVENANCE).read_bytes()).get("job_id")
    except (OSError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------- broker options

def broker_transport_options(broker_url: str, data_dir: str | os.PathLike, visibility_timeout: int) -> dict:
    """Kombu transport options for a broker URL, shared by the app's publisher and the worker.

    Redis (and SQS) take the visibility timeout. The filesystem transport needs its folders: the
    URL's path (`filesystem:///srv/queue`) or DATA_DIR/broker, with the exchange table in a control/
    folder below it (kombu's default is ./control, in whatever the working directory is).
    """
    scheme = broker_url.split("://", 1)[0].lower()
    if scheme == "filesystem":
        path = Path(broker_url.split("://", 1)[1] or Path(data_dir) / "broker")
        (path / "control").mkdir(parents=True, exist_ok=True)
        return {"data_folder_in": str(path), "data_folder_out": str(path), "control_folder": str(path / "control")}
    if scheme in ("redis", "rediss", "redis+socket", "sqs"):
        return {"visibility_timeout": int(visibility_timeout)}
    return {}
