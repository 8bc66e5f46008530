"""Fine-tuning data: labelled texts (or text pairs) from CSV, TSV or JSONL, a label map, a held-out split.

Labels that are strings map to ids in sorted order (numeric order when every label is an integer), so
the same training file always gives the same map; the map goes into the model's config as
id2label/label2id. With `regression=True` labels are floats and the map is the single "LABEL_0" that
Hugging Face uses for num_labels == 1.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from datadir.files import iter_jsonl_objects
from model.data.batches import RowBatches

DEFAULT_TEXT_COLUMN, DEFAULT_PAIR_COLUMN, DEFAULT_LABEL_COLUMN = "text", "text_pair", "label"

csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # review texts can exceed csv's 128 KiB default


@dataclass
class LabeledExample:
    text: str
    label: int | float
    text_pair: str | None = None


@dataclass
class ClassificationData:
    """Train and eval examples plus the label map to store in the model config."""

    train: list[LabeledExample]
    eval: list[LabeledExample]
    id2label: dict[int, str]
    label2id: dict[str, int]
    regression: bool = False
    is_pair: bool = False
    groups: dict[str, list] = field(default_factory=dict)  # train/eval group values, when split by group

    @property
    def num_labels(self) -> int:
        return 1 if self.regression else len(self.id2label)

    def config_updates(self) -> dict:
        """Fields to set on BertConfig before building BertForSequenceClassification."""
        return {
            "id2label": dict(self.id2label),
            "label2id": dict(self.label2id),
            "problem_type": "regression" if self.regression else "single_label_classification",
        }


# ---------------------------------------------------------------------------- reading tables


def _open_text(path: Path):
    name = path.name.lower()
    if name.endswith(".bz2"):
        return io.TextIOWrapper(bz2.open(path, "rb"), encoding="utf-8", newline="")
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def table_format(path: Path) -> str:
    name = path.name.lower()
    for ext in (".bz2", ".gz"):
        name = name.removesuffix(ext)
    for suffix, fmt in ((".csv", "csv"), (".tsv", "tsv"), (".jsonl", "jsonl"), (".ndjson", "jsonl")):
        if name.endswith(suffix):
            return fmt
    raise ValueError(f"cannot tell the format of {path}: expected a .csv, .tsv or .jsonl file")


def read_table(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """Rows of a CSV/TSV/JSONL file (optionally .gz/.bz2) as (line number, {column: value})."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    fmt = table_format(path)
    with _open_text(path) as f:
        if fmt == "jsonl":
            rows = list(iter_jsonl_objects(f, path))
        else:
            rows = list(iter_csv_rows(f, path, delimiter="," if fmt == "csv" else "\t"))
    if not rows:
        raise ValueError(f"{path} has no data rows")
    return rows


class _RowLines:
    """A file's lines, keeping those read since `taken()` was last called: csv reads a row's lines one by one."""

    def __init__(self, f) -> None:
        self._f, self._read = f, list[str]()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = next(self._f)
        self._read.append(line)
        return line

    def taken(self) -> list[str]:
        lines, self._read = self._read, []
        blank = next((i for i, line in enumerate(lines) if line.strip("\r\n")), len(lines))
        return lines[blank:] or lines  # the blank lines csv skipped before the row are not the row's


def iter_csv_rows(f, path: str | os.PathLike, delimiter: str = ",") -> Iterator[tuple[int, dict]]:
    """(line number of the row's last line, {column: value}) for each row of a CSV/TSV file with a header; a
    row with more fields than the header, or a quote that is never closed (or closed before other text, so
    that the row ran on over the lines below), is a ValueError naming `path` and the line."""
    lines = _RowLines(f)
    reader = csv.DictReader(lines, delimiter=delimiter)
    row_lines: list[str] = []
    try:
        if reader.fieldnames is None:  # an empty file: no rows
            return
        _check_quotes(path, lines.taken(), reader.line_num, delimiter)
        for row in reader:
            row_lines = lines.taken()
            if len(row_lines) > 1:
                _check_quotes(path, row_lines, reader.line_num, delimiter)
            if None in row:
                raise ValueError(f"{path}, line {reader.line_num}: more fields than the header has columns")
            yield reader.line_num, row
    except csv.Error as e:  # a field over csv's size limit
        raise ValueError(f"{path}, line {reader.line_num}: {e}") from None
    if len(row_lines) == 1:  # a quote left open on the file's last line
        _check_quotes(path, row_lines, reader.line_num, delimiter)


_CLOSE_IT = 'close the field with a " (a " inside a quoted field is written "")'


