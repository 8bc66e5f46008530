"""A Hugging Face Hub dataset repo's subsets and splits, and the names of its integer labels, read from its card
(README.md's YAML) and its list of files as the `datasets` library reads them:

    configs         the card's `configs`: each subset (`config_name`) with its `data_files` (a pattern, a list
                    of them, or {split, path} entries whose path is a pattern or a list), optionally inside
                    `data_dir`; `default: true` marks the subset taken when none is named (else the one
                    called `default`, else the only one)
    parquet export  refs/convert/parquet, the Hub's Parquet copy of a dataset (a loading script's too):
                    {subset}/{split}/NNNN.parquet ({subset}/partial-{split}/ for a large split's first rows)
    folders         without `configs`: the top-level folders are the subsets when there are several holding
                    data and none is named as a split (or `data`); else there is one subset, `default`. A
                    file's split is the name push_to_hub gives it ({split}-NNNNN-of-NNNNN.parquet), else a
                    split word in its path (train, training; validation, valid, val, dev; test, testing, eval,
                    evaluation; between non-letters), else, when no file names one, train
    features        the card's `dataset_info` (one, or one per subset) types each column; a `class_label` (or a
                    `sequence`/`list` of them) names a column's integer labels. A Parquet file written by
                    `datasets` carries the same in its schema's metadata (key `huggingface`).

Only data files are listed: Parquet, JSON Lines (.jsonl, .ndjson) and CSV/TSV, the text ones optionally
.gz or .bz2. Patterns are fsspec's globs: `*` within a folder, `**` across folders.

References: huggingface/datasets, docs "Structure your repository" and "Manual configuration" (configs,
data_files, the split keywords), datasets.features.ClassLabel; the dataset viewer's "Parquet export".
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from model.errors import UserError

PARQUET_EXPORT = "refs/convert/parquet"
TEXT_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv")
COMPRESSIONS = ("", ".gz", ".bz2")
DATA_SUFFIXES = (".parquet", *(s + c for s in TEXT_SUFFIXES for c in COMPRESSIONS))
DEFAULT_SUBSET = "default"
# The `datasets` library's words for its three usual splits, each split's canonical name first.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEPARATOR = r"[-._ 0-9/]"  # what may stand on either side of a split word in a path (as `datasets` has it)
_PUSHED = re.compile(r"^(\w+?)-\d{5}-of-\d{5}(?:-[0-9a-f]+)?\.parquet$")  # push_to_hub: train-00000-of-00001.parquet
_SPLIT_ARG = re.compile(r"^([\w.-]+?)(?:\[(\d*):(\d*)\])?$")  # "train", "train[:1000]", "train[1000:2000]"


@dataclass(frozen=True)
class Layout:
    """The subsets of a repo at one revision, each split's data files (repo paths, sorted), the default subset."""

    subsets: dict[str, dict[str, tuple[str, ...]]]
    default: str | None
    declared: str  # where the subsets come from: "card", "parquet export" or "folders"

    def describe(self) -> str:
        """Each subset with its splits, for an error: "pair (train, dev, test), triplet (train, dev, test)"."""
        return ", ".join(f"{name} ({', '.join(splits) or 'no splits'})" for name, splits in self.subsets.items())


@dataclass(frozen=True)
class SplitRequest:
    """A split as asked for: its name and the rows taken, `datasets`' slice syntax (train[:1000])."""

    name: str
    start: int = 0
    stop: int | None = None

    def __str__(self) -> str:
        if self.start == 0 and self.stop is None:
            return self.name
        return f"{self.name}[{self.start or ''}:{'' if self.stop is None else self.stop}]"


def parse_split(text: str) -> SplitRequest:
    """ "train", "train[:1000]" or "train[500:1500]" (rows by index, as `datasets` slices a split)."""
    m = _SPLIT_ARG.match(text)
    if m is None:
        raise UserError(
            f"split {text[:80]!r} is not a split name, or one with a slice of rows such as train[:1000] or "
            "train[1000:2000]"
        )
    start, stop = int(m[2] or 0), int(m[3]) if m[3] else None
    if stop is not None and stop <= start:
        raise UserError(f"split {text!r} takes no rows: its slice ends at {stop}, not after its start {start}")
    return SplitRequest(m[1], start, stop)


def is_data_file(path: str) -> bool:
    return path.lower().endswith(DATA_SUFFIXES)


# -- subsets and splits ----------------------------------------------------------------------------


def read_layout(files: list[str], card: dict[str, Any] | None, parquet_export: bool = False) -> Layout:
    """The subsets and splits of a revision whose files are `files` (repo paths) and whose card's YAML is `card`
    (None without one); `parquet_export`: the revision is refs/convert/parquet."""
    data = sorted(f for f in files if is_data_file(f))
    configs = (card or {}).get("configs")
    if configs is not None and not parquet_export:
        return _declared(configs, data)
    if parquet_export:
        return _parquet_export(data)
    return _by_folders(data)


