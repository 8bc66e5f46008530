"""The per-key disk quota: a key's `disk_gb` (`bert keys add --disk-gb`) bounds what its jobs, datasets and
models hold below DATA_DIR (datadir/holdings.py). Checked where a key adds to the disk, before anything is
written: POST /jobs (an estimate of the job's checkpoints and model) and POST /datasets (before the upload
streams in, and again with its size before it is installed). Over it: 507, with the numbers. What a running
job writes beyond its estimate is not stopped; the checkpoint retention (BERT_CHECKPOINT_RETENTION_DAYS)
frees what cancelled and failed jobs leave.
"""

from __future__ import annotations

from pathlib import Path

from app.errors import ServiceError
from app.keys.keyfile import Key
from datadir.holdings import holdings
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
