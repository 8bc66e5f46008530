"""Worker settings: one pydantic-settings object, read from environment variables.

The broker URL is the only thing that differs between a Redis deployment and the embedded
(server-less) one: `redis://host:6379/0`, `sqla+sqlite:////data/broker.sqlite` or `filesystem://`
(messages in DATA_DIR/broker, or `filesystem:///some/dir`). Every field's description is the
documentation's configuration table (docs/tables.py writes it).
Reference: https://docs.pydantic.dev/latest/concepts/pydantic_settings/
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from datadir.runner import HEARTBEAT_S
from model.compute.device import DEVICE_PATTERN
from worker.queue import VISIBILITY_TIMEOUT_S, BrokerUrlSetting, DataDirSetting, LogFormatSetting

DAY = 24 * 3600


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERT_", extra="ignore", populate_by_name=True)

    data_dir: DataDirSetting = Field(
        description=(
            "The same directory the service uses: jobs, datasets and models live below it. It must be one "
            "filesystem with working `flock` (a local disk or NFSv4)."
        ),
    )
    broker_url: BrokerUrlSetting = Field(
        description=(
            "Celery broker. For no server, use `sqla+sqlite:////abs/path/broker.sqlite` or "
            "`filesystem://` (messages in `DATA_DIR/broker`)."
        ),
    )
    log_format: LogFormatSetting
    visibility_timeout: int = Field(
        VISIBILITY_TIMEOUT_S,  # why a redelivery is harmless, and what it is for: worker/queue.py
        ge=10,
        description=(
            "Seconds before Redis hands a delivered, unacknowledged job to another worker. While the first worker "
            "still trains, the job's lease makes that copy a no-op."
        ),
    )
    job_soft_time_limit: int = Field(
        3 * DAY,
        ge=10,
        description=(
            "Seconds, per attempt. The loop stops at the next step, saves a checkpoint, and the job fails with "
            '"time limit". A job\'s own `max_runtime` (over all attempts) may stop it sooner.'
        ),
    )
    job_time_limit_grace: int = Field(
        600, ge=10, description="Celery kills a hung step this many seconds after the soft limit."
    )
    job_max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description=(
            "A job that has started this many times without finishing (its worker died) is failed, with the error."
        ),
    )
    job_heartbeat_s: float = Field(
        HEARTBEAT_S, gt=0, description="Seconds between lease heartbeats in `job.json` (`heartbeat_at`)."
    )
    job_progress_interval_s: float = Field(
        1.0,
        ge=0,
        description=(
            "At most one progress write to `job.json` per this many seconds. `metrics.jsonl` gets every log line."
        ),
    )
    worker_sweep_interval_s: float = Field(
        60.0,
        ge=0,
        description="Seconds between re-sends of running jobs whose worker died; 0 means only at start-up.",
    )
    job_preempt_after_s: float = Field(
        2.0,
        ge=0,
        description=(
            "Seconds a queued job of higher priority waits for a free worker before the lowest-priority running job "
            "hands itself back for it (at its next step, with a checkpoint). An idle worker takes a job well within "
            "this, so a job still waiting after it means every worker is busy."
        ),
    )
    job_max_preemptions_per_hour: int = Field(
        6,
        ge=0,
        description=(
            "How often in an hour one API key's jobs may make a running job hand itself back; past it, its "
            "jobs of higher priority wait for a free worker like the others (counted from the job records, "
            "over every worker). 0: a key's jobs never stop a running one."
        ),
    )
    job_preempt_check_s: float = Field(
        1.0,
        gt=0,
        description="Seconds between a running job's looks at the queue for a job of higher priority.",
    )
    worker_device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where training runs: `auto` (CUDA when the worker has it), `cpu`, `cuda` or `cuda:N`.",
    )
    worker_devices: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "The most processes a job's `params.devices` may use here (data parallel through torchrun). Unset: the "
            "GPUs torch sees when training on CUDA, else the CPU cores. A job asking for more fails, saying so. A "
            "data-parallel job on CUDA needs `BERT_WORKER_DEVICE` `auto` or `cuda` (each process takes "
            "`cuda:LOCAL_RANK`)."
        ),
    )
