"""Where an imported dataset comes from: one split of a Hugging Face Hub dataset repo.

`fetch_split` lists the repo at a revision (its files and their sizes: one request), reads its card (README.md's
YAML: the subsets and splits, ClassLabel names and license, model/data/hub_layout.py), picks the subset and split
asked for (a UserError listing them when it cannot), bounds the split's files by the sizes the Hub lists before
any of them downloads (`max_bytes`, then the caller's `check_room`: a disk quota), and downloads them through
huggingface_hub's cache (HF_ENDPOINT, HF_TOKEN; with HF_HUB_OFFLINE the cache alone, as an earlier import left
it), their bytes reported to `progress`. A revision holding no data files (a loading script's repo, such as
eriktks/conll2003) is read from the Hub's Parquet export, refs/convert/parquet, when no revision was named; its
card is still the main branch's. model/data/hub_rows.py then writes the split's rows as an upload's file.

Reference: https://huggingface.co/docs/huggingface_hub/guides/download; the dataset viewer's "Parquet export".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.data.hub_layout import (
    PARQUET_EXPORT,
    ClassLabel,
    Layout,
    SplitRequest,
    card_labels,
    choose,
    parse_split,
    read_layout,
)
from model.data.hub_rows import SourceFile
from model.errors import UserError
from model.sources import (
    REVISION_RULE,
    Progress,
    card_license,
    hub_error,
    hub_instead,
    is_hub_id,
    progress_class,
    valid_revision,
)

CARD = "README.md"
MAX_CARD_BYTES = 1 << 20  # a dataset card; the largest real ones are tens of KB


@dataclass
class FetchedSplit:
    """A split's files on this machine (the cache's), its ClassLabel names, and the dataset card's `source`."""

    files: list[SourceFile]
    labels: dict[str, ClassLabel]
    request: SplitRequest  # the split as asked, its slice of rows
    source: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Listing:
    revision: str | None  # as asked (None: main)
    sha: str
    sizes: dict[str, int]  # repo path -> bytes
    snapshot: Path | None = None  # offline: the cached snapshot folder


def fetch_split(
    repo: str,
    *,
    subset: str | None = None,
    split: str | None = None,
    revision: str | None = None,
    max_bytes: int,
    limit: str = "the most an import may download",
    check_room: Callable[[int], None] | None = None,
    progress: Progress | None = None,
) -> FetchedSplit:
    """Download split `split` (a name, or one with a slice: train[:1000]) of subset `subset` of dataset repo `repo`
    at `revision` (default: main), refusing it before any of its files downloads when they take more than
    `max_bytes` (`limit` names it in the refusal) or `check_room(bytes)` raises."""
    from huggingface_hub import constants

    if not is_hub_id(repo):
        raise UserError(f"{repo!r} is not a Hugging Face Hub repo id (owner/name)")
    if revision is not None and not valid_revision(revision):
        raise UserError(f"revision {revision!r} {REVISION_RULE}")
    request = parse_split(split) if split is not None else None
    offline = constants.is_offline_mode()
    try:
        listing = _listing(repo, revision, offline)
        card = _card(repo, listing, offline)
        layout = read_layout(list(listing.sizes), card, parquet_export=revision == PARQUET_EXPORT)
        if revision is None and not layout.subsets:
            listing, layout = _parquet_export(repo, listing, card, offline)
        name, split_name, paths = _choose(layout, repo, subset, request, offline)
        if not paths:
            raise UserError(_missing(repo, name, split_name, offline))
        total = sum(listing.sizes[p] for p in paths)
        if total > max_bytes:
            raise UserError(
                f"{repo} (subset {name}, split {split_name}) is {total:,} bytes in {len(paths)} file(s), more than "
                f"the {max_bytes:,} {limit}"
            )
        if check_room is not None:
            check_room(total)
        files, sha = _download(repo, listing, paths, progress, offline)
    except Exception as e:
        raise hub_error(e, repo, revision, "dataset") from None
    request = request or SplitRequest(split_name)
    source = {
        "kind": "hub",
        "repo": repo,
        "revision": listing.revision or "main",
        "sha": sha,
        "subset": name,
        "split": str(request),
        "license": card_license(card),
        "files": list(paths),
    }
    return FetchedSplit(files, card_labels(card, name), request, source)


