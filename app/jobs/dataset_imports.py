"""Datasets imported from the Hugging Face Hub by repo id: `POST /datasets` with a JSON body (an import job, run
by app/jobs/imports.py: 202, progress, cancel, resume) and `bert datasets import` (here, at once).

One split of one subset of a dataset repo is downloaded (model/dataset_sources.py: its files' sizes bounded by
BERT_MAX_DATASET_IMPORT_BYTES and the key's disk quota before any downloads), written as the file an upload of its
kind is (model/data/hub_rows.py: JSON Lines, or SQuAD JSON for qa; ClassLabel integers as their names), and
installed through the upload's own path (app/jobs/uploads.py: BERT_MAX_DATASET_BYTES, the format check in a child
process, meta.json, the rename into place). An import is therefore the upload of the same rows, and its meta.json
adds `source`: repo, revision and commit, subset, split, license, the rows read and the columns renamed.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.errors import ServiceError
from app.jobs.uploads import _install, check_fields
from app.settings import Settings
from datadir import DataDir
from datadir.datasets import staging_dir
from model.data.hub_rows import importable_kinds, lines_as_rows, write_split
from model.dataset_sources import fetch_split
from model.errors import UserError
from model.sources import Progress

SOURCE_KIND = "hub-dataset"  # an import job's source["kind"] when it makes a dataset (a model's: hub, archive)
COLUMNS_RULE = "columns: give them as SOURCE=COLUMN pairs, comma-separated (query=anchor,answer=positive)"


@dataclass(frozen=True)
class DatasetImport:
    """What to import: a repo's split (name[start:stop]) of a subset at a revision, renamed `columns`, as `kind`."""

    name: str
    repo: str
    revision: str | None = None
    subset: str | None = None
    split: str | None = None
    columns: dict[str, str] | None = None
    kind: str | None = None

    def params(self) -> dict[str, Any]:
        """The job's params, as GET /jobs/{id} shows them."""
        return {"source": self.repo, **{k: v for k, v in asdict(self).items() if k not in ("name", "repo")}}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> DatasetImport:
        params = dict(record["params"])
        return cls(name=record["dataset"], repo=params.pop("source"), **params)


def parse_columns(text: str) -> dict[str, str]:
    """ "query=anchor,answer=positive" as {"query": "anchor", "answer": "positive"}."""
    columns = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        source, sep, target = (x.strip() for x in pair.partition("="))
        if not sep or not source or not target:
            raise ValueError(f"{COLUMNS_RULE}, not {pair!r}")
        columns[source] = target
    return columns


def import_dataset(
    data_dir: Path,
    settings: Settings,
    request: DatasetImport,
    *,
    owner: str | None = None,
    shared: bool = True,
    check_room: Callable[[int], None] | None = None,
    progress: Progress | None = None,
    on_rows: Callable[[int], None] | None = None,
    staging: Path | None = None,
) -> dict[str, Any]:
    """Import `request` as dataset `request.name` (owned by `owner`; `shared`: every key may train on it) and
    return its meta.json. `check_room(bytes)` refuses it (the key's disk quota) before the download and before
    the install; `progress(done, total)` gets the bytes downloaded and `on_rows(rows)` the rows written (either
    may raise to stop it). The dataset is built in `staging` (a new folder, inside DATA_DIR: an import job's own,
    so that a killed attempt's is found again; default: a hidden one beside the datasets) and renamed into place.
    A ServiceError (a 409 for a name taken, a 422 for the rest) or a UserError says why not."""
    if request.kind is not None and request.kind not in importable_kinds():
        raise ServiceError(
            "validation", f"kind: a Hub dataset imports as {', '.join(importable_kinds())}, not {request.kind}"
        )
    check_fields({"name": request.name}, data_dir)  # the name's rule, and not taken, before any download
    if staging is None:
        tmp = staging_dir(data_dir, "hub-import")
    else:
        DataDir(data_dir).datasets.mkdir(parents=True, exist_ok=True)  # where it is renamed to
        staging.mkdir()
        tmp = staging
    try:
        fetched = fetch_split(
            request.repo,
            subset=request.subset,
            split=request.split,
            revision=request.revision,
            max_bytes=settings.max_dataset_import_bytes,
            limit="an import may download (BERT_MAX_DATASET_IMPORT_BYTES)",
            check_room=check_room,
            progress=progress,
        )
        where = f"{request.repo} (subset {fetched.source['subset']}, split {fetched.source['split']})"
        try:
            written = write_split(
                fetched.files,
                tmp,
                kind=request.kind,
                columns=request.columns,
                labels=fetched.labels,
                start=fetched.request.start,
                stop=fetched.request.stop,
                max_bytes=settings.max_dataset_bytes,
                limit="the most a dataset may hold (BERT_MAX_DATASET_BYTES)",
                on_rows=on_rows,
            )
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        size, digest = _size_and_digest(written.path)
        if check_room is not None:
            check_room(size)
        source = {**fetched.source, "rows": written.rows, "columns": written.columns or None}
        what = f"{where} as {written.kind}"
        fields = {"name": request.name, "kind": written.kind}
        extra = {"original_filename": _files_in_words(source["files"]), "source": source}
        try:
            return _install(
                tmp, written.path.name, fields, size, digest, data_dir, settings, owner, shared, check_room, extra
            )
        except ServiceError as e:
            if e.error_type != "validation":
                raise
            words = lines_as_rows(re.sub(r"^file: ", "", e.message), written.first_row)
            raise ServiceError("validation", f"{what}: {words.replace('the file', 'the rows')}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _size_and_digest(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _files_in_words(files: list[str]) -> str:
    """The split's files as meta.json's original_filename: the first, and how many more."""
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more"