def _check_quotes(path: str | os.PathLike, row_lines: list[str], last_line: int, delimiter: str) -> None:
    """Python's csv reads a quoted field that is never closed to the end of the file, and one whose closing
    quote other text follows on to the next quote: either makes one row of many lines, whose last field
    or label is then at fault for no reason a reader could see. Name the line where the field opens."""
    first_line = last_line - len(row_lines) + 1
    fields = _last_row(row_lines, delimiter)
    if fields and _last_row([*row_lines, "\n"], delimiter)[-1] != fields[-1]:  # still open: it took the line in
        breaks = re.findall(r"\r\n|\r|\n", fields[-1])
        opens = last_line - len(breaks) + (fields[-1].endswith(("\n", "\r")))  # the last line's own break aside
        raise ValueError(
            f"{path}, line {opens}: a quoted field opens here and is never closed (the file ends inside it); "
            f"{_CLOSE_IT}"
        )
    if len(row_lines) > 1:
        strict = csv.reader(row_lines, delimiter=delimiter, strict=True)
        try:
            for _ in strict:
                pass
        except csv.Error:
            raise ValueError(
                f"{path}, line {first_line}: a quoted field opens in this row and is not closed where the field "
                f'ends: the row runs on to the " on line {first_line + strict.line_num - 1}, which other text '
                f"follows; {_CLOSE_IT}"
            ) from None


def _last_row(lines: list[str], delimiter: str) -> list[str]:
    rows = [row for row in csv.reader(lines, delimiter=delimiter) if row]
    return rows[-1] if rows else []


def _check_columns(path: Path, rows: list[tuple[int, dict]], needed: list[str]) -> None:
    seen = set().union(*(row.keys() for _, row in rows[:1000]))
    missing = [c for c in needed if c not in seen]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {sorted(seen)}")


# ---------------------------------------------------------------------------- labels and splits


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def build_label_map(labels) -> tuple[dict[int, str], dict[str, int]]:
    """id2label, label2id for the distinct labels, sorted (numerically when all are integers)."""
    distinct = {str(x) for x in labels}
    ordered = sorted(distinct, key=int) if all(_is_int(x) for x in distinct) else sorted(distinct)
    return dict(enumerate(ordered)), {label: i for i, label in enumerate(ordered)}


