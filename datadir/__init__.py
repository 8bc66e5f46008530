"""The data directory: the ground floor that model/, worker/ and app/ all stand on.

The service (app/) and the workers (worker/) import this package and nothing of each other; it needs
only the standard library, never torch, a web or a queue framework. Everything the two sides share
lives on disk below DATA_DIR, written crash-safely (temp, fsync, rename):

    files.py     crash-safe files: atomic directories and files, fsync, the JSON-lines readers
    audit.py     the audit log: who changed what, one appended JSON line each
    layout.py    where things live, the name rule, job ids, timestamps
    jobs.py      job records (job.json), their states and named transitions, cancel requests, metrics
    lease.py     the flock lease that makes a job train exactly once, and its heartbeat
    runner.py    one attempt at a job under its lease (every kind, every process), and the resume rule
    datasets.py  uploaded datasets and their meta.json
    versions.py  a model's versions (models/<name>/v<N>/), the promoted one (model.json), deletion
    publish.py   a finished model in as the next version of DATA_DIR/models/<name>, with its provenance
    cards.py     a model's card.json: its source and measured scores
    batch_files.py  uploaded and produced files of the OpenAI-shaped /v1/files API (batch input and output)
    defaults.py  defaults.json: the model the first start chose for /fill-mask and /nsp
    scheduling.py  the order queued jobs run in (priority, then age), preemption, queue positions
"""

from datadir import runner, scheduling
from datadir.datasets import DatasetExists, dataset_file, delete_dataset, list_datasets, read_meta
from datadir.jobs import (
    API_KINDS,
    JOB_KINDS,
    STATES,
    TERMINAL,
    TRAINING_KINDS,
    TRANSITIONS,
    IllegalTransition,
    JobFinished,
    JobNotFound,
    JobRecord,
    JobRecords,
    JobUnfinished,
)
from datadir.layout import (
    JOB_ID_PATTERN,
    NAME_CHARACTERS,
    NAME_MAX_LENGTH,
    NAME_PATTERN,
    NAME_RULE,
    DataDir,
    new_job_id,
    now_iso,
    valid_job_id,
    valid_name,
)
from datadir.lease import Lease, lease_is_free, worker_identity
from datadir.publish import PROVENANCE, publish_model, published_by
from datadir.versions import (
    ModelNotFound,
    PromotedVersion,
    Version,
    VersionNotFound,
    delete_model,
    delete_version,
    list_versions,
    model_dir_for,
    promote,
)

__all__ = [
    "API_KINDS",
    "DataDir",
    "DatasetExists",
    "IllegalTransition",
    "JOB_ID_PATTERN",
    "JOB_KINDS",
    "JobFinished",
    "JobNotFound",
    "JobRecord",
    "JobRecords",
    "JobUnfinished",
    "Lease",
    "ModelNotFound",
    "NAME_CHARACTERS",
    "NAME_MAX_LENGTH",
    "NAME_PATTERN",
    "NAME_RULE",
    "PROVENANCE",
    "PromotedVersion",
    "STATES",
    "TERMINAL",
    "TRAINING_KINDS",
    "TRANSITIONS",
    "Version",
    "VersionNotFound",
    "dataset_file",
    "delete_dataset",
    "delete_model",
    "delete_version",
    "lease_is_free",
    "list_datasets",
    "list_versions",
    "model_dir_for",
    "new_job_id",
    "now_iso",
    "promote",
    "runner",
    "scheduling",
    "publish_model",
    "published_by",
    "read_meta",
    "valid_job_id",
    "valid_name",
    "worker_identity",
]
