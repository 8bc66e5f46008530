"""DATA_DIR/defaults.json: which model serves a role when a request names none, chosen at first start
(`bert init`, `bert up`) and read by every API process, so all of them agree.

    {"mlm": "bert-base-uncased"}    the model of /fill-mask and /nsp

A setting (BERT_DEFAULT_MLM_MODEL) still wins over the file; an absent or unreadable file reads as {}.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from datadir.files import atomic_write_bytes

DEFAULTS = "defaults.json"
ROLES = ("mlm",)


def read_defaults(data_dir: str | os.PathLike) -> dict[str, str]:
    try:
        data = json.loads((Path(data_dir) / DEFAULTS).read_bytes())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k in ROLES and isinstance(v, str)} if isinstance(data, dict) else {}


def set_default(data_dir: str | os.PathLike, role: str, name: str) -> None:
    """Record `name` as the model for `role` (the file is rewritten whole: temp, fsync, rename)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    defaults = {**read_defaults(data_dir), role: name}
    atomic_write_bytes(Path(data_dir) / DEFAULTS, json.dumps(defaults, indent=2, sort_keys=True).encode() + b"\n")
