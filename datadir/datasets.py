"""Datasets: DATA_DIR/datasets/<name>/, written once by the app (upload, `bert up`), read by workers.

    DATA_DIR/datasets/<name>/data.<ext>                 the file as uploaded (txt jsonl csv tsv conll json ...)
    DATA_DIR/datasets/<name>/data/                      or a retrieval archive's BEIR files, unpacked
    DATA_DIR/datasets/<name>/meta.json                  what is known of it (below)
    DATA_DIR/datasets/<name>/cache/                     token caches workers build (model.data)

meta.json: name, kind (one of DATASET_KINDS), format (a corpus format of model.data; csv/tsv/jsonl;
conll/jsonl; squad; beir/jsonl for retrieval), file (the data file's name in the directory: for a
retrieval archive, the folder `data` it was unpacked into), original_filename, bytes and sha256 (of the
file as uploaded), created_at, and counts: documents and sentences (corpus); rows, num_labels, labels,
label_counts and is_pair (labelled); sentences, tokens, num_labels, labels (the tags), entity_counts
(token-labelled); questions, impossible, contexts (qa); rows, negatives (hard negatives a row), ids,
distinct_anchors and mean_chars (pairs); rows, mean_score and mean_chars (scored-pairs); queries,
documents, judgements, split and splits (retrieval). `labels` and the counts hold at most LISTED_LABELS
entries (the most frequent), so a listing of datasets stays small; `num_labels` counts every label (a
dataset written before it existed lists them all: `labels`).

A dataset is installed by renaming a complete temp directory into place, so it is there whole or
not at all, and a name is never replaced: a dataset a job was trained on stays what it was. Deleting
one (`delete_dataset`; the app refuses while a queued or running job uses it) renames it to a hidden
temp name before removing it, so a reader never finds half of it; the name may then be used again.
"""

from __future__ import annotations

import errno
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from datadir.files import TMP_PREFIX, fsync_dir, fsync_tree, remove_tree, tree_bytes
from datadir.jobs import LEGACY_OWNER
from datadir.layout import DataDir, valid_name

META = "meta.json"
DATASET_KINDS = ("corpus", "labelled", "token-labelled", "qa", "pairs", "scored-pairs", "retrieval")
LISTED_LABELS = 100
# The kinds of dataset each fine-tuning task (model.options.TASKS) trains on, the first the usual one. A
# `retrieval` dataset (queries, a corpus, relevance judgements) is for evaluation only: no task trains on it.
KINDS_OF_TASK: dict[str, tuple[str, ...]] = {
    "sequence-classification": ("labelled",),
    "token-classification": ("token-labelled",),
    "question-answering": ("qa",),
    "sentence-embedding": ("pairs", "scored-pairs"),
    "cross-encoder": ("pairs", "scored-pairs", "labelled"),
    "late-interaction": ("pairs",),
    "sparse-embedding": ("pairs",),
}
LABELLED_KINDS = ("labelled", "token-labelled")  # the kinds whose meta.json counts labels (tags)
# A job's eval_dataset is of its training dataset's kind, or a retrieval set for the tasks (and training kinds)
# named here, whose evaluation is retrieval: their held-out anchors search their held-out documents.
RETRIEVAL_EVAL: dict[str, tuple[str, ...]] = {
    "sentence-embedding": ("pairs",),
    "late-interaction": ("pairs",),
    "sparse-embedding": ("pairs",),
}


def eval_kinds(task: str, kind: str) -> tuple[str, ...]:
    """The kinds of eval_dataset a fine-tuning job of `task` on a dataset of `kind` evaluates on."""
    return (kind, "retrieval") if kind in RETRIEVAL_EVAL.get(task, ()) else (kind,)


class DatasetExists(FileExistsError):
    pass


def read_meta(data_dir: str | os.PathLike, name: str) -> dict[str, Any] | None:
    """A dataset's meta.json, or None when there is no such (readable) dataset."""
    if not valid_name(name):
        return None
    try:
        return json.loads((DataDir(data_dir).dataset(name) / META).read_text())
    except (OSError, ValueError):
        return None


def dataset_owner(meta: Mapping[str, Any]) -> str:
    """The key that uploaded the dataset (admin for one from before keys had names)."""
    owner = meta.get("owner")
    return owner if isinstance(owner, str) and owner else LEGACY_OWNER


def num_labels(meta: dict[str, Any]) -> int:
    """The distinct labels (tags) of a labelled or token-labelled dataset."""
    return meta["num_labels"] if meta.get("num_labels") is not None else len(meta.get("labels") or ())


def list_datasets(data_dir: str | os.PathLike) -> list[dict[str, Any]]:
    root = DataDir(data_dir).datasets
    if not root.is_dir():
        return []
    metas = (read_meta(data_dir, child.name) for child in sorted(root.iterdir()))
    return [m for m in metas if m is not None]


def delete_dataset(data_dir: str | os.PathLike, name: str) -> int:
    """Remove a dataset (its file, meta.json and token caches); the bytes freed. FileNotFoundError."""
    if read_meta(data_dir, name) is None:
        raise FileNotFoundError(f"dataset '{name}' not found in {DataDir(data_dir).datasets}")
    return remove_tree(DataDir(data_dir).dataset(name))


def dataset_bytes(data_dir: str | os.PathLike, name: str) -> int:
    """Bytes a dataset holds on disk (its file, meta.json and token caches)."""
    return tree_bytes(DataDir(data_dir).dataset(name))


def dataset_file(data_dir: str | os.PathLike, name: str) -> tuple[Path, dict[str, Any]]:
    """The data file of a dataset and its meta.json; FileNotFoundError when there is no such dataset."""
    meta = read_meta(data_dir, name)
    if meta is None:
        raise FileNotFoundError(f"dataset '{name}' not found in {DataDir(data_dir).datasets}")
    return DataDir(data_dir).dataset(name) / meta["file"], meta


def staging_dir(data_dir: str | os.PathLike, label: str) -> Path:
    """A new hidden temp directory beside the datasets, to build one in before `install`."""
    root = DataDir(data_dir).datasets
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{label}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def install(data_dir: str | os.PathLike, staging: Path, meta: dict[str, Any]) -> Path:
    """Write meta.json into `staging` (which holds meta["file"]) and rename it to datasets/<name>.

    DatasetExists when the name is taken (never replaced); `staging` is left for the caller to remove.
    """
    target = DataDir(data_dir).dataset(meta["name"])
    (staging / META).write_text(json.dumps(meta, indent=1))
    fsync_tree(staging)
    try:
        os.rename(staging, target)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
            raise DatasetExists(f"dataset '{meta['name']}' already exists") from None
        raise
    fsync_dir(target.parent)
    return target
