"""Recovery sweep: re-enqueue jobs whose worker died, so no accepted job is ever stranded.

At worker start-up (Celery's worker_ready signal) every job in state queued or running whose lease
is free is sent again: a running one lost its worker (the lease is a flock the kernel dropped), and
a queued one may have lost its message (a broker without persistence, or the embedded transports,
which do not redeliver unacked messages). While the worker runs, a timer repeats the sweep for
running jobs only, so a job whose worker vanished is picked up even if that worker never restarts.
A message sent for a job that another delivery is already handling is harmless: that delivery finds
the lease taken or the job finished and does nothing.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Callable

from celery.signals import worker_ready, worker_shutting_down

from model.datadir import JobNotFound, JobStore, add_event, lease_is_free, now_iso

from .queue import send_job
from .settings import WorkerSettings

log = logging.getLogger("bertserve.worker")

_timer_stop = threading.Event()
# Set in the main process on a warm shutdown (SIGTERM); created before the pool forks, so the pool
# process running a job sees it too and hands the job back at its next step (worker/training.py).
shutting_down = multiprocessing.Event()


def sweep(store: JobStore, send: Callable[[str, str], None],
          states: tuple[str, ...] = ("queued", "running")) -> list[str]:
    """Send again every job in `states` whose lease is free; returns their ids."""
    sent = []
    for record in store.list():
        if record.get("state") not in states or not lease_is_free(store, record["id"]):
            continue
        send(record["id"], record["kind"])
        try:
            store.update(record["id"], _mark_requeued)
        except JobNotFound:
            continue
        sent.append(record["id"])
    if sent:
        log.info("recovery sweep re-enqueued %d job(s): %s", len(sent), ", ".join(sent))
    return sent


def _mark_requeued(record: dict) -> None:
    record["enqueued_at"] = now_iso()
    add_event(record, "re-enqueued", f"recovery sweep (state was {record['state']}, lease free)")


def celery_sender(app) -> Callable[[str, str], None]:
    def send(job_id: str, kind: str) -> None:
        send_job(app, job_id, kind)
    return send


def _periodic(app, store: JobStore, interval: float) -> None:
    while not _timer_stop.wait(interval):
        try:
            sweep(store, celery_sender(app), states=("running",))
        except Exception:  # the broker may be down for a while; the next round tries again
            log.exception("periodic recovery sweep failed")


def install(settings: WorkerSettings) -> None:
    """Connect the sweep to worker start-up and the flag to worker shutdown (Celery signals)."""

    def on_worker_ready(sender, **kwargs) -> None:
        app = sender.app
        store = JobStore(settings.data_dir)
        try:
            sweep(store, celery_sender(app))
        except Exception:  # the broker may be down: the periodic sweep and redelivery still recover jobs
            log.exception("start-up recovery sweep failed")
        if settings.worker_sweep_interval_s > 0:
            threading.Thread(target=_periodic, args=(app, store, settings.worker_sweep_interval_s),
                             daemon=True, name="bert-recovery-sweep").start()

    worker_ready.connect(on_worker_ready, weak=False)
    worker_shutting_down.connect(_on_shutdown, weak=False)


def _on_shutdown(**kwargs) -> None:
    _timer_stop.set()
    shutting_down.set()
