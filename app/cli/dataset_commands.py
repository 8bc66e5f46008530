"""`bert datasets upload | import | list | show | delete`: the datasets of DATA_DIR, on the machine that holds it,
as `bert import` adds models there. An upload goes through the checks of POST /datasets (app/jobs/uploads.py:
the same kinds, bounds and meta.json, the check in a child process), an import of a Hugging Face Hub dataset's
split through those of POST /datasets with a repo id (app/jobs/dataset_imports.py), at once rather than as a job;
a deletion through the catalog's (refused while a queued or running job uses the dataset, under the data
directory's submission lock).
The datasets they add are an admin's, shared with every key, as `bert import`'s models are; each upload
and deletion is a line in the audit log."""

from __future__ import annotations

import argparse
import getpass
import json
from pathlib import Path
from typing import Any

from datadir.datasets import DATASET_KINDS
from model.data.hub_rows import importable_kinds
from model.errors import UserError


def _data_dir(args: argparse.Namespace) -> Path:
    from app.settings import Settings

    return Path(args.data_dir) if args.data_dir else Settings().data_dir


def _audit(data_dir: Path, action: str, name: str) -> None:
    from datadir import audit

    audit.append(data_dir, "cli", action, f"dataset {name}", user=getpass.getuser(), source="cli")


def cmd_datasets_upload(args: argparse.Namespace) -> int:
    from app.errors import ServiceError
    from app.jobs.uploads import add_local_dataset, upload_suffix
    from app.settings import Settings

    src = Path(args.file)
    if not src.is_file():
        raise UserError(f"no such file: {src}")
    data_dir = _data_dir(args)
    name = args.name or src.name[: -len(upload_suffix(src.name))] or src.name
    try:
        meta = add_local_dataset(data_dir, src, name, args.kind, Settings(data_dir=data_dir))
    except ServiceError as e:
        raise UserError(e.message) from None
    _audit(data_dir, "dataset.upload", name)
    print(f"added dataset '{name}' ({meta['kind']}, {meta['format']}): {summary(meta)}")
    return 0


def cmd_datasets_import(args: argparse.Namespace) -> int:
    from app.errors import ServiceError
    from app.jobs.dataset_imports import DatasetImport, import_dataset, parse_columns
    from app.settings import Settings

    data_dir = _data_dir(args)
    try:
        columns = parse_columns(args.columns) if args.columns else None
    except ValueError as e:
        raise UserError(str(e)) from None
    request = DatasetImport(args.name, args.repo, args.revision, args.subset, args.split, columns, args.kind)
    try:
        meta = import_dataset(data_dir, Settings(data_dir=data_dir), request)
    except ServiceError as e:
        raise UserError(e.message) from None
    _audit(data_dir, "dataset.import", f"{args.name} from {args.repo}")
    source = meta["source"]
    print(
        f"imported {args.repo} (subset {source['subset']}, split {source['split']}) as dataset '{args.name}' "
        f"({meta['kind']}, {meta['format']}): {summary(meta)}"
    )
    return 0


def cmd_datasets_list(args: argparse.Namespace) -> int:
    from datadir.datasets import dataset_bytes, list_datasets

    data_dir = _data_dir(args)
    metas = [{**m, "disk_bytes": dataset_bytes(data_dir, m["name"])} for m in list_datasets(data_dir)]
    if args.json:
        print(json.dumps(metas, indent=2))
        return 0
    if not metas:
        print(f"no datasets in {data_dir}")
        return 0
    rows = [(m["name"], f"{m['kind']} ({m.get('format', '?')})", summary(m), _size(m["disk_bytes"])) for m in metas]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + f"  {row[3]}")
    return 0


def cmd_datasets_show(args: argparse.Namespace) -> int:
    from datadir.datasets import dataset_bytes, read_meta

    data_dir = _data_dir(args)
    meta = read_meta(data_dir, args.name)
    if meta is None:
        raise UserError(f"dataset '{args.name}' not found in {data_dir}")
    print(json.dumps({**meta, "disk_bytes": dataset_bytes(data_dir, args.name)}, indent=2))
    return 0


