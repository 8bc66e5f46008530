"""What a key may do with the models and datasets of other keys, in one place (docs/keys.md, "Ownership").

    use or read a model   an admin key; the model's owner; a model an admin shares; one in the key's
                          `models` list (a key with such a list uses only those for inference)
    publish to a name     an admin key; a new name; a model the key owns (datadir/publish.py holds the
                          same rule again when the job publishes)
    use a dataset         an admin key; its uploader; one an admin uploaded (`shared`, as those from
                          before owners are); one in the key's `models` list
    change a dataset      an admin key; its uploader

What was made before models had owners, and what the `bert` command imports, is admin's and shared.
A refusal is a 403 that says the rule, never who owns the thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.errors import ServiceError
from app.keys.keyfile import Key
from datadir.datasets import dataset_owner
from datadir.jobs import SHARED_OWNERS
from datadir.publish import OWNER_RULE
from datadir.versions import Access

MODEL_RULE = "a key uses its own models, those an admin shares, and those its key's models list names"
DATASET_RULE = "a key trains on its own datasets, those an admin uploaded, and those its key's models list names"


def listed(key: Key, name: str) -> bool:
    return key.models is not None and name in key.models


def may_read_model(key: Key, name: str, access: Access) -> bool:
    return key.is_admin or listed(key, name) or access.owner == key.name or access.shared


def may_publish(key: Key, access: Access | None) -> bool:
    """Whether `key` may publish the next version of a model whose access is `access` (None: a new name)."""
    return access is None or key.is_admin or access.owner == key.name


def dataset_shared(meta: Mapping[str, Any]) -> bool:
    """Whether every key may train on it: an admin uploaded it (meta.json says so, or its owner is from before)."""
    shared = meta.get("shared")
    return shared if isinstance(shared, bool) else dataset_owner(meta) in SHARED_OWNERS


def may_read_dataset(key: Key, meta: Mapping[str, Any]) -> bool:
    return key.is_admin or listed(key, meta["name"]) or dataset_owner(meta) == key.name or dataset_shared(meta)


def may_change_dataset(key: Key, meta: Mapping[str, Any]) -> bool:
    return key.is_admin or dataset_owner(meta) == key.name


def check_model(key: Key, name: str, access: Access, field: str | None = None) -> None:
    """403 naming the rule when `key` may not use model `name` (for inference, or as a job's `field`)."""
    if key.models is not None and field is None and name not in key.models:  # inference: its list alone
        raise ServiceError(
            "forbidden", f"key '{key.name}' may not use model '{name}' (its models: {', '.join(key.models)})"
        )
    if not may_read_model(key, name, access):
        where = f"{field}: " if field else ""
        raise ServiceError("forbidden", f"{where}model '{name}' is not this key's to use: {MODEL_RULE}")


def check_publish(key: Key, name: str, access: Access | None) -> None:
    if not may_publish(key, access):
        raise ServiceError("forbidden", f"model_name: model '{name}' belongs to another key: {OWNER_RULE}")


def check_dataset(key: Key, meta: Mapping[str, Any], field: str = "dataset") -> None:
    if not may_read_dataset(key, meta):
        raise ServiceError("forbidden", f"{field}: '{meta['name']}' is not this key's to use: {DATASET_RULE}")
