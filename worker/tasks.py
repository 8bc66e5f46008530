"""The Celery task: `bert.train`, taking a job id (and, for messages sent by earlier versions, the
same task under its old names, `bert.pretrain` and `bert.finetune`).

Thin, like a web view: the message carries only the id; the job's kind, spec, state and results live
in DATA_DIR/jobs/<id>/ (datadir), and the work happens in worker/training.py and model/. A
delivery runs the queue's first job by priority (datadir/scheduling.py), which is usually the
message's own. On a
warm shutdown (SIGTERM) the running job stops at its next step and is sent again (`requeue`).
"""

from __future__ import annotations

import logging

from billiard.exceptions import WorkerLostError
from celery import Task
from celery.worker.request import Request

from datadir import JobRecords
from worker.celery_app import app, settings
from worker.queue import OLD_TASK_NAMES, TASK_NAME
from worker.recovery import celery_sender, job_of_process, lost_reason, note_lost_attempt, shutting_down
from worker.training import run_delivery

log = logging.getLogger("bertserve.worker")


class JobRequest(Request):
    """A delivery as the worker's main process sees it (Celery's "custom request" hook). When the pool
    process running the job dies, the reason (the signal) goes into the job's record before Celery
    requeues the message, so the next attempt can say why the last one ended."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        error = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback wraps it
        if isinstance(error, WorkerLostError) and self.args:
            try:
                records = JobRecords(settings.data_dir)
                note_lost_attempt(records, job_of_process(records, self.worker_pid, self.args[0]), lost_reason(error))
            except Exception:  # never stand in the way of the requeue
                log.exception("job %s: could not record why its worker process was lost", self.args[0])
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


class JobTask(Task):
    Request = JobRequest


def train(job_id: str) -> dict:
    """Pretrain or fine-tune a model as DATA_DIR/jobs/<job_id>/job.json describes (its `kind`)."""
    return run_delivery(job_id, settings, shutting_down=shutting_down, requeue=celery_sender(app))


train_task = app.task(name=TASK_NAME, ignore_result=True, base=JobTask)(train)
old_tasks = [app.task(name=name, ignore_result=True, base=JobTask)(train) for name in OLD_TASK_NAMES]