def _listing(repo: str, revision: str | None, offline: bool) -> _Listing:
    """The revision's files and sizes: the Hub's list (one request), or offline the cached snapshot's."""
    if offline:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True))
        sizes = {str(p.relative_to(snapshot)): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}
        return _Listing(revision, snapshot.name, sizes, snapshot)
    from huggingface_hub import HfApi

    info = HfApi().dataset_info(repo, revision=revision, files_metadata=True)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    return _Listing(revision, info.sha or "", sizes)


def _card(repo: str, listing: _Listing, offline: bool) -> dict[str, Any] | None:
    """README.md's YAML (None without a card), its size bounded before it downloads."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.repocard import metadata_load

    if CARD not in listing.sizes:
        return None
    if listing.sizes[CARD] > MAX_CARD_BYTES:
        raise UserError(
            f"{repo}: {CARD} is {listing.sizes[CARD]:,} bytes, more than the {MAX_CARD_BYTES:,} a card may be"
        )
    if listing.snapshot is not None:
        path = listing.snapshot / CARD
    else:
        path = Path(hf_hub_download(repo, CARD, repo_type="dataset", revision=listing.revision))
    try:
        return metadata_load(path)
    except Exception as e:  # yaml's errors (YAMLError), a card whose YAML is not a mapping (ValueError)
        if not isinstance(e, ValueError | UnicodeDecodeError) and not type(e).__module__.startswith("yaml"):
            raise
        raise UserError(f"{repo}: the YAML of its {CARD} cannot be read: {str(e).splitlines()[0]}") from None


def _parquet_export(repo: str, main: _Listing, card: dict[str, Any] | None, offline: bool):
    """The listing and layout of refs/convert/parquet, for a main branch without data files (a loading script)."""
    from huggingface_hub import errors

    script = next((p for p in main.sizes if p.endswith(".py") and "/" not in p), None)
    try:
        listing = _listing(repo, PARQUET_EXPORT, offline)
    except (errors.RevisionNotFoundError, errors.LocalEntryNotFoundError):
        has = f": it has a loading script ({script}), which this import does not run," if script else ","
        raise UserError(
            f"{repo} holds no data files this import reads (Parquet, JSON Lines, CSV or TSV){has} and no Parquet "
            f"export ({PARQUET_EXPORT})"
        ) from None
    return listing, read_layout(list(listing.sizes), card, parquet_export=True)


def _choose(layout: Layout, repo: str, subset: str | None, request: SplitRequest | None, offline: bool):
    try:
        return choose(layout, repo, subset, request.name if request else None)
    except UserError as e:
        if not offline:
            raise
        raise UserError(
            f"HF_HUB_OFFLINE is set and the Hugging Face cache (HF_HOME) holds only what earlier imports "
            f"downloaded: {e}; {hub_instead('dataset', offline=True)}"
        ) from None


def _missing(repo: str, subset: str, split: str, offline: bool) -> str:
    if offline:
        return (
            f"HF_HUB_OFFLINE is set and split {split} of {repo} (subset {subset}) is not in the Hugging Face cache "
            f"(HF_HOME); {hub_instead('dataset', offline=True)}"
        )
    return f"{repo}: the card's data_files for split {split} of subset {subset} match no file of the repo"


def _download(
    repo: str, listing: _Listing, paths: tuple[str, ...], progress: Progress | None, offline: bool
) -> tuple[list[SourceFile], str]:
    """The split's files on this machine and the commit they are of (the snapshot folder's name)."""
    if listing.snapshot is not None:
        return [SourceFile(listing.snapshot / p, p) for p in paths], listing.sha
    from huggingface_hub import hf_hub_download

    bar = progress_class(sum(listing.sizes[p] for p in paths), progress)
    files = []
    for path in paths:
        local = Path(hf_hub_download(repo, path, repo_type="dataset", revision=listing.revision, tqdm_class=bar))
        files.append(SourceFile(local, path))
    snapshot = files[0].path.parents[len(Path(paths[0]).parts) - 1]
    return files, snapshot.name
