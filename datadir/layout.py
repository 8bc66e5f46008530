"""Where things live below DATA_DIR, and the one rule for the names that become directories there.

    DATA_DIR/models/<name>/      a model: model.json (the promoted version) + v<N>/, each version a
                                 directory in Hugging Face's layout (versions.py; made by jobs, imports)
    DATA_DIR/datasets/<name>/    an uploaded dataset: data.<ext> + meta.json (datasets.py)
    DATA_DIR/jobs/<id>/          a training job: job.json, metrics.jsonl, checkpoints/ (jobs.py)
    DATA_DIR/files/<file id>/    a /v1/files file: file.json + content (batch_files.py)
    DATA_DIR/broker/             the filesystem:// broker's folders (worker/queue.py), when that transport is used
    DATA_DIR/.init.lock          held while a first start fills an empty DATA_DIR (`bert init`, `bert up`)
    DATA_DIR/defaults.json       the model the first start chose for /fill-mask and /nsp (defaults.py)

Models and datasets share one name rule: 1-64 letters, digits, '_', '-' or '.', starting with a
letter or digit, and not starting with "tmp" (any case). A name is therefore always one safe path
component: no slash, never "." or "..", never hidden, and never one of the temp names that atomic
writes and Python's tempfile use (".tmp-*", "tmp*"). Job ids are made here and have their own form.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import secrets
from pathlib import Path

MODELS, DATASETS, JOBS, FILES = "models", "datasets", "jobs", "files"
INIT_LOCK = ".init.lock"

NAME_MAX_LENGTH = 64
NAME_CHARACTERS = "A-Za-z0-9_.-"  # inside a regex's [...]
NAME_PATTERN = rf"^[A-Za-z0-9][{NAME_CHARACTERS}]{{0,{NAME_MAX_LENGTH - 1}}}$"
NAME_RULE = (
    f"must be a plain name: 1-{NAME_MAX_LENGTH} letters, digits, '_', '-' or '.', starting with a letter or digit "
    "(and not with 'tmp')"
)
JOB_ID_PATTERN = r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{8}$"
_NAME_RE, _JOB_ID_RE = re.compile(NAME_PATTERN), re.compile(JOB_ID_PATTERN)


def valid_name(name: object) -> bool:
    """Whether `name` may name a model or a dataset (see the module docstring)."""
    # fullmatch: re.match's `$` also matches before a final newline, so "ab\n" would pass
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and not name.lower().startswith("tmp")


def valid_job_id(job_id: object) -> bool:
    return isinstance(job_id, str) and bool(_JOB_ID_RE.fullmatch(job_id))


def new_job_id() -> str:
    """Sortable by creation time, unguessable enough to not collide: 20250131T120000-1a2b3c4d."""
    return f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(4)}"


def now_iso() -> str:
    """UTC timestamp with milliseconds, e.g. 2025-01-31T12:00:00.123Z (every record's time format)."""
    return iso(dt.datetime.now(dt.UTC))


def iso(t: dt.datetime) -> str:
    """An aware datetime in every record's time format (now_iso's)."""
    return t.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class DataDir:
    """The paths of one data directory. Names are checked: an invalid one is a ValueError, so no
    caller can build a path outside DATA_DIR from a request."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"DataDir({str(self.root)!r})"

    @property
    def models(self) -> Path:
        return self.root / MODELS

    @property
    def datasets(self) -> Path:
        return self.root / DATASETS

    @property
    def jobs(self) -> Path:
        return self.root / JOBS

    @property
    def files(self) -> Path:
        return self.root / FILES

    @property
    def init_lock(self) -> Path:
        return self.root / INIT_LOCK

    def model(self, name: str) -> Path:
        return self.models / _checked(name, "model")

    def dataset(self, name: str) -> Path:
        return self.datasets / _checked(name, "dataset")


def _checked(name: str, what: str) -> str:
    if not valid_name(name):
        raise ValueError(f"{what} name {str(name)[:80]!r} {NAME_RULE}")
    return name
