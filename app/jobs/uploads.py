"""Dataset uploads: a streamed, size-capped, format-checked upload into DATA_DIR/datasets/<name>/
(the layout and meta.json are datadir.datasets').

Seven kinds: "corpus" (pretraining text: .txt in any of model.data's corpus formats, or .jsonl with a
"text" field), "labelled" (sequence classification: .csv/.tsv/.jsonl with "text" and "label" columns,
and an optional "text_pair"), "token-labelled" (token classification: CoNLL columns in .conll/.iob/
.iob2/.bio/.txt/.tsv, or .jsonl with "tokens" and "tags"; IOB2 tags), "qa" (extractive QA: SQuAD
v1.1/v2.0 .json), "pairs" and "scored-pairs" (sentence-transformers' columns in .csv/.tsv/.jsonl: anchor,
positive and hard negatives; sentence1, sentence2 and score) and "retrieval" (an evaluation set: a .zip
or .tar.gz of a BEIR folder, or one .jsonl of documents and queries). Where a suffix fits several kinds,
a table's header (a .jsonl's first record) picks among them by its columns, else the first is the
default; `kind` picks another. The multipart body is parsed as it arrives and the file part is written
straight into a hidden temp directory beside its destination, counting bytes, so an upload over
the limit stops at the limit (413) and nothing is buffered in memory or in /tmp. The directory is
renamed into place only after the format check passes: a dataset is there whole or not at all.
Names are never reused: a dataset a job was trained on stays what it was.

The format check, and the bounds on what one upload may hold, are app/jobs/dataset_checks.py's: it
reads the whole file in a child process with a CPU and time bound.

Failures say what happened: a body the multipart parser cannot read is a 422, a full disk (or
quota) while storing the upload a 507, and anything else a logged 500; the partial upload is
removed in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from app.errors import ServiceError
from app.jobs.dataset_checks import MAX_EXAMPLE_CHARS, check_file
from app.schemas.datasets import DatasetsResponse
from app.settings import Settings
from datadir import NAME_RULE, DataDir, DatasetExists, now_iso, valid_name
from datadir import list_datasets as list_dataset_metas
from datadir.datasets import DATASET_KINDS, META, dataset_bytes, install, staging_dir
from datadir.files import tree_bytes
from model.sources import ARCHIVE_SUFFIXES

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

log = logging.getLogger("bertserve")

# suffix -> the kinds a file with it can be, the default first
EXTENSIONS = {
    ".txt": ("corpus", "token-labelled"),
    ".csv": ("labelled", "pairs", "scored-pairs"),
    ".tsv": ("labelled", "token-labelled", "pairs", "scored-pairs"),
    ".jsonl": ("corpus", "labelled", "token-labelled", "pairs", "scored-pairs", "retrieval"),
    ".conll": ("token-labelled",),
    ".iob": ("token-labelled",),
    ".iob2": ("token-labelled",),
    ".bio": ("token-labelled",),
    ".json": ("qa",),
    **dict.fromkeys(ARCHIVE_SUFFIXES, ("retrieval",)),
}
# The columns (a .jsonl's first record's fields) that tell a kind of table from the suffix's default.
SNIFFED_COLUMNS = (
    ("pairs", {"anchor", "positive"}),
    ("scored-pairs", {"sentence1", "sentence2", "score"}),
    ("retrieval", {"query", "positive_ids"}),
    ("token-labelled", {"tokens", "tags"}),
    ("labelled", {"label"}),
)
MAX_FIELD_BYTES = 1024  # the name and kind form fields
MAX_PARTS = 8
FLUSH_BYTES = 1 << 20  # file data is written in ~1 MiB pieces, off the event loop
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

# ---------------------------------------------------------------------------- the upload


class _Upload:
    """Callbacks for python-multipart's streaming parser: fields kept small, the file part on disk."""

    FIELDS: tuple[str, ...] = ("name", "kind")  # the form's fields besides the file
    LIMIT = "dataset is larger than the limit of {} bytes (BERT_MAX_DATASET_BYTES)"

    def __init__(self, tmp_dir: Path, max_bytes: int, data_dir: Path):
        self.tmp_dir, self.max_bytes, self.data_dir = tmp_dir, max_bytes, data_dir
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = 0
        self.sha256 = hashlib.sha256()
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self._file: BinaryIO | None = None
        self._header_field = b""
        self._headers: dict[bytes, bytes] = {}
        self._part: str | None = None
        self._value = b""
        self.parts = 0

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
        }

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise ServiceError("validation", f"at most {MAX_PARTS} form fields: file, name and kind")
        self._headers, self._part, self._value = {}, None, b""

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        key = self._header_field.lower()
        self._headers[key] = self._headers.get(key, b"") + data[start:end]

    def on_header_end(self) -> None:
        self._header_field = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if "filename" in {k.decode("latin-1") for k in options}:
            if name != "file" or self.filename is not None:
                raise ServiceError("validation", "send exactly one file, in the form field 'file'")
            self.filename = options[b"filename"].decode("utf-8", "replace")
            self._check_filename()
            self._part = "file"
        elif name in self.FIELDS:
            self._part = name
        else:
            raise ServiceError(
                "validation", f"unknown form field {name[:40]!r}; expected {', '.join(('file', *self.FIELDS))}"
            )

    def _check_filename(self) -> None:
        filename = self.filename or ""
        ext = upload_suffix(filename)
        if ext not in EXTENSIONS:
            raise ServiceError("validation", f"file {filename[:80]!r}: expected a {', '.join(EXTENSIONS)} file")
        self._file = open(self.tmp_dir / f"data{ext}", "wb")  # noqa: SIM115  (open across the parser's callbacks)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._part == "file":
            self.file_bytes += len(chunk)
            if self.file_bytes > self.max_bytes:
                raise ServiceError("too_large", self.LIMIT.format(self.max_bytes))
            self.sha256.update(chunk)
            self.pending.append(chunk)
            self.pending_bytes += len(chunk)
        else:
            self._value += chunk
            if len(self._value) > MAX_FIELD_BYTES:
                raise ServiceError("validation", f"form field {self._part!r} is longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        if self._part in self.FIELDS:
            self.fields[self._part] = self._value.decode("utf-8", "replace").strip()
            self.check_fields()  # fail before the file is read, when sent first

    def check_fields(self) -> None:
        check_fields(self.fields, self.data_dir)

    def take_pending(self) -> bytes:
        data, self.pending, self.pending_bytes = b"".join(self.pending), [], 0
        return data

    def write(self, data: bytes) -> None:
        if data:
            assert self._file is not None  # opened when the file part began
            self._file.write(data)

    def close(self) -> None:
        """Flush the file to disk (where a full disk may first show) and close it."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self.abandon()

    def abandon(self) -> None:
        """Close the file without keeping its data (the upload failed; its directory goes)."""
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(
                OSError
            ):  # close may flush, and fail again on a full disk: the data is unwanted anyway
                file.close()


def upload_suffix(filename: str) -> str:
    """The suffix that says what a file is: its last (.csv), or its last two for a compressed tar (.tar.gz)."""
    name = filename.lower()
    return next((x for x in ARCHIVE_SUFFIXES if x.count(".") > 1 and name.endswith(x)), Path(name).suffix)


def check_fields(fields: dict[str, str], data_dir: Path) -> None:
    name, kind = fields.get("name"), fields.get("kind")
    if name is not None:
        if not valid_name(name):
            raise ServiceError("validation", f"name: {name[:80]!r} {NAME_RULE}")
        if DataDir(data_dir).dataset(name).exists():
            raise ServiceError(
                "conflict",
                f"name: dataset '{name}' already exists (datasets are never replaced; "
                "upload under another name, or delete it first)",
            )
    if kind is not None and kind not in DATASET_KINDS:
        raise ServiceError("validation", f"kind: {kind[:40]!r} is not one of {', '.join(DATASET_KINDS)}")


async def receive_upload(
    request: Request,
    data_dir: Path,
    settings: Settings,
    owner: str | None = None,
    shared: bool = True,
    check_room: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Stream a multipart upload into DATA_DIR/datasets/<name>/ and return its meta.json (with its
    `owner`, the uploading key's name, and whether every key may train on it: `shared`, an admin's upload).
    `check_room(bytes)` refuses it before anything is installed (the uploader's disk quota)."""
    max_bytes = settings.max_dataset_bytes
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise ServiceError(
            "validation",
            "send the dataset as multipart/form-data (curl -F file=@data.csv -F name=NAME -F kind=labelled), or JSON "
            '{"name": ..., "source": "<Hub dataset repo id>"} to import one',
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + 64 * 1024:
        raise ServiceError(
            "too_large", f"dataset is larger than the limit of {max_bytes} bytes (BERT_MAX_DATASET_BYTES)"
        )
    tmp = None
    try:
        tmp = await asyncio.to_thread(staging_dir, data_dir, "upload")
        upload = await _parse(request, options[b"boundary"], tmp, max_bytes, data_dir)
        return await asyncio.to_thread(_finish, upload, tmp, data_dir, settings, owner, shared, check_room)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            message = (
                f"not enough disk space in the data directory to store the dataset "
                f"({os.strerror(e.errno)}); the upload was removed"
            )
            raise ServiceError("insufficient_storage", message) from None
        raise


async def _parse(
    request: Request, boundary: bytes, tmp: Path, max_bytes: int, data_dir: Path, upload_class: type[_Upload] = _Upload
) -> _Upload:
    """Stream the body through python-multipart into `upload`; its file part lands in `tmp`."""
    upload = upload_class(tmp, max_bytes, data_dir)
    try:
        parser = MultipartParser(boundary, upload.callbacks())
        async for chunk in request.stream():
            parser.write(chunk)
            if upload.pending_bytes >= FLUSH_BYTES:
                await asyncio.to_thread(upload.write, upload.take_pending())
        parser.finalize()
        await asyncio.to_thread(upload.write, upload.take_pending())
        await asyncio.to_thread(upload.close)
    except (FormParserError, UnicodeDecodeError) as e:  # the parser's own errors: the body is not multipart
        log.info("malformed multipart body on POST %s: %s", request.url.path, e)  # the parser's words stay here
        raise ServiceError(
            "validation",
            "malformed multipart body: it does not follow the multipart/form-data "
            "format with the boundary its Content-Type names",
        ) from None
    except ClientDisconnect:  # nobody reads this answer; it keeps a hang-up out of the error log
        raise ServiceError("validation", "the client disconnected before the upload was complete") from None
    finally:
        await asyncio.to_thread(upload.abandon)  # a no-op after close(); else closed before its directory goes
    if upload.filename is None:
        raise ServiceError("validation", "no file: send it in the form field 'file'")
    return upload


def _finish(
    upload: _Upload,
    tmp: Path,
    data_dir: Path,
    settings: Settings,
    owner: str | None,
    shared: bool,
    check_room: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Name, kind and format checks, then meta.json and the rename into place (in a thread)."""
    assert upload.filename is not None  # _parse refuses an upload without a file
    fields = dict(upload.fields)
    fields.setdefault("name", Path(upload.filename).name[: -len(upload_suffix(upload.filename))])
    digest = upload.sha256.hexdigest()
    if check_room is not None:  # the uploader's disk quota, now that the size is known
        check_room(upload.file_bytes)
    return _install(
        tmp, upload.filename, fields, upload.file_bytes, digest, data_dir, settings, owner, shared, check_room
    )


def _install(
    tmp: Path,
    filename: str,
    fields: dict[str, str],
    size: int,
    sha256: str,
    data_dir: Path,
    settings: Settings,
    owner: str | None = None,
    shared: bool = True,
    check_room: Callable[[int], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict:
    """Check a dataset file already in `tmp` as data.<ext>, write meta.json (with `extra`: an import's
    original_filename and source), rename into place."""
    ext = upload_suffix(filename)
    fields.setdefault("kind", _sniff_kind(tmp / f"data{ext}", EXTENSIONS[ext]))
    check_fields(fields, data_dir)
    name, kind = fields["name"], fields["kind"]
    if kind not in EXTENSIONS[ext]:
        suffixes = "; ".join(f"{k}: {', '.join(x for x in EXTENSIONS if k in EXTENSIONS[x])}" for k in DATASET_KINDS)
        raise ServiceError("validation", f"kind: a {kind} dataset cannot be a {ext} file ({suffixes})")
    path = tmp / f"data{ext}"
    meta = {
        "name": name,
        "kind": kind,
        "file": path.name,
        "original_filename": filename[:200],
        "bytes": size,
        "sha256": sha256,
        "created_at": now_iso(),
        **({"owner": owner} if owner is not None else {}),
        "shared": shared,
        **(extra or {}),
    }
    meta.update(check_file(kind, path, settings))
    if check_room is not None and (unpacked := tree_bytes(tmp)) > size:  # an archive unpacked by its check
        check_room(unpacked)
    try:
        install(data_dir, tmp, meta)
    except DatasetExists:
        raise ServiceError("conflict", f"name: dataset '{name}' already exists") from None
    return meta


_listings: dict[str, tuple[tuple, bytes]] = {}


def listing_json(data_dir: Path, visible: Callable[[dict[str, Any]], bool] | None = None) -> bytes:
    """GET /datasets' body. It is serialised again only when a dataset comes or goes or its meta.json
    changes, so a client polling the list costs a directory scan, not a serialisation (in a thread).
    `visible` keeps only the datasets a key may see (serialised each time: a key's own view)."""
    if visible is not None:
        metas = [m for m in list_dataset_metas(data_dir) if visible(m)]
        metas = [{**m, "disk_bytes": dataset_bytes(data_dir, m["name"])} for m in metas]
        return DatasetsResponse(datasets=metas).model_dump_json().encode()
    root = DataDir(data_dir).datasets
    key = _listing_key(root)
    cached = _listings.get(str(root))
    if cached is not None and cached[0] == key:
        return cached[1]
    metas = [{**m, "disk_bytes": dataset_bytes(data_dir, m["name"])} for m in list_dataset_metas(data_dir)]
    body = DatasetsResponse(datasets=metas).model_dump_json().encode()
    _listings[str(root)] = (key, body)
    return body


def _listing_key(root: Path) -> tuple:
    """Each dataset's name and its meta.json's inode, mtime and size (meta.json is replaced, never edited),
    and the mtimes of its directory and its cache/ (which change as workers add token caches)."""
    key = []
    for name in sorted(os.listdir(root)) if root.is_dir() else ():
        if valid_name(name):
            try:
                st = os.stat(root / name / META)
            except (FileNotFoundError, NotADirectoryError):
                continue
            key.append(
                (name, st.st_ino, st.st_mtime_ns, st.st_size, _mtime(root / name), _mtime(root / name / "cache"))
            )
    return tuple(key)


def _mtime(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except (FileNotFoundError, NotADirectoryError):
        return None


def add_local_dataset(
    data_dir: Path, src: Path, name: str, kind: str | None = None, settings: Settings | None = None
) -> dict[str, Any]:
    """Register a file on this machine as a dataset, with the same checks as an upload (`make run`)."""
    settings = settings or Settings()
    ext = upload_suffix(str(src))
    if ext not in EXTENSIONS:
        raise ServiceError("validation", f"file: {src} must end in one of {', '.join(EXTENSIONS)}")
    tmp = staging_dir(data_dir, "local")
    try:
        shutil.copyfile(src, tmp / f"data{ext}")
        return install_file(tmp, Path(src).name, name, kind, data_dir, settings)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def install_file(
    tmp: Path,
    filename: str,
    name: str,
    kind: str | None,
    data_dir: Path,
    settings: Settings,
    owner: str | None = None,
    shared: bool = True,
    check_room: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Install a file already written into `tmp` (a staging_dir) as data.<the suffix of `filename`>, as an
    upload is installed: the same name, kind and format checks, meta.json (its size and sha256 read from the
    file) and the rename into place; `check_room(bytes)` before it. `tmp` is left for the caller to remove
    when this raises. Blocks: call it in a thread."""
    path = tmp / f"data{upload_suffix(filename)}"
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(FLUSH_BYTES):
            digest.update(chunk)
            size += len(chunk)
    if check_room is not None:
        check_room(size)
    fields = {"name": name, **({"kind": kind} if kind else {})}
    return _install(tmp, filename, fields, size, digest.hexdigest(), data_dir, settings, owner, shared, check_room)


def _sniff_kind(path: Path, kinds: tuple[str, ...]) -> str:
    """The kind among `kinds` that a table's columns (a .jsonl's first record's fields) name, else the first."""
    if len(kinds) > 1:
        columns = (
            _jsonl_fields(path)
            if path.suffix == ".jsonl"
            else _header(path)
            if path.suffix in (".csv", ".tsv")
            else set()
        )
        for kind, needed in SNIFFED_COLUMNS:
            if kind in kinds and needed <= columns:
                return kind
    return kinds[0]


def _jsonl_fields(path: Path) -> set[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        line = f.readline(MAX_EXAMPLE_CHARS + 1)
        while line and not line.strip():
            line = f.readline(MAX_EXAMPLE_CHARS + 1)
    try:
        record = json.loads(line)
    except (ValueError, TypeError, RecursionError):
        return set()
    return set(record) if isinstance(record, dict) else set()


def _header(path: Path) -> set[str]:
    """The first line of a .csv/.tsv split into its columns (a CoNLL .tsv has no header: its tokens come back)."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        line = f.readline(MAX_EXAMPLE_CHARS + 1)
    row = next(csv.reader([line], delimiter="\t" if path.suffix == ".tsv" else ","), [])
    return {column.strip() for column in row}
