"""The Celery tasks: `bert.pretrain` and `bert.finetune`, each taking a job id.

Thin, like a web view: the message carries only the id; the job's spec, state and results live in
DATA_DIR/jobs/<id>/ (model/datadir), and the work happens in worker/training.py and model/. On a
warm shutdown (SIGTERM) the running job stops at its next step and is sent again (`requeue`).
"""

from __future__ import annotations

from .celery_app import app, settings
from .queue import TASK_NAMES
from .recovery import celery_sender, shutting_down
from .training import run_job


@app.task(name=TASK_NAMES["pretrain"], ignore_result=True)
def pretrain(job_id: str) -> dict:
    """Pretrain (MLM, + NSP) a model as DATA_DIR/jobs/<job_id>/job.json describes."""
    return run_job(job_id, "pretrain", settings, shutting_down=shutting_down, requeue=celery_sender(app))


@app.task(name=TASK_NAMES["finetune"], ignore_result=True)
def finetune(job_id: str) -> dict:
    """Fine-tune a classifier as DATA_DIR/jobs/<job_id>/job.json describes."""
    return run_job(job_id, "finetune", settings, shutting_down=shutting_down, requeue=celery_sender(app))