def split_holdout(n: int, fraction: float, seed: int, groups: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (train indices, eval indices). With `groups`, every group lands wholly on one side."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"eval fraction must be between 0 and 1, got {fraction!r}")
    rng = np.random.default_rng(seed)
    if groups is None:
        if n < 2:
            raise ValueError(f"need at least 2 rows to hold some out, got {n}")
        order = rng.permutation(n)
        k = min(max(1, round(n * fraction)), n - 1)
        return np.sort(order[k:]), np.sort(order[:k])
    if len(groups) != n:
        raise ValueError(f"got {len(groups)} group values for {n} rows")
    keys = np.array([str(g) for g in groups])
    distinct, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    if len(distinct) < 2:
        raise ValueError(f"need at least 2 distinct groups to split by group, got {len(distinct)}")
    eval_groups: list[int] = []
    held, target = 0, n * fraction
    for g in rng.permutation(len(distinct)):
        if held >= target or len(eval_groups) == len(distinct) - 1:
            break
        eval_groups.append(g)
        held += counts[g]
    in_eval = np.isin(inverse, eval_groups)
    return np.flatnonzero(~in_eval), np.flatnonzero(in_eval)


# ---------------------------------------------------------------------------- loading


def load_classification_data(
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike | None = None,
    *,
    text_column: str = DEFAULT_TEXT_COLUMN,
    text_pair_column: str | None = DEFAULT_PAIR_COLUMN,
    label_column: str = DEFAULT_LABEL_COLUMN,
    regression: bool = False,
    labels: list[str] | None = None,
    eval_fraction: float = 0.1,
    group_column: str | None = None,
    seed: int = 0,
) -> ClassificationData:
    """Read labelled data; without `eval_path`, hold out `eval_fraction` of train (by `group_column` if given).

    `text_pair_column` is used when the file has it; naming a column other than the default that the
    file lacks is an error. `labels` fixes the label set (and order) instead of taking it from the data.
    """
    train_path = Path(train_path)
    rows = read_table(train_path)
    pair_col = _pair_column(train_path, rows, text_pair_column)
    needed = [text_column, label_column] + ([pair_col] if pair_col else []) + ([group_column] if group_column else [])
    _check_columns(train_path, rows, needed)
    id2label, label2id = _label_maps(train_path, rows, label_column, regression, labels)
    convert = _LabelConverter(label_column, regression, label2id)
    train = [_example(train_path, ln, r, text_column, pair_col, convert) for ln, r in rows]
    groups: dict[str, list] = {}
    if eval_path is not None:
        eval_path = Path(eval_path)
        eval_rows = read_table(eval_path)
        _check_columns(eval_path, eval_rows, [text_column, label_column] + ([pair_col] if pair_col else []))
        evals = [_example(eval_path, ln, r, text_column, pair_col, convert) for ln, r in eval_rows]
    else:
        group_values = [r[group_column] for _, r in rows] if group_column else None
        train, evals, groups = _hold_out(train, eval_fraction, seed, group_values)
    return ClassificationData(train, evals, id2label, label2id, regression, pair_col is not None, groups)


def _label_maps(
    path: Path, rows, label_column: str, regression: bool, labels: list[str] | None
) -> tuple[dict[int, str], dict[str, int]]:
    """id2label and label2id: one pseudo-label for regression, `labels` as given, else from the data."""
    if regression:
        return {0: "LABEL_0"}, {"LABEL_0": 0}
    if labels is not None:
        return dict(enumerate(map(str, labels))), {str(x): i for i, x in enumerate(labels)}
    return build_label_map(_raw_label(path, ln, r, label_column) for ln, r in rows)


def _hold_out(examples: list, fraction: float, seed: int, group_values: list | None):
    """(train, eval, groups): `fraction` of the examples held out, whole groups at a time when given."""
    train_idx, eval_idx = split_holdout(len(examples), fraction, seed, group_values)
    groups = {}
    if group_values is not None:
        groups = {
            "train": sorted({str(group_values[i]) for i in train_idx}),
            "eval": sorted({str(group_values[i]) for i in eval_idx}),
        }
    return [examples[i] for i in train_idx], [examples[i] for i in eval_idx], groups


def _pair_column(path: Path, rows, text_pair_column: str | None) -> str | None:
    if text_pair_column is None:
        return None
    present = any(text_pair_column in r for _, r in rows[:1000])
    if not present and text_pair_column != DEFAULT_PAIR_COLUMN:
        raise ValueError(f"{path}: missing column(s) [{text_pair_column!r}]; found {sorted(rows[0][1])}")
    return text_pair_column if present else None


def _raw_label(path: Path, lineno: int, row: dict, column: str) -> str:
    value = row.get(column)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{path}, line {lineno}: empty {column!r}")
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


class _LabelConverter:
    def __init__(self, column: str, regression: bool, label2id: dict[str, int]):
        self.column, self.regression, self.label2id = column, regression, label2id

    def __call__(self, path: Path, lineno: int, row: dict) -> int | float:
        raw = _raw_label(path, lineno, row, self.column)
        if self.regression:
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"{path}, line {lineno}: {self.column!r} is {raw!r}, not a number") from None
        if raw not in self.label2id:
            raise ValueError(f"{path}, line {lineno}: unknown label {raw!r} (known labels: {sorted(self.label2id)})")
        return self.label2id[raw]


def _example(path: Path, lineno: int, row: dict, text_col: str, pair_col: str | None, convert) -> LabeledExample:
    text = _text(path, lineno, row, text_col)
    pair = _text(path, lineno, row, pair_col) if pair_col else None
    return LabeledExample(text, convert(path, lineno, row), pair)


def _text(path: Path, lineno: int, row: dict, column: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}, line {lineno}: {column!r} is empty or not text: {value!r}")
    return value


# ---------------------------------------------------------------------------- batches


class ClassificationBatches(RowBatches):
    """Tokenised, shuffled-per-epoch batches of labelled examples: input_ids, token_type_ids,
    attention_mask (B, T) padded to the longest in the batch, labels (B,) long (float for regression).
    """

    def __init__(
        self,
        examples: list[LabeledExample],
        tokenizer,
        *,
        batch_size: int = 32,
        max_seq_len: int = 128,
        seed: int = 0,
        shuffle: bool = True,
        regression: bool = False,
        drop_last: bool = False,
    ):
        super().__init__(examples, batch_size, seed, shuffle, drop_last)
        self.tokenizer, self.max_seq_len, self.regression = tokenizer, max_seq_len, regression

    @property
    def examples(self) -> list[LabeledExample]:
        return self.rows

    def collate(self, examples: list[LabeledExample]) -> dict[str, torch.Tensor]:
        pairs = [e.text_pair for e in examples] if examples[0].text_pair is not None else None
        batch = self.tokenizer(
            [e.text for e in examples], pairs, max_length=self.max_seq_len, truncation=True, padding=True
        )
        dtype = torch.float if self.regression else torch.long
        batch["labels"] = torch.tensor([e.label for e in examples], dtype=dtype)
        return batch