def cmd_datasets_delete(args: argparse.Namespace) -> int:
    import asyncio

    from app.errors import ServiceError
    from app.jobs.catalog import Catalog
    from app.settings import Settings
    from datadir import JobRecords

    data_dir = _data_dir(args)
    catalog = Catalog(Settings(data_dir=data_dir), data_dir, JobRecords(data_dir), asyncio.Lock())
    try:
        freed = asyncio.run(catalog.delete_dataset(args.name))
    except ServiceError as e:
        raise UserError(e.message) from None
    _audit(data_dir, "dataset.delete", args.name)
    print(f"deleted dataset '{args.name}' ({_size(freed)} freed)")
    return 0


def summary(meta: dict[str, Any]) -> str:
    """What a dataset holds, in a few words (its counts in meta.json)."""
    m, kind = meta, meta["kind"]
    try:
        if kind == "corpus":
            return f"{m['documents']:,} documents, {m['sentences']:,} sentences"
        if kind == "labelled":
            return f"{m['rows']:,} rows, {m['num_labels']} labels{' (text pairs)' if m['is_pair'] else ''}"
        if kind == "token-labelled":
            return f"{m['sentences']:,} sentences, {m['tokens']:,} tokens, {m['num_labels']} tags"
        if kind == "qa":
            return f"{m['questions']:,} questions ({m['impossible']:,} impossible), {m['contexts']:,} contexts"
        if kind == "pairs":
            return f"{m['rows']:,} rows, {_plural(m['negatives'], 'hard negative')} each"
        if kind == "scored-pairs":
            return f"{m['rows']:,} rows, mean score {m['mean_score']:.3f}"
        splits = f" of {', '.join(m['splits'])}" if len(m["splits"]) > 1 else ""
        return (
            f"{m['queries']:,} queries, {m['documents']:,} documents, {m['judgements']:,} judgements "
            f"(split {m['split']}{splits})"
        )
    except (KeyError, TypeError):  # a dataset from before one of its counts existed
        return "-"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(n: int) -> str:
    from model.sizing import format_bytes

    return format_bytes(n)


def add_commands(sub) -> None:
    """Register `datasets` (upload, list, show, delete) on the `bert` command's subparsers."""
    datasets = sub.add_parser("datasets", help="upload, import, list, show and delete the datasets of DATA_DIR")
    datasets_sub = datasets.add_subparsers(dest="datasets_command", required=True, metavar="SUBCOMMAND")

    def parser(name: str, help: str, func) -> argparse.ArgumentParser:
        p = datasets_sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
        p.add_argument("--data-dir", help="the data directory (default: BERT_DATA_DIR, else ./data)")
        p.set_defaults(func=func)
        return p

    p = parser("upload", "check a file as POST /datasets does and add it to DATA_DIR/datasets", cmd_datasets_upload)
    p.add_argument("file", metavar="FILE", help="the data file (a .zip or .tar.gz of a BEIR folder for retrieval)")
    p.add_argument("--name", help="the dataset's name (default: the file name without its suffix)")
    p.add_argument(
        "--kind",
        choices=DATASET_KINDS,
        help="what the file holds (default: from its suffix and columns, as an upload's)",
    )
    p = parser(
        "import",
        "import a split of a Hugging Face Hub dataset into DATA_DIR/datasets, checked as an upload of its rows",
        cmd_datasets_import,
    )
    p.add_argument("repo", metavar="REPO", help="a Hub dataset repo id, e.g. stanfordnlp/imdb")
    p.add_argument("--name", required=True, help="the dataset's name")
    p.add_argument("--subset", help="the subset (the card's config_name; default: its default, or the only one)")
    p.add_argument(
        "--split", help="the split, optionally a slice of its rows: train, train[:10000] (default: the only one)"
    )
    p.add_argument("--revision", help="a branch, tag or commit (default: main)")
    p.add_argument(
        "--columns",
        metavar="SOURCE=COLUMN,...",
        help="rename the split's columns to a kind's: query=anchor,answer=positive (default: none renamed)",
    )
    p.add_argument(
        "--kind",
        choices=importable_kinds(),
        help="what the split holds (default: what its columns name, as an upload's header does)",
    )
    p = parser("list", "list the datasets: name, kind and format, counts, size on disk", cmd_datasets_list)
    p.add_argument("--json", action="store_true", help="print each dataset's meta.json (and disk_bytes) as JSON")
    p = parser("show", "print a dataset's meta.json (and disk_bytes)", cmd_datasets_show)
    p.add_argument("name", metavar="NAME", help="the dataset's name")
    p = parser("delete", "delete a dataset (refused while a queued or running job uses it)", cmd_datasets_delete)
    p.add_argument("name", metavar="NAME", help="the dataset's name")
