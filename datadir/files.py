"""Crash-safe files: atomic directory and file writes, fsync, and the two JSON-lines readers.

Every model and checkpoint directory is written with `atomic_dir`: files go into a hidden temp
directory beside the target, are fsynced, and the directory is renamed into place, so a process
killed mid-write leaves either the old directory or the new one, never half of one. Single files
(job records, metrics, tokenizer files) go through `atomic_write_bytes` the same way.

JSON lines are read two ways: `read_jsonl` for files this project appends to while it runs
(metrics.jsonl), which skips the torn last line a killed writer leaves; `iter_jsonl_objects` for a
user's data files, where any bad line is an error naming the file and line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"
# A training run's curve, one JSON object a line: written by model.training.callbacks, read by datadir.
METRICS_FILE = "metrics.jsonl"


def fsync_path(path: str | Path) -> None:
    """fsync one file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file below root, then every directory (children before parents)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fsync_path(path)


@contextlib.contextmanager
def atomic_dir(dst: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside `dst`; on success fsync it and rename it to `dst` (replacing it)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f"{TMP_PREFIX}{dst.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if dst.exists() and _exchange(tmp, dst):
            old = tmp  # the exchange left the old directory under the temp name
        elif dst.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first. Readers
            # may see no `dst` for a moment; only where renameat2 is missing.
            old = dst.parent / f"{TMP_PREFIX}old-{dst.name}-{uuid.uuid4().hex[:8]}"
            os.rename(dst, old)
            os.rename(tmp, dst)
        else:
            old = None
            os.rename(tmp, dst)
        fsync_dir(dst.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE): `b` never disappears.

    False where the call is unavailable (not Linux, old kernel or libc, a filesystem without it).
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def tree_bytes(root: str | Path) -> int:
    """Bytes of the files below `root` (a hard-linked file counted once); 0 when it is gone."""
    seen, total = set(), 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def remove_tree(path: str | Path) -> int:
    """Remove a directory as readers see it: renamed to a hidden temp name first (one step, so no
    reader ever finds half of it), then deleted; the bytes it held. FileNotFoundError if absent."""
    path = Path(path)
    doomed = path.parent / f"{TMP_PREFIX}deleted-{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, doomed)
    fsync_dir(path.parent)
    freed = tree_bytes(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return freed


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a single file atomically: temp file, fsync, rename."""
    path = Path(path)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, skipping a torn line a killed writer left; [] if absent."""
    return _parse_jsonl(_read_text(path))


def rewrite_jsonl(path: str | Path, keep: Callable[[dict], bool] = lambda record: True) -> list[dict]:
    """Rewrite a JSON-lines file atomically with only its whole records that `keep` accepts; returns them.

    Rewrites nothing when the file is absent, or already holds exactly those records (no torn line).
    """
    text = _read_text(path)
    if text is None:
        return []
    records = _parse_jsonl(text)
    kept = [r for r in records if keep(r)]
    lines = sum(1 for line in text.splitlines() if line.strip())
    if len(kept) != lines or (text and not text.endswith("\n")):
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return kept


def _read_text(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _parse_jsonl(text: str | None) -> list[dict]:
    records = []
    for line in (text or "").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def iter_jsonl_objects(lines: Iterable[str], path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a user's JSON-lines file; a line that is not
    a JSON object is a ValueError naming `path` and the line."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:  # json's decoder recurses once per nested array or object
            raise ValueError(f"{path}, line {lineno}: not valid JSON for this reader (nested too deeply)") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record
