"""The keys file (BERT_KEYS_FILE, TOML): each key's name, scopes, allowed models and limits, and its
secret's sha256, never the secret.

    [keys.alice]
    hash = "sha256:9f86d0..."
    scopes = ["inference", "jobs"]
    rps = 20.0

A secret is `bsk_` and 32 random bytes (urlsafe base64), so a plain sha256 is a safe stored form (there
is nothing to guess by brute force) and a lookup by hash is one dict access; the caller confirms it with
hmac.compare_digest. `bert keys` changes the file under an flock of `<file>.lock`, and replaces it
atomically (temp file, fsync, rename), so concurrent commands never lose a key and the service never
reads half a file. Reference: https://docs.python.org/3/library/tomllib.html
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import tomllib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCOPES = ("inference", "jobs", "batch", "admin", "metrics")  # what each is for: docs/keys.md
# A key's name: a rule of its own, not datadir's for models and datasets (no directory is named after a key).
# Checked with fullmatch: re.match's `$` also matches before a final newline, so "admin\n" would pass.
KEY_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
SECRET_PREFIX = "bsk_"
BUILT_IN = ("api", "admin", "anonymous")  # BERT_API_KEY's, BERT_ADMIN_KEY's and a keyless caller's names


class KeyFileError(ValueError):
    """The keys file cannot be read as keys; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One key: who it is, what it may do, and its limits (None: no limit)."""

    name: str
    hash: str  # "sha256:<hex>" of the secret
    scopes: frozenset[str]
    models: tuple[str, ...] | None = None  # the models its inference requests may use; None: any
    rps: float | None = None  # requests per second, refilled continuously
    burst: int | None = None  # requests at once above the rate; None: max(1, rps)
    tokens_per_min: int | None = None  # tokens of inference requests per minute, counted after tokenising
    max_jobs: int | None = None  # its jobs queued or running at once
    max_priority: int | None = None  # the highest job priority it may ask for (POST /jobs refuses more)
    worker_share: float | None = None  # its share of worker time, (0, 1]: the queue orders by it (scheduling.py)
    disk_gb: float | None = None  # GB its jobs, datasets and models may hold on disk (app/jobs/quota.py)
    created_at: str | None = None

    @property
    def is_admin(self) -> bool:
        """The scope admin: every key's jobs, datasets, models, files and batches are this key's to see and change."""
        return "admin" in self.scopes

    def sees_jobs_of(self, owner: str) -> bool:
        """Whether the jobs of `owner` (a key's name) are this key's to see, by id too: its own, or every
        key's for a key with the scope admin. Another key's job is a 404, and named without its id."""
        return self.is_admin or owner == self.name

    def limits(self) -> dict[str, Any]:
        fields = ("rps", "burst", "tokens_per_min", "max_jobs", "max_priority", "worker_share", "disk_gb")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def check_name(name: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(KEY_NAME_PATTERN, name):
        raise KeyFileError(f"key name {name!r}: 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit")
    if name in BUILT_IN:
        raise KeyFileError(f"key name {name!r} is the name of a built-in key ({', '.join(BUILT_IN)})")
    return name


def check_key(key: Key) -> Key:
    """The key, or a KeyFileError that names the key and the value at fault."""
    check_name(key.name)
    where = f"key '{key.name}'"
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", key.hash):
        raise KeyFileError(f"{where}: hash must be 'sha256:' and 64 hex digits")
    if not key.scopes or not key.scopes <= set(SCOPES):
        raise KeyFileError(f"{where}: scopes must be some of {', '.join(SCOPES)}, got {sorted(key.scopes)}")
    for field, low in (("rps", 0.0), ("burst", 1), ("tokens_per_min", 1), ("max_jobs", 1), ("max_priority", 0)):
        value = getattr(key, field)
        if value is not None and (not math.isfinite(value) or value < low or (field == "rps" and value == 0)):
            raise KeyFileError(f"{where}: {field} must be {'> 0' if field == 'rps' else f'>= {low}'}, got {value}")
    if key.worker_share is not None and not 0 < key.worker_share <= 1:
        raise KeyFileError(f"{where}: worker_share must be in (0, 1], got {key.worker_share}")
    if key.disk_gb is not None and not (math.isfinite(key.disk_gb) and key.disk_gb > 0):
        raise KeyFileError(f"{where}: disk_gb must be > 0, got {key.disk_gb}")
    return key


def _key_from_table(name: str, table: Any) -> Key:
    if not isinstance(table, dict):
        raise KeyFileError(f"key '{name}' must be a table ([keys.{name}])")
    unknown = set(table) - {f.name for f in dataclasses.fields(Key)} - {"name"}
    if unknown:
        raise KeyFileError(f"key '{name}': unknown fields {', '.join(sorted(unknown))}")
    try:
        key = Key(
            name=name,
            hash=str(table["hash"]),
            scopes=frozenset(table.get("scopes", [])),
            models=tuple(table["models"]) if "models" in table else None,
            **{f: table[f] for f in ("rps", "burst", "tokens_per_min", "max_jobs", "max_priority") if f in table},
            worker_share=table.get("worker_share"),
            disk_gb=table.get("disk_gb"),
            created_at=table.get("created_at"),
        )
    except (KeyError, TypeError) as e:
        raise KeyFileError(f"key '{name}': {e} is missing or of the wrong type") from None
    for field, value in (("scopes", table.get("scopes")), ("models", table.get("models", []))):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise KeyFileError(f"key '{name}': {field} must be a list of names, got {value!r}")
    for field in ("rps", "burst", "tokens_per_min", "max_jobs", "max_priority", "worker_share", "disk_gb"):
        value = getattr(key, field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise KeyFileError(f"key '{name}': {field} must be a number, got {value!r}")
    return check_key(key)


def read_keys(path: Path) -> dict[str, Key]:
    """The keys of the file by name; {} when there is no file; KeyFileError when it cannot be read."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise KeyFileError(f"keys file {path}: {e}") from None
    keys = data.get("keys", {})
    if set(data) - {"keys"} or not isinstance(keys, dict):
        raise KeyFileError(f"keys file {path}: only [keys.<name>] tables belong in it")
    try:
        return {name: _key_from_table(name, table) for name, table in keys.items()}
    except KeyFileError as e:
        raise KeyFileError(f"keys file {path}: {e}") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, frozenset):  # scopes, in SCOPES' order
        value = [s for s in SCOPES if s in value]
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings (JSON's escapes are TOML's), ints and floats alike


def render(keys: dict[str, Key]) -> str:
    lines = ["# bertserve API keys, written by `bert keys`: secrets are kept only as their sha256.", ""]
    for key in keys.values():
        lines.append(f"[keys.{json.dumps(key.name)}]")
        for field in dataclasses.fields(Key):
            value = getattr(key, field.name)
            if field.name != "name" and value is not None:
                lines.append(f"{field.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `<path>.lock` (flock) while the file is read, changed and replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_keys(path: Path, keys: dict[str, Key]) -> None:
    """Replace the file atomically (temp file beside it, fsync, rename, fsync of the folder)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(render(keys))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def change(path: Path, edit: Callable[[dict[str, Key]], Any]) -> Any:
    """Read, edit (in place) and write the keys under the lock; what `edit` returned."""
    with locked(path):
        keys = read_keys(path)
        result = edit(keys)
        write_keys(path, keys)
        return result


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