def _declared(configs: Any, files: list[str]) -> Layout:
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise UserError("the card's configs is not a list of subsets (each a mapping with config_name, data_files)")
    subsets: dict[str, dict[str, tuple[str, ...]]] = {}
    default = None
    for config in configs:
        name = str(config.get("config_name", DEFAULT_SUBSET))
        data_dir = str(config.get("data_dir") or "").strip("/")
        inside = [f for f in files if f.startswith(data_dir + "/")] if data_dir else files
        declared = config.get("data_files")
        if declared is None:
            subsets[name] = _inferred_splits(inside, data_dir)
        else:
            subsets[name] = {
                split: _matching(patterns, inside, data_dir) for split, patterns in _split_patterns(name, declared)
            }
        if config.get("default") is True:
            default = name
    return Layout(subsets, default or _implied_default(subsets), "card")


def _split_patterns(subset: str, declared: Any) -> list[tuple[str, list[str]]]:
    """A config's data_files as (split, [pattern]): a pattern or a list of them is train's; {split, path} entries
    (or a mapping of split to patterns) name theirs."""
    if isinstance(declared, str):
        return [("train", [declared])]
    if isinstance(declared, dict):
        declared = [{"split": k, "path": v} for k, v in declared.items()]
    if isinstance(declared, list) and all(isinstance(p, str) for p in declared):
        return [("train", list(declared))]
    splits = []
    for entry in declared if isinstance(declared, list) else [None]:
        path = entry.get("path") if isinstance(entry, dict) else None
        paths = [path] if isinstance(path, str) else path
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise UserError(
                f"the card's data_files of subset {subset!r} are neither patterns nor {{split, path}} entries"
            )
        splits.append((str(entry.get("split", "train")), paths))  # type: ignore[union-attr]
    return splits


def _matching(patterns: list[str], files: list[str], data_dir: str) -> tuple[str, ...]:
    """The data files any of `patterns` (relative to `data_dir`) matches: a glob, or a folder's files."""
    hits: set[str] = set()
    for pattern in patterns:
        pattern = posixpath.normpath(posixpath.join(data_dir, pattern.strip()))
        regex = _glob(pattern)
        found = [f for f in files if regex.fullmatch(f)]
        if not found and not re.search(r"[*?\[]", pattern):  # a folder names the files below it
            found = [f for f in files if f.startswith(pattern + "/")]
        hits.update(found)
    return tuple(sorted(hits))


