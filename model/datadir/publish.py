"""Publishing a finished model: DATA_DIR/models/<name> appears whole, once, with the job that made it."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from model.datadir.jobs import encode
from model.datadir.layout import DataDir, now_iso
from model.files import atomic_write_bytes, fsync_dir

PROVENANCE = "bertserve_job.json"  # written into a published model: which job made it


def publish_model(data_dir: str | os.PathLike, job_id: str, source: Path, name: str) -> Path:
    """Move a finished model directory into DATA_DIR/models/<name> with one rename (same filesystem).

    The model carries a provenance file naming the job, so a retried publish (the worker died between
    the rename and the record update) recognises its own earlier result instead of failing.
    """
    target = DataDir(data_dir).model(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        if published_by(target) == job_id:
            shutil.rmtree(source, ignore_errors=True)
            return target
        raise FileExistsError(
            f"model '{name}' already exists in {target.parent} (made by something else "
            f"while this job ran); the trained model is kept in {source}"
        )
    provenance = {"job_id": job_id, "published_at": now_iso()}
    atomic_write_bytes(source / PROVENANCE, encode(provenance))
    try:
        os.rename(source, target)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and published_by(target) == job_id:
            return target
        raise
    fsync_dir(target.parent)
    return target


def published_by(model_dir: Path) -> str | None:
    """The id of the job that published this model directory, if a job did."""
    try:
        return json.loads((model_dir / PROVENANCE).read_bytes()).get("job_id")
    except (OSError, ValueError, AttributeError):
        return None
