"""The files of the OpenAI-shaped /v1/files API: batch inputs users upload and the output and error
files batches produce (app/serving/batch_jobs.py).

    DATA_DIR/files/<file id>/file.json   {"id", "object": "file", "bytes", "created_at", "filename", "purpose"}
    DATA_DIR/files/<file id>/content     the bytes, as uploaded or produced

A file appears whole or not at all: its directory is filled under a temp name, fsynced and renamed
(datadir.files). A file is never changed; it stays until deleted or older than the retention the API sets.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import NotRequired, TypedDict

from datadir.files import TMP_PREFIX, fsync_dir, fsync_tree
from datadir.jobs import LEGACY_OWNER
from datadir.layout import DataDir

RECORD, CONTENT = "file.json", "content"
FILE_ID_PATTERN = r"^file-[A-Za-z0-9-]{1,80}$"
_FILE_ID_RE = re.compile(FILE_ID_PATTERN)


class FileRecord(TypedDict):
    id: str
    object: str  # "file"
    bytes: int
    created_at: int  # Unix seconds, as OpenAI's API has it
    filename: str
    purpose: str  # "batch" (an upload), "batch_output" (a batch's output or error file)
    owner: NotRequired[str]  # the key that uploaded it, or whose batch wrote it; absent: admin (file_owner)


def file_owner(record: FileRecord) -> str:
    return record.get("owner") or LEGACY_OWNER


class FileNotFound(KeyError):
    pass


def valid_file_id(file_id: object) -> bool:
    return isinstance(file_id, str) and bool(_FILE_ID_RE.fullmatch(file_id))


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class Files:
    """The files below DATA_DIR/files: add, read, list, delete, expire."""

    def __init__(self, data_dir: str | os.PathLike):
        self.root = DataDir(data_dir).files

    def file_dir(self, file_id: str) -> Path:
        if not valid_file_id(file_id):
            raise FileNotFound(file_id)
        return self.root / file_id

    def add(
        self, source: Path, filename: str, purpose: str, file_id: str | None = None, owner: str | None = None
    ) -> FileRecord:
        """Move `source` in as a new file of `owner` (`file_id`: a chosen id; adding it again returns the first)."""
        file_id = file_id or new_file_id()
        if self.exists(file_id):
            return self.read(file_id)
        record = FileRecord(
            id=file_id,
            object="file",
            bytes=source.stat().st_size,
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        if owner is not None:
            record["owner"] = owner
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{file_id}-{secrets.token_hex(3)}"
        tmp.mkdir()
        os.replace(source, tmp / CONTENT)
        (tmp / RECORD).write_text(json.dumps(record) + "\n")
        fsync_tree(tmp)
        os.rename(tmp, self.file_dir(file_id))
        fsync_dir(self.root)
        return record

    def exists(self, file_id: str) -> bool:
        return valid_file_id(file_id) and (self.root / file_id / RECORD).is_file()

    def read(self, file_id: str) -> FileRecord:
        try:
            return json.loads((self.file_dir(file_id) / RECORD).read_text())
        except FileNotFoundError:
            raise FileNotFound(file_id) from None

    def content(self, file_id: str) -> Path:
        if not self.exists(file_id):
            raise FileNotFound(file_id)
        return self.file_dir(file_id) / CONTENT

    def list(self, purpose: str | None = None) -> builtins.list[FileRecord]:
        """Every file (newest first), optionally only those of `purpose`."""
        if not self.root.is_dir():
            return []
        records = []
        for child in self.root.iterdir():
            if not valid_file_id(child.name):
                continue
            try:
                record = self.read(child.name)
            except (FileNotFound, ValueError):
                continue
            if purpose is None or record["purpose"] == purpose:
                records.append(record)
        return sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    def delete(self, file_id: str) -> None:
        """Remove a file (renamed away first, so a reader sees it whole or not at all)."""
        file_dir = self.file_dir(file_id)
        doomed = self.root / f"{TMP_PREFIX}deleted-{file_id}-{secrets.token_hex(3)}"
        try:
            os.rename(file_dir, doomed)
        except FileNotFoundError:
            raise FileNotFound(file_id) from None
        fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def expire(self, max_age_s: float) -> builtins.list[str]:
        """Delete the files older than `max_age_s`; their ids."""
        cutoff = time.time() - max_age_s
        gone = []
        for record in self.list():
            if record["created_at"] < cutoff:
                try:
                    self.delete(record["id"])
                except FileNotFound:
                    continue
                gone.append(record["id"])
        return gone