def _glob(pattern: str) -> re.Pattern[str]:
    """fsspec's glob as a regex: `**` any folders, `*` and `?` within one, [...] a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (end := pattern.find("]", i + 1)) > i:
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out))


def _parquet_export(files: list[str]) -> Layout:
    """refs/convert/parquet: {subset}/{split}/NNNN.parquet, or {subset}/partial-{split}/NNNN.parquet."""
    subsets: dict[str, dict[str, list[str]]] = {}
    for path in files:
        parts = path.split("/")
        if len(parts) != 3 or not parts[2].endswith(".parquet"):
            continue
        split = parts[1].removeprefix("partial-")
        subsets.setdefault(parts[0], {}).setdefault(split, []).append(path)
    found = {name: {s: tuple(sorted(p)) for s, p in splits.items()} for name, splits in subsets.items()}
    return Layout(found, _implied_default(found), "parquet export")


def _by_folders(files: list[str]) -> Layout:
    tops = sorted({f.split("/", 1)[0] for f in files if "/" in f})
    at_root = any("/" not in f for f in files)
    if len(tops) > 1 and not at_root and not any(t == "data" or _split_word(t) for t in tops):
        subsets = {top: _inferred_splits([f for f in files if f.startswith(top + "/")], top) for top in tops}
        return Layout(subsets, _implied_default(subsets), "folders")
    subsets = {DEFAULT_SUBSET: _inferred_splits(files, "")} if files else {}
    return Layout(subsets, DEFAULT_SUBSET if files else None, "folders")


def _inferred_splits(files: list[str], folder: str) -> dict[str, tuple[str, ...]]:
    """Each file's split (push_to_hub's name, else a split word in its path below `folder`); all train when
    none names one, and files that name none dropped when others do."""
    named: dict[str, list[str]] = {}
    for path in files:
        inside = path[len(folder) + 1 :] if folder else path
        pushed = _PUSHED.match(posixpath.basename(inside))
        split = pushed[1] if pushed else _split_word(inside)
        if split is not None:
            named.setdefault(split, []).append(path)
    if not named:
        return {"train": tuple(files)} if files else {}
    order = sorted(named, key=lambda split: (split != "train", split))  # train first, then by name
    return {split: tuple(sorted(named[split])) for split in order}


def _split_word(path: str) -> str | None:
    """The split a split word in `path` names (the file's name first, then its folders, deepest first)."""
    lowered = path.lower()
    for part in reversed(lowered.split("/")):
        for split, words in SPLIT_WORDS.items():
            if any(re.search(rf"(?:^|{_SEPARATOR}){w}(?:$|{_SEPARATOR})", part) for w in words):
                return split
    return None


def _implied_default(subsets: dict[str, Any]) -> str | None:
    if DEFAULT_SUBSET in subsets:
        return DEFAULT_SUBSET
    return next(iter(subsets)) if len(subsets) == 1 else None


def choose(layout: Layout, repo: str, subset: str | None, split: str | None) -> tuple[str, str, tuple[str, ...]]:
    """(subset, split, its files) as asked; a UserError listing what there is when one is missing or not there."""
    if not layout.subsets:
        raise UserError(f"{repo} holds no data files this import reads (Parquet, JSON Lines, CSV or TSV)")
    if subset is None:
        subset = layout.default
        if subset is None:
            raise UserError(
                f"{repo} has several subsets and none is its default; name one as the subset: {layout.describe()}"
            )
    if subset not in layout.subsets:
        raise UserError(f"{repo} has no subset {subset!r}; its subsets: {layout.describe()}")
    splits = layout.subsets[subset]
    about = f"{repo} (subset {subset})"
    if split is None:
        if len(splits) != 1:
            raise UserError(f"{about} has splits {', '.join(splits) or 'none'}; name one as the split")
        split = next(iter(splits))
    if split not in splits:
        raise UserError(f"{about} has no split {split!r}; its splits: {', '.join(splits) or 'none'}")
    return subset, split, splits[split]


# -- label names -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassLabel:
    """The names of a column's integer labels, in id order; `sequence`: the column is a list of them (tags)."""

    names: tuple[str, ...]
    sequence: bool = False

    def name(self, value: Any, column: str, row: int) -> Any:
        """The name of label `value` (an integer, or one written as digits); any other value as it is."""
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            return value
        if not 0 <= value < len(self.names):
            raise UserError(
                f"row {row}: {column} is {value}, not one of the {len(self.names)} labels its ClassLabel names "
                f"({', '.join(self.names[:10])}{', ...' if len(self.names) > 10 else ''}); a split whose labels "
                "are hidden (-1, as test splits often have) cannot be trained on"
            )
        return self.names[value]


def card_labels(card: dict[str, Any] | None, subset: str) -> dict[str, ClassLabel]:
    """The ClassLabel columns the card's `dataset_info` gives subset `subset` (one without config_name serves any)."""
    infos = (card or {}).get("dataset_info")
    entries = infos if isinstance(infos, list) else [infos] if isinstance(infos, dict) else []
    entries = [e for e in entries if isinstance(e, dict)]
    info = next((e for e in entries if e.get("config_name") == subset), None) or next(
        (e for e in entries if "config_name" not in e), None
    )
    features = info.get("features") if info else None
    labels: dict[str, ClassLabel] = {}
    for feature in features if isinstance(features, list) else []:
        if isinstance(feature, dict) and isinstance(feature.get("name"), str):
            found = _card_class_label(feature)
            if found is not None:
                labels[feature["name"]] = found
    return labels


def _card_class_label(feature: dict[str, Any]) -> ClassLabel | None:
    for key, sequence in (("dtype", False), ("class_label", False), ("sequence", True), ("list", True)):
        value = feature.get(key)
        if key == "class_label" and isinstance(value, dict):
            return _names(value.get("names"), sequence)
        if isinstance(value, dict):
            dtype = value.get("dtype")
            inner = value.get("class_label") or (dtype.get("class_label") if isinstance(dtype, dict) else None)
            if isinstance(inner, dict):
                return _names(inner.get("names"), sequence)
    return None


def parquet_labels(metadata: dict[bytes, bytes] | None) -> dict[str, ClassLabel]:
    """The ClassLabel columns a Parquet file's schema metadata (`datasets`' key b"huggingface") names."""
    try:
        features = json.loads((metadata or {}).get(b"huggingface", b"{}"))["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return {}
    labels = {}
    for column, feature in features.items() if isinstance(features, dict) else ():
        if not isinstance(feature, dict):
            continue
        inner, sequence = feature, False
        if feature.get("_type") in ("Sequence", "List", "LargeList") and isinstance(feature.get("feature"), dict):
            inner, sequence = feature["feature"], True
        if inner.get("_type") == "ClassLabel":
            found = _names(inner.get("names"), sequence)
            if found is not None:
                labels[column] = found
    return labels


def _names(names: Any, sequence: bool) -> ClassLabel | None:
    """A ClassLabel from a list of names, or a mapping of ids ('0', 1, ...) to names; None when it is neither."""
    if isinstance(names, dict):
        try:
            by_id = {int(k): v for k, v in names.items()}
        except (TypeError, ValueError):
            return None
        if sorted(by_id) != list(range(len(by_id))):
            raise UserError(f"a ClassLabel's ids are {sorted(by_id)[:10]}, not 0 .. {len(by_id) - 1}")
        names = [by_id[i] for i in range(len(by_id))]
    if not isinstance(names, list) or not names:
        return None
    return ClassLabel(tuple(str(n) for n in names), sequence)
