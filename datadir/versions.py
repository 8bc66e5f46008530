"""A model's versions: DATA_DIR/models/<name>/v<N>/, and model.json naming the one that is served.

    DATA_DIR/models/<name>/model.json   {"promoted": N, "owner": key, "shared": bool}: the version requests
                                        get, the key that owns the name, whether every key may read it
    DATA_DIR/models/<name>/v<N>/        one version: a whole model directory in Hugging Face's layout
                                        (+ card.json, bertserve_job.json: which job or import made it)
    DATA_DIR/models/.<name>.lock        flock'ed by every writer of <name> (publish, promote, delete)

A legacy flat directory (config.json at the top of models/<name>) reads as one version, 1, at the top;
publishing to it first moves it into v1/ (publish.py) without the name ever disappearing.

Readers take no lock: model.json is replaced in one rename (temp, fsync, rename), a version appears
by renaming a whole directory into place, and a deletion renames the directory to a hidden temp name
before removing it, so a reader sees a version whole or not at all. Writers serialise on the lock
file, so two publishers never take one number. Only the promoted version may not be deleted while
others exist (promote another first); deleting the last version deletes the model.

A name belongs to the key that first published it (`owner`); only that key, or an admin, publishes
its next versions (publish.py). What model.json does not say (a model from before owners, a flat one)
belongs to admin and is shared: every key may read it. What an admin's job or import publishes first
(the `bert` command's imports too) is shared from the start; an admin may share or unshare any model
(publish.set_shared).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from datadir.files import atomic_write_bytes, remove_tree, tree_bytes
from datadir.jobs import LEGACY_OWNER, SHARED_OWNERS
from datadir.layout import DataDir, iso

MODEL_JSON = "model.json"
PROVENANCE = "bertserve_job.json"  # written into a published version: which job (or import) made it
_VERSION_RE = re.compile(r"v([1-9][0-9]{0,8})")


@dataclass(frozen=True)
class Access:
    """Who owns a model's name, and whether every key may read it."""

    owner: str
    shared: bool

    @classmethod
    def new(cls, owner: str) -> Access:
        return cls(owner, owner in SHARED_OWNERS)


class ModelNotFound(LookupError):
    def __init__(self, name: str):
        super().__init__(f"model '{name}' not found")
        self.name = name


class VersionNotFound(LookupError):
    def __init__(self, name: str, version: int, available: list[int]):
        there = ", ".join(map(str, available)) or "none"
        super().__init__(f"model '{name}' has no version {version} (versions: {there})")
        self.name, self.version, self.available = name, version, available


class PromotedVersion(Exception):
    """Deleting the version that is served while other versions exist."""

    def __init__(self, name: str, version: int, others: list[int]):
        super().__init__(
            f"version {version} of model '{name}' is the promoted one; promote another "
            f"({', '.join(map(str, others))}) before deleting it, or delete the whole model"
        )
        self.name, self.version, self.others = name, version, others


@dataclass
class Version:
    """One version of a model, as GET /models/{name} lists it."""

    version: int
    path: Path
    promoted: bool
    created_at: str | None  # when it was published (its provenance), else its directory's mtime
    made_by: str | None  # the job id (or import id) its provenance names
    disk_bytes: int
    owner: str | None = None  # the name of the key that made its job; None when no job made it


def version_of(path: Path) -> int:
    """The number of a published version from its directory (v<N>/; a flat model's top: 1)."""
    match = _VERSION_RE.fullmatch(path.name)
    return int(match.group(1)) if match else 1


def version_dir(model_root: Path, version: int) -> Path:
    return model_root / f"v{version}"


def is_flat(model_root: Path) -> bool:
    """A legacy single-version model: config.json at the top, no model.json."""
    return (model_root / "config.json").is_file() and not (model_root / MODEL_JSON).exists()


def version_numbers(model_root: Path) -> list[int]:
    """The versions a model directory holds, ascending ([1] for a flat one, [] for none)."""
    if is_flat(model_root):
        return [1]
    try:
        names = [child.name for child in model_root.iterdir() if child.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _VERSION_RE.fullmatch(n)))


def _model_json(model_root: Path) -> dict:
    try:
        found = json.loads((model_root / MODEL_JSON).read_bytes())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_promoted(model_root: Path) -> int | None:
    """model.json's promoted version (1 for a flat model), or None when there is none to read."""
    if is_flat(model_root):
        return 1
    promoted = _model_json(model_root).get("promoted")
    return promoted if isinstance(promoted, int) and not isinstance(promoted, bool) else None


def read_access(model_root: Path) -> Access:
    """Who owns the model and whether it is shared (see the module docstring for what is unsaid)."""
    found = {} if is_flat(model_root) else _model_json(model_root)
    owner = found.get("owner")
    access = Access.new(owner if isinstance(owner, str) and owner else LEGACY_OWNER)
    shared = found.get("shared")
    return Access(access.owner, shared) if isinstance(shared, bool) else access


def access_of(data_dir: str | os.PathLike, name: str) -> Access | None:
    """The access of model `name`, or None when there is no such model."""
    root = DataDir(data_dir).model(name)
    return read_access(root) if version_numbers(root) else None


