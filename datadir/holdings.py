"""What each key holds on disk below DATA_DIR: its jobs' directories (checkpoints, mostly), the datasets it
uploaded and the models it owns (every version), by the owners the records, meta.json files and model.json
files name. Read by the per-key disk quota (app/jobs/quota.py); a walk of the owner's trees, so call it in a
thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from datadir.datasets import dataset_bytes, dataset_owner, list_datasets
from datadir.jobs import JobNotFound, JobRecords, owner_of
from datadir.layout import DataDir, valid_name
from datadir.versions import disk_bytes, read_access, version_numbers


@dataclass(frozen=True)
class Holdings:
    jobs: int
    datasets: int
    models: int

    @property
    def total(self) -> int:
        return self.jobs + self.datasets + self.models


def holdings(data_dir: str | os.PathLike, owner: str) -> Holdings:
    """The bytes `owner`'s jobs, datasets and models hold."""
    records = JobRecords(data_dir)
    jobs = 0
    for record in records.list():
        if owner_of(record) == owner:
            try:
                jobs += records.disk_bytes(record["id"])
            except (JobNotFound, FileNotFoundError):  # deleted since the listing
                continue
    datasets = sum(
        dataset_bytes(data_dir, meta["name"]) for meta in list_datasets(data_dir) if dataset_owner(meta) == owner
    )
    models = 0
    root = DataDir(data_dir).models
    for name in sorted(os.listdir(root)) if root.is_dir() else ():
        if valid_name(name) and version_numbers(root / name) and read_access(root / name).owner == owner:
            models += disk_bytes(data_dir, name)
    return Holdings(jobs, datasets, models)
