"""The Celery app for training jobs: `celery -A worker.celery_app worker -Q training --concurrency 1`
(or `bert worker`).

Configured from WorkerSettings (environment); the broker URL is the only difference between Redis
and the embedded, server-less transports (sqla+sqlite://, filesystem://). Every setting that matters
for hour-long jobs carries its reason. References: Celery's "Tasks" and "Optimizing" guides, the
Redis broker's caveats (visibility timeout), and Flask's Celery example (tasks as thin as views).
"""

from __future__ import annotations

from celery import Celery, signals

from worker import recovery
from worker.queue import TRAINING_QUEUE, broker_transport_options, has_fanout
from worker.settings import WorkerSettings
from worker.telemetry import logs, tracing


def make_celery(settings: WorkerSettings | None = None) -> Celery:
    settings = settings or WorkerSettings()
    app = Celery("bertserve", broker=settings.broker_url, include=["worker.tasks"])
    app.conf.update(
        # JSON only: a message can never make the worker unpickle something (tasks take a job id).
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # The outcome of a job lives in DATA_DIR/jobs/<id>/job.json; there is no result backend.
        task_ignore_result=True,
        # Ack after the task returns, not on receipt: a worker that dies mid-job leaves the message
        # to be redelivered, and the job resumes from its last checkpoint.
        task_acks_late=True,
        # ... and when the pool process itself is killed (OOM, SIGKILL), requeue instead of dropping.
        task_reject_on_worker_lost=True,
        # Reserve one message at a time: a worker busy for hours must not sit on other queued jobs.
        worker_prefetch_multiplier=1,
        # No worker_max_tasks_per_child=1 (a fresh process per job): billiard takes ~5 s to replace
        # the child, which every no-op duplicate delivery would pay; run_job frees CUDA memory instead.
        # Every task goes to the dedicated "training" queue that `bert worker` consumes.
        task_default_queue=TRAINING_QUEUE,
        task_routes={"bert.*": {"queue": TRAINING_QUEUE}},
        # The soft limit is cooperative (worker/training.py stops the loop at a step, with a checkpoint);
        # this hard limit only kills a step that hangs past it. No Celery soft limit: its exception
        # would land anywhere in the loop instead of between steps.
        task_time_limit=settings.job_soft_time_limit + settings.job_time_limit_grace,
        # Redis: how long a delivered, unacked message waits before another worker gets it (the lease
        # turns that second delivery into a no-op while the first still trains). filesystem://
        # gets its folders from here too, so the URL stays the only setting that differs.
        broker_transport_options=broker_transport_options(
            settings.broker_url, settings.data_dir, settings.visibility_timeout
        ),
        # Keep training through a broker outage: reconnect forever, do not cancel the running job
        # (its state is on the shared volume; the late ack is simply redone after reconnecting).
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # Remote control (celery inspect, Flower) needs a fanout exchange: on with Redis/AMQP, off with
        # the embedded transports, which have none. Flower turns task events on through it.
        worker_enable_remote_control=has_fanout(settings.broker_url),
    )
    return app


@signals.after_setup_logger.connect
def _log_lines(logger, format: str, **_) -> None:
    """BERT_LOG_FORMAT for the worker's lines: Celery's own text format with the job's ids after the message,
    or JSON lines (worker/telemetry/logs.py)."""
    for handler in logger.handlers:
        handler.setFormatter(logs.LogFormatter(settings.log_format, format))


settings = WorkerSettings()
tracing.configure("bertserve-worker")  # only when OTEL_* asks for traces; the pool processes inherit it
app = make_celery(settings)
recovery.install(settings)  # the recovery sweep at start-up and on a timer, the shutdown flag
