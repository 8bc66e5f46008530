"""Publishing a finished model: the next version of DATA_DIR/models/<name>, whole, once, with the job
that made it and the key that made the job (its owner), promoted (versions.py has the layout).

A new name becomes the job's owner's, shared with every key when an admin made the job. A name another key owns takes no version from this job unless the
job was made by an admin (its record says `publish_any`, as records from before owners do): NotOwner, and
the trained model stays where it is.

A retried publish (the worker died between the rename and the record update) finds its own earlier
version by the provenance file and returns it instead of making another. A legacy flat model is
first moved into v1/: its files are hard-linked into a staged directory holding v1/ and model.json,
which is swapped with the flat one in one step (renameat2 RENAME_EXCHANGE), so the name never
disappears (where that call is missing, two renames leave it missing for a moment).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from datadir import audit
from datadir.files import TMP_PREFIX, _exchange, atomic_write_bytes, fsync_dir, fsync_tree
from datadir.jobs import LEGACY_OWNER, JobNotFound, JobRecords, encode, owner_of
from datadir.layout import DataDir, now_iso
from datadir.versions import (
    PROVENANCE,
    Access,
    ModelNotFound,
    is_flat,
    locked,
    read_access,
    read_promoted,
    read_provenance,
    version_dir,
    version_numbers,
    version_of,
    write_promoted,
)

__all__ = [
    "PROVENANCE",
    "NotOwner",
    "OWNER_RULE",
    "audit_publish",
    "publish_model",
    "published_by",
    "set_shared",
    "version_of",
]

log = logging.getLogger("bertserve.jobs")
OWNER_RULE = "a key publishes new model names, and new versions of the models it owns (an admin, of any)"


class NotOwner(PermissionError):
    """The model's name belongs to another key than the job's."""

    def __init__(self, name: str):
        super().__init__(f"model '{name}' belongs to another key: {OWNER_RULE}")
        self.name = name


def publish_model(data_dir: str | os.PathLike, job_id: str, source: Path, name: str) -> Path:
    """Move a finished model directory in as the next version of model `name` (one rename, same
    filesystem) and promote it; the version's directory. `job_id` (a job's, or an import's id) is
    written into it, so publishing again with the same id returns that version (promoted again)."""
    root = DataDir(data_dir).model(name)
    root.parent.mkdir(parents=True, exist_ok=True)
    with locked(data_dir, name):
        earlier = _published_version(root, job_id)
        if earlier is not None:
            shutil.rmtree(source, ignore_errors=True)
            if not is_flat(root):
                write_promoted(root, earlier)
            return root if is_flat(root) else version_dir(root, earlier)
        owner, publish_any = _publisher(data_dir, job_id)
        provenance = {"job_id": job_id, "published_at": now_iso(), **({"owner": owner} if owner else {})}
        if not root.exists():
            atomic_write_bytes(source / PROVENANCE, encode(provenance))
            return _publish_first(root, source, Access(owner or LEGACY_OWNER, shared=publish_any))
        if not publish_any and read_access(root).owner != owner:
            raise NotOwner(name)
        atomic_write_bytes(source / PROVENANCE, encode(provenance))
        if is_flat(root):
            migrate_flat(root)
        numbers = version_numbers(root)
        if not numbers:
            raise FileExistsError(
                f"{root} exists but holds no model (no config.json, no v<N>/ versions); "
                f"the trained model is kept in {source}"
            )
        target = version_dir(root, numbers[-1] + 1)
        os.rename(source, target)
        fsync_dir(root)
        write_promoted(root, numbers[-1] + 1)
        return target


def set_shared(data_dir: str | os.PathLike, name: str, shared: bool) -> Access:
    """Share model `name` with every key, or stop sharing it; its access as written. ModelNotFound."""
    root = DataDir(data_dir).model(name)
    with locked(data_dir, name):
        numbers = version_numbers(root)
        if not numbers:
            raise ModelNotFound(name)
        if is_flat(root):  # a flat model has no model.json to say so in: v1/ + model.json first
            migrate_flat(root)
        access = Access(read_access(root).owner, shared)
        write_promoted(root, read_promoted(root) or numbers[-1], access)
        return access


def _publisher(data_dir: str | os.PathLike, job_id: str) -> tuple[str | None, bool]:
    """(the name of the key that made the job, whether it may publish over any name). The version records the
    owner (the job may go). No record (the `bert` command's import), or one made before names had owners
    (no `publish_any`): as an admin's."""
    try:
        record = JobRecords(data_dir).read(job_id)
    except JobNotFound:
        return None, True
    return owner_of(record), bool(record.get("publish_any", True))


def audit_publish(data_dir: str | os.PathLike, job_id: str, name: str, path: Path, source: str) -> None:
    """The audit log's line for a version a job (or an import) published, naming the key that made the job;
    a log that cannot be written is logged, not the job's failure."""
    try:
        owner = owner_of(JobRecords(data_dir).read(job_id))
    except JobNotFound:
        owner = LEGACY_OWNER
    target = f"model {name} version {version_of(path)}"
    try:
        audit.append(Path(data_dir), owner, "model.publish", target, job=job_id, source=source)
    except OSError as e:
        log.warning("the audit log did not take %s (job %s): %s", target, job_id, e)


def published_by(model_dir: Path) -> str | None:
    """The id of the job that published this model directory, if a job did."""
    job_id = read_provenance(model_dir).get("job_id")
    return job_id if isinstance(job_id, str) else None


def _published_version(root: Path, job_id: str) -> int | None:
    """The version of `root` that `job_id` published, if one did."""
    if is_flat(root):
        return 1 if published_by(root) == job_id else None
    return next((n for n in reversed(version_numbers(root)) if published_by(version_dir(root, n)) == job_id), None)


def _publish_first(root: Path, source: Path, access: Access) -> Path:
    """A new model: v1/ and model.json staged beside it, then renamed into place together."""
    staged = _staging(root)
    os.rename(source, staged / "v1")
    write_promoted(staged, 1, access)
    try:
        os.rename(staged, root)
    except OSError as e:
        os.rename(staged / "v1", source)
        shutil.rmtree(staged, ignore_errors=True)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(f"{root} appeared while publishing; the trained model is kept in {source}") from None
        raise
    fsync_dir(root.parent)
    return version_dir(root, 1)


def migrate_flat(root: Path) -> None:
    """Turn a flat model into v1/ + model.json in one swap (its files hard-linked, not copied); the caller
    holds the model's lock."""
    staged = _staging(root)
    try:
        _link_tree(root, staged / "v1")
        write_promoted(staged, 1, read_access(root))
        fsync_tree(staged)
        if _exchange(staged, root):
            old = staged  # the exchange left the flat directory under the staged name
        else:
            old = root.parent / f"{TMP_PREFIX}flat-{root.name}-{uuid.uuid4().hex[:8]}"
            os.rename(root, old)
            os.rename(staged, root)
        fsync_dir(root.parent)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _staging(root: Path) -> Path:
    staged = root.parent / f"{TMP_PREFIX}{root.name}-{uuid.uuid4().hex[:8]}"
    staged.mkdir()
    return staged


def _link_tree(src: Path, dst: Path) -> None:
    """dst mirrors src's tree, each file a hard link (a copy where the filesystem refuses links)."""
    for dirpath, _, filenames in os.walk(src):
        here = dst / Path(dirpath).relative_to(src)
        here.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            try:
                os.link(os.path.join(dirpath, name), here / name)
            except OSError:
                shutil.copy2(os.path.join(dirpath, name), here / name)