def resolve(model_root: Path) -> tuple[int, Path] | None:
    """(version, directory) that requests for this model get: the promoted one (a flat model's top),
    or, when model.json is missing or names no version there, the newest; None: no model here."""
    if is_flat(model_root):
        return 1, model_root
    numbers = version_numbers(model_root)
    if not numbers:
        return None
    promoted = read_promoted(model_root)
    version = promoted if promoted in numbers else numbers[-1]
    return version, version_dir(model_root, version)


def served_dir(path: str | os.PathLike) -> Path:
    """`path` itself, unless it is a model with versions (DATA_DIR/models/<name>): then its promoted
    version's directory, so a command given a model's folder reads what requests get."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    found = resolve(path) if path.is_dir() else None
    return found[1] if found else path


def model_dir_for(data_dir: str | os.PathLike, name: str) -> Path | None:
    """The directory of `name`'s promoted version, or None when there is no such model."""
    found = resolve(DataDir(data_dir).model(name))
    return None if found is None else found[1]


def list_versions(data_dir: str | os.PathLike, name: str) -> list[Version]:
    """Every version of `name`, ascending, with its disk use and provenance; [] when there is no model."""
    root = DataDir(data_dir).model(name)
    found = resolve(root)
    if found is None:
        return []
    if is_flat(root):
        return [_describe(1, root, True)]
    return [_describe(n, version_dir(root, n), n == found[0]) for n in version_numbers(root)]


def disk_bytes(data_dir: str | os.PathLike, name: str) -> int:
    """Bytes the model holds on disk, every version together."""
    return tree_bytes(DataDir(data_dir).model(name))


def promote(data_dir: str | os.PathLike, name: str, version: int) -> None:
    """Make `version` the one requests get (model.json rewritten in one rename; a flat model's only
    version is 1 already). ModelNotFound, VersionNotFound."""
    root = DataDir(data_dir).model(name)
    with locked(data_dir, name):
        numbers = version_numbers(root)
        if not numbers:
            raise ModelNotFound(name)
        if version not in numbers:
            raise VersionNotFound(name, version, numbers)
        if not is_flat(root):
            write_promoted(root, version)


def delete_version(data_dir: str | os.PathLike, name: str, version: int) -> int:
    """Remove one version (the last one: the model); the bytes freed. ModelNotFound, VersionNotFound,
    PromotedVersion (the promoted one while others exist)."""
    root = DataDir(data_dir).model(name)
    with locked(data_dir, name):
        numbers = version_numbers(root)
        if not numbers:
            raise ModelNotFound(name)
        if version not in numbers:
            raise VersionNotFound(name, version, numbers)
        if numbers == [version]:
            return remove_tree(root)
        promoted = resolve(root)
        if promoted is not None and promoted[0] == version:
            raise PromotedVersion(name, version, [n for n in numbers if n != version])
        return remove_tree(version_dir(root, version))


def delete_model(data_dir: str | os.PathLike, name: str) -> int:
    """Remove a model with every version; the bytes freed. ModelNotFound."""
    root = DataDir(data_dir).model(name)
    with locked(data_dir, name):
        if not version_numbers(root):
            raise ModelNotFound(name)
        return remove_tree(root)


def write_promoted(model_root: Path, version: int, access: Access | None = None) -> None:
    """model.json naming `version`, with `access` (else the access it had, or admin's for a new one)."""
    access = access or read_access(model_root)
    record = {"promoted": version, "owner": access.owner, "shared": access.shared}
    atomic_write_bytes(model_root / MODEL_JSON, json.dumps(record).encode() + b"\n")


@contextlib.contextmanager
def locked(data_dir: str | os.PathLike, name: str) -> Iterator[None]:
    """Hold the writers' lock of model `name` (models/.<name>.lock, outside the model's own directory,
    so it survives the model's deletion and is never swapped away with it)."""
    root = DataDir(data_dir)
    lock = root.models / f".{root.model(name).name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def read_provenance(model_dir: Path) -> dict:
    try:
        provenance = json.loads((model_dir / PROVENANCE).read_bytes())
    except (OSError, ValueError):
        return {}
    return provenance if isinstance(provenance, dict) else {}


def _owner(provenance: dict, made_by: object) -> str | None:
    """The key that made the version's job; a job from before keys had names: LEGACY_OWNER."""
    owner = provenance.get("owner")
    if isinstance(owner, str):
        return owner
    return LEGACY_OWNER if isinstance(made_by, str) else None


def _describe(version: int, path: Path, promoted: bool) -> Version:
    provenance = read_provenance(path)
    created_at = provenance.get("published_at")
    if not isinstance(created_at, str):
        created_at = _mtime_iso(path)
    made_by = provenance.get("job_id")
    return Version(
        version=version,
        path=path,
        promoted=promoted,
        created_at=created_at,
        made_by=made_by if isinstance(made_by, str) else None,
        disk_bytes=tree_bytes(path),
        owner=_owner(provenance, made_by),
    )


def _mtime_iso(path: Path) -> str | None:
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return iso(dt.datetime.fromtimestamp(mtime, dt.UTC))
