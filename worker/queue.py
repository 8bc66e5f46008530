"""The training queue as both sides see it: task names, the queue, kombu's transport options, the two
settings both read (the broker URL, DATA_DIR and the log format), and sending a job. The one module of worker/ that the
app imports (it publishes jobs; it never imports the worker's Celery app or its training code).

A message is one task, `bert.train`, with one argument, the job id: everything else, the job's kind
included, is in DATA_DIR/jobs/<id>/ (datadir). JSON only, so a message can never make anyone
unpickle anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AliasChoices, Field

if TYPE_CHECKING:
    from celery import Celery

TASK_NAME = "bert.train"  # every job; the worker reads its kind from the record
# Earlier versions sent one task per kind; a message of these names may still be queued at an upgrade,
# so the worker takes them too (as bert.train: the record, not the name, says the kind).
OLD_TASK_NAMES = ("bert.pretrain", "bert.finetune")
TRAINING_QUEUE = "training"
# Seconds before Redis (or SQS) hands a delivered, unacknowledged message to another worker. A job is acked
# when it ends (acks_late), hours later, so a copy may come while the first worker still trains: the job's
# lease makes that copy a no-op, and the copy is what resumes a job whose whole worker died when no other
# worker restarts to sweep it up. The workers' default (BERT_VISIBILITY_TIMEOUT) and the publisher's.
VISIBILITY_TIMEOUT_S = 3600
# The settings the service (app/settings.py) and the workers (worker/settings.py) share: one variable, one
# default and one type for both; each side's field gives its own description (the docs' two tables).
DataDirSetting = Annotated[Path, Field(default_factory=lambda: Path("./data"))]
BrokerUrlSetting = Annotated[
    str,
    Field(default="redis://127.0.0.1:6379/0", validation_alias=AliasChoices("BERT_BROKER_URL", "REDIS_URL")),
]
LogFormatSetting = Annotated[
    Literal["text", "json"],
    Field(
        default="text",
        description=(
            "Log lines: `text`, or `json` (one object per line: time, level, logger, message, and the request id, "
            "trace and span ids, key name and job id where known)."
        ),
    ),
]
_REDIS_SCHEMES = ("redis", "rediss", "redis+socket")
_FANOUT_SCHEMES = (*_REDIS_SCHEMES, "amqp", "amqps", "pyamqp")


def broker_transport_options(broker_url: str, data_dir: str | os.PathLike, visibility_timeout: int) -> dict:
    """Kombu transport options for a broker URL, the same for the publisher and the worker.

    Redis (and SQS) take the visibility timeout. The filesystem transport needs its folders: the
    URL's path (`filesystem:///srv/queue`) or DATA_DIR/broker, with the exchange table in a control/
    folder below it (kombu's default is ./control, in whatever the working directory is).
    """
    scheme = broker_url.split("://", 1)[0].lower()
    if scheme == "filesystem":
        path = Path(broker_url.split("://", 1)[1] or Path(data_dir) / "broker")
        (path / "control").mkdir(parents=True, exist_ok=True)
        return {"data_folder_in": str(path), "data_folder_out": str(path), "control_folder": str(path / "control")}
    if scheme in (*_REDIS_SCHEMES, "sqs"):
        return {"visibility_timeout": int(visibility_timeout)}
    return {}


def has_fanout(broker_url: str) -> bool:
    """Whether the transport has fanout exchanges (needed by remote control: celery inspect, Flower)."""
    return broker_url.split("://", 1)[0].lower() in _FANOUT_SCHEMES


def producer(broker_url: str, data_dir: str | os.PathLike, connect_timeout_s: float = 3.0) -> Celery:
    """A Celery app that only sends (the app's side): no tasks, no results, fails fast when the broker is down."""
    from celery import Celery  # here: the service imports Celery only once it publishes a job

    celery = Celery("bertserve-producer", broker=broker_url, set_as_current=False)
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        broker_transport_options=broker_transport_options(broker_url, data_dir, VISIBILITY_TIMEOUT_S),
        broker_connection_timeout=connect_timeout_s,
    )
    return celery


def send_job(celery: Celery, job_id: str, retries: int | None = None) -> None:
    """Send job `job_id` to the training queue (blocking). `retries`: publish attempts after the first
    before raising (quickly, within about a second each); None keeps Celery's default policy."""
    if retries is None:
        celery.send_task(TASK_NAME, args=[job_id], queue=TRAINING_QUEUE)
        return
    policy = {"max_retries": retries, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0}
    celery.send_task(TASK_NAME, args=[job_id], queue=TRAINING_QUEUE, retry=True, retry_policy=policy)
