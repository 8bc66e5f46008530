"""Publishing a finished model: the next version of DATA_DIR/models/<name>, whole, once, with the job
that made it and the key that made the job (its owner), promoted (versions.py has the layout).

A retried publish (the worker died between the rename and the record update) finds its own earlier
version by the provenance file and returns it instead of making another. A legacy flat model is
first moved into v1/: its files are hard-linked into a staged directory holding v1/ and model.json,
which is swapped with the flat one in one step (renameat2 RENAME_EXCHANGE), so the name never
disappears (where that call is missing, two renames leave it missing for a moment).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from datadir.files import TMP_PREFIX, _exchange, atomic_write_bytes, fsync_dir, fsync_tree
from datadir.jobs import JobNotFound, JobRecords, encode, owner_of
from datadir.layout import DataDir, now_iso
from datadir.versions import (
    PROVENANCE,
    is_flat,
    locked,
    read_provenance,
    version_dir,
    version_numbers,
    write_promoted,
)

__all__ = ["PROVENANCE", "publish_model", "published_by"]


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
        provenance = {"job_id": job_id, "published_at": now_iso(), **_owner(data_dir, job_id)}
        atomic_write_bytes(source / PROVENANCE, encode(provenance))
        if not root.exists():
            return _publish_first(root, source)
        if is_flat(root):
            _migrate_flat(root)
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


def _owner(data_dir: str | os.PathLike, job_id: str) -> dict[str, str]:
    """{"owner": the name of the key that made the job} (the version records it: the job may go)."""
    try:
        return {"owner": owner_of(JobRecords(data_dir).read(job_id))}
    except JobNotFound:
        return {}


def published_by(model_dir: Path) -> str | None:
    """The id of the job that published this model directory, if a job did."""
    job_id = read_provenance(model_dir).get("job_id")
    return job_id if isinstance(job_id, str) else None


def _published_version(root: Path, job_id: str) -> int | None:
    """The version of `root` that `job_id` published, if one did."""
    if is_flat(root):
        return 1 if published_by(root) == job_id else None
    return next((n for n in reversed(version_numbers(root)) if published_by(version_dir(root, n)) == job_id), None)


def _publish_first(root: Path, source: Path) -> Path:
    """A new model: v1/ and model.json staged beside it, then renamed into place together."""
    staged = _staging(root)
    os.rename(source, staged / "v1")
    write_promoted(staged, 1)
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


def _migrate_flat(root: Path) -> None:
    """Turn a flat model into v1/ + model.json in one swap (its files hard-linked, not copied)."""
    staged = _staging(root)
    try:
        _link_tree(root, staged / "v1")
        write_promoted(staged, 1)
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
