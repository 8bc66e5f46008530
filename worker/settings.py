"""Worker settings: one pydantic-settings object, read from environment variables.

The broker URL is the only thing that differs between a Redis deployment and the embedded
(server-less) one: `redis://host:6379/0`, `sqla+sqlite:////data/broker.sqlite` or `filesystem://`
(messages in DATA_DIR/broker, or `filesystem:///some/dir`). Every field is in the README's
configuration table. Reference: https://docs.pydantic.dev/latest/concepts/pydantic_settings/
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.device import DEVICE_PATTERN

DAY = 24 * 3600


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERT_", extra="ignore", populate_by_name=True)

    # Shared with the app: jobs, datasets and models live below it (a volume both can see).
    data_dir: Path = Path("./data")
    # Celery broker. REDIS_URL is accepted too, as docker-compose setups usually name it.
    broker_url: str = Field("redis://127.0.0.1:6379/0",
                            validation_alias=AliasChoices("BERT_BROKER_URL", "REDIS_URL"))
    # Seconds Redis waits for a delivered, unacknowledged job before handing it to another worker.
    # The lease makes such a redelivery harmless (it finds the job running and does nothing); it is
    # what resumes a job whose whole worker died when no other worker restarts to sweep it up.
    visibility_timeout: int = Field(3600, ge=10)
    # Soft limit: the loop stops at the next step, saves a checkpoint and fails the job ("time limit").
    job_soft_time_limit: int = Field(3 * DAY, ge=10)
    # Hard limit: Celery kills the process this many seconds after the soft limit (a hung step).
    job_time_limit_grace: int = Field(600, ge=10)
    # A job that has started this many times without finishing (worker deaths) is failed.
    job_max_attempts: int = Field(3, ge=1, le=100)
    # Seconds between lease heartbeats written into job.json (heartbeat_at).
    job_heartbeat_s: float = Field(10.0, gt=0)
    # At most one job.json progress write per this many seconds (metrics.jsonl gets every log line).
    job_progress_interval_s: float = Field(1.0, ge=0)
    # Seconds between sweeps that re-enqueue running jobs whose worker died (0: only at start-up).
    worker_sweep_interval_s: float = Field(60.0, ge=0)
    # Where training runs: "auto" picks CUDA when the worker has it.
    worker_device: str = Field("auto", pattern=DEVICE_PATTERN)  # or cuda:N
    # The most processes a job's params.devices may ask of this worker (data parallel through
    # torchrun); unset: the GPUs torch sees when training on CUDA, else the CPU cores.
    worker_devices: int | None = Field(None, ge=1, le=1024)
