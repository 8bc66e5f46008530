"""The audit log, DATA_DIR/audit.jsonl: one JSON line per change of who submitted, cancelled,
uploaded, imported, published, shared, promoted or deleted what, and per key added, revoked or rotated.
The API writes what its requests change, the workers and the API's imports each version they publish
(`model.publish`, source "worker" or "api"), `bert keys` its key changes (source "cli").

    {"time": "2026-12-04T15:00:00Z", "key": "alice", "action": "job.submit", "target": "job 20261204-...",
     "outcome": "ok", "request_id": "3f2a...", "source": "api"}

Append-only: the file is opened with O_APPEND and each line is one write(2), so lines from the
service's workers and from `bert keys` never interleave. Each record is one line for every reader:
JSON escapes the controls, and U+0085, U+2028 and U+2029 (which it leaves raw, and some readers break
lines at) are written as JSON escapes too. `outcome` is "ok" or the error type the request was refused
with (not_found, conflict, ...). Secrets never enter it: keys go by name.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

AUDIT_FILE = "audit.jsonl"
# Line breaks to str.splitlines and some JSON-lines readers that json.dumps(ensure_ascii=False) leaves raw.
_LINE_BREAKS = {c: f"\\u{c:04x}" for c in (0x85, 0x2028, 0x2029)}


def audit_path(data_dir: Path) -> Path:
    return Path(data_dir) / AUDIT_FILE


def json_line(entry: dict) -> str:
    """`entry` as one line of JSON for every reader (the service's JSON log lines are written so too)."""
    return json.dumps(entry, ensure_ascii=False, separators=(", ", ": ")).translate(_LINE_BREAKS)


def append(data_dir: Path, key: str, action: str, target: str, outcome: str = "ok", **extra: str | None) -> None:
    """Add one line (blocking: call in a thread from async code)."""
    entry = {
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "key": key,
        "action": action,
        "target": target,
        "outcome": outcome,
        **extra,
    }
    line = (json_line(entry) + "\n").encode()
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(audit_path(data_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
