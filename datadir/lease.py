"""The lease: exactly-once training of a job, with no server.

Whoever trains a job holds an exclusive `flock` on DATA_DIR/jobs/<id>/.lease for the whole run. The
kernel drops the lock when the process dies (SIGKILL, OOM, power), so "lock free while the state
says running" means "its worker died": the job may be resumed from its latest checkpoint. A second
delivery of the same job finds the lock taken (or the job finished) and does nothing. flock works
the same with Redis and with the embedded (sqlite/filesystem) brokers; on NFS, Linux maps flock to
NFS byte-range locks, which are shared between clients.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time

from datadir.jobs import LEASE, JobRecord, JobRecords
from datadir.layout import now_iso

log = logging.getLogger(__name__)


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    """The right to train one job, held until release (or until the process dies). A heartbeat
    thread stamps job.json so a reader can tell a live run from a stale record at a glance."""

    def __init__(self, records: JobRecords, job_id: str):
        self.records, self.job_id = records, job_id
        self.path = records.job_dir(job_id) / LEASE
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
        self._thread = threading.Thread(
            target=self._beat, args=(interval_s,), daemon=True, name=f"lease-heartbeat-{self.job_id}"
        )
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.records.update(self.job_id, _stamp_heartbeat)
            except Exception as e:  # a full disk, a torn record: the run goes on, the next beat retries
                log.warning("job %s: heartbeat not written: %s: %s", self.job_id, type(e).__name__, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _stamp_heartbeat(record: JobRecord) -> None:
    if record.get("state") == "running":
        record["heartbeat_at"] = now_iso()


def lease_is_free(records: JobRecords, job_id: str) -> bool:
    """True when no process holds the job's lease. Probing takes the lock for an instant, so only the
    worker side may call this (a delivery racing the probe skips, and the prober then re-enqueues)."""
    lease = Lease(records, job_id)
    if lease.try_acquire():
        lease.release()
        return True
    return False
