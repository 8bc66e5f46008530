"""What a key may hold: its disk quota and its jobs at once.

A key's `disk_gb` (`bert keys add --disk-gb`) bounds what its jobs, datasets and models hold below DATA_DIR
(datadir/holdings.py). Checked where a key adds to the disk, before anything is written: POST /jobs (an estimate
of the job's checkpoints and model) and POST /datasets (before the upload streams in, and again with its size
before it is installed; an import from the Hub by the sizes the Hub lists before its download, and again with
the file it wrote). Over it: 507, with the numbers. What a running job writes beyond its estimate is not
stopped; the checkpoint retention (BERT_CHECKPOINT_RETENTION_DAYS) frees what cancelled and failed jobs leave.
A key's `max_jobs` bounds its jobs queued or running at once (training jobs and dataset imports): one more is a 429.
"""

from __future__ import annotations

from pathlib import Path

from app.errors import ServiceError
from app.keys.keyfile import Key
from datadir.holdings import holdings
from datadir.jobs import TERMINAL, JobRecords, owner_of
from model.sizing import GB, format_bytes

CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights and AdamW's two moments
MODEL_BYTES_PER_PARAMETER = 4  # the final model's fp32 weights


def job_disk_bytes(parameters: int, keep_last: int) -> int:
    """What a training job leaves on disk at most: keep_last checkpoints and the best one, and its model."""
    return parameters * (CHECKPOINT_BYTES_PER_PARAMETER * (keep_last + 1) + MODEL_BYTES_PER_PARAMETER)


def check_room(data_dir: Path, key: Key, adding: int, what: str) -> None:
    """507 when `key` has a disk quota and what it holds plus `adding` bytes (`what`, in words) would pass it
    (blocking: it walks the key's trees; call it in a thread)."""
    if key.disk_gb is None:
        return
    quota = int(key.disk_gb * GB)
    held = holdings(data_dir, key.name)
    if held.total + adding <= quota:
        return
    raise ServiceError(
        "insufficient_storage",
        f"key '{key.name}' holds {format_bytes(held.total)} on disk (jobs {format_bytes(held.jobs)}, datasets "
        f"{format_bytes(held.datasets)}, models {format_bytes(held.models)}) and {what} needs about "
        f"{format_bytes(adding)}: more than its disk quota of {key.disk_gb:g} GB (disk_gb); delete the jobs, "
        "datasets or model versions it no longer needs",
    )


def check_job_limit(records: JobRecords, owner: Key) -> None:
    """429 when `owner` has its `max_jobs` queued or running already (blocking: it reads the records)."""
    if owner.max_jobs is None:
        return
    running = [r for r in records.list() if r["state"] not in TERMINAL and owner_of(r) == owner.name]
    if len(running) >= owner.max_jobs:
        raise ServiceError(
            "overloaded",
            f"key '{owner.name}' has {len(running)} jobs queued or running, its limit (max_jobs); "
            "submit again when one has finished",
        )
