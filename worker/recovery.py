"""Recovery sweep: re-enqueue jobs whose worker died, so no accepted job is ever stranded.

At worker start-up (Celery's worker_ready signal) every job in state queued or running whose lease
is free is sent again: a running one lost its worker (the lease is a flock the kernel dropped), and
a queued one may have lost its message (a broker without persistence, or the embedded transports,
which do not redeliver unacked messages). While the worker runs, a timer repeats the sweep for
running jobs only, so a job whose worker vanished is picked up even if that worker never restarts.
A message sent for a job that another delivery is already handling is harmless: that delivery finds
the lease taken or the job finished and does nothing.

When only the pool process dies (the OOM killer's SIGKILL), the worker's main process sees it as a
WorkerLostError with the signal; `note_lost_attempt` writes that reason into the job (worker/tasks.py
calls it before Celery requeues the message), so the job says why, not only how many attempts it took.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import re
import signal
import socket
import threading
from collections.abc import Callable

from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from datadir import TRAINING_KINDS, IllegalTransition, JobNotFound, JobRecords, jobs, runner
from worker.queue import send_job
from worker.settings import WorkerSettings

log = logging.getLogger("bertserve.worker")

_timer_stop = threading.Event()
# Set in the main process on a warm shutdown (SIGTERM); created before the pool forks, so the pool
# process running a job sees it too and hands the job back at its next step (worker/training.py).
shutting_down = multiprocessing.Event()


# What the sweep found a job to be, by its record's state: the job's event and the log line say it.
FOUND = {
    "queued": "queued, waiting for a worker; sent again in case the broker lost the message",
    "running": "left running by a worker that stopped; sent again to resume from the latest checkpoint",
}


def sweep(
    records: JobRecords, send: Callable[[str], None], states: tuple[str, ...] = ("queued", "running")
) -> list[str]:
    """Send again every training job in `states` whose lease is free (runner.resumable; the API runs imports
    and batches and resumes them itself); returns their ids. One log line per state found says what
    happened: a queued job was only waiting (on a first start, the bootstrap job is queued before the
    worker exists), a running one lost its worker."""
    sent: dict[str, list[str]] = {}
    for record in runner.resumable(records, TRAINING_KINDS, states):
        send(record["id"])
        try:
            records.move(record["id"], jobs.requeued, f"recovery sweep: {FOUND[record['state']]}")
        except (JobNotFound, IllegalTransition):  # removed, or finished by its delivery, since the listing
            continue
        sent.setdefault(record["state"], []).append(record["id"])
    for state, ids in ((s, sent[s]) for s in FOUND if s in sent):
        count = f"{len(ids)} job" if len(ids) == 1 else f"{len(ids)} jobs"
        log.info("recovery sweep: %s %s: %s", count, FOUND[state], ", ".join(ids))
    return [job_id for ids in sent.values() for job_id in ids]


def lost_reason(error: BaseException | str) -> str:
    """Why a pool process died, from billiard's WorkerLostError ("Worker exited prematurely: signal 9
    (SIGKILL) Job: 0."), in words for the job's record. The kernel's OOM killer sends SIGKILL, so that
    is the likely cause of one (a person's `kill -9` is the other)."""
    text = str(error)
    signal = re.search(r"signal (\d+) \((SIG\w+)\)", text)
    if signal and signal.group(2) == "SIGKILL":
        return "the worker process was killed (SIGKILL; likely out of memory: the kernel's OOM killer sends SIGKILL)"
    if signal:
        return f"the worker process was killed by signal {signal.group(1)} ({signal.group(2)})"
    code = re.search(r"exitcode (\d+)", text)
    if code:
        return f"the worker process exited unexpectedly (exit code {code.group(1)})"
    return f"the worker process was lost: {text}"


def job_of_process(records: JobRecords, pid: int | None, delivered: str) -> str:
    """The job that pool process `pid` was training: a delivery runs the queue's first job, which may
    not be the one its message named (worker/training.py: run_delivery); the record names its process."""
    identity = f"{socket.gethostname()}:{pid}"
    return next((r["id"] for r in records.list("running") if r.get("worker") == identity), delivered)


def note_lost_attempt(records: JobRecords, job_id: str, reason: str) -> None:
    """Record on a running job why its attempt's process died, for the next delivery's begin() to
    report (worker/training.py); called by the worker's main process, which saw the death."""

    with contextlib.suppress(JobNotFound, IllegalTransition):  # gone, or no longer running: nothing to say
        records.move(job_id, jobs.worker_process_lost, reason)


def celery_sender(app) -> Callable[[str], None]:
    def send(job_id: str) -> None:
        send_job(app, job_id)

    return send


def _periodic(app, records: JobRecords, interval: float) -> None:
    while not _timer_stop.wait(interval):
        try:
            sweep(records, celery_sender(app), states=("running",))
        except Exception:  # the broker may be down for a while; the next round tries again
            log.exception("periodic recovery sweep failed")


def install(settings: WorkerSettings) -> None:
    """Connect the sweep to worker start-up, the flag to worker shutdown and the pool processes' SIGTERM
    disposition to their start (Celery signals)."""

    def on_worker_ready(sender, **kwargs) -> None:
        app = sender.app
        records = JobRecords(settings.data_dir)
        try:
            sweep(records, celery_sender(app))
        except Exception:  # the broker may be down: the periodic sweep and redelivery still recover jobs
            log.exception("start-up recovery sweep failed")
        if settings.worker_sweep_interval_s > 0:
            threading.Thread(
                target=_periodic,
                args=(app, records, settings.worker_sweep_interval_s),
                daemon=True,
                name="bert-recovery-sweep",
            ).start()

    worker_ready.connect(on_worker_ready, weak=False)
    worker_shutting_down.connect(_on_shutdown, weak=False)
    worker_process_init.connect(_on_pool_process_start, weak=False)


def _on_shutdown(**kwargs) -> None:
    _timer_stop.set()
    shutting_down.set()


def _on_pool_process_start(**kwargs) -> None:
    """A pool process ignores SIGTERM: the worker's main process turns its own SIGTERM into the flag above, and
    the job hands back at its next step. systemd's stop (and a kill of the whole process group) sends SIGTERM
    to every process at once; billiard's handler made the pool process exit mid-step, the job lost its
    hand-back, and its main process's SIGTERM to the exiting process could kill it while it held the lock of
    its result pipe, so the main process's shutdown then waited on that lock for good. billiard leaves an
    ignored SIGTERM alone (as in its REMAP_SIGTERM mode); its own stops do not need it: a hung step is killed
    with SIGKILL after the SIGTERM, and a cold shutdown sets the flag too. torchrun and the ranks of a
    data-parallel job install their own SIGTERM handlers (worker/ddp_job.py)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
