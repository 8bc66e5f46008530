"""The rows of a Hub dataset's split (its Parquet, JSON Lines or CSV/TSV files, in order) written as the file an
upload of a kind is, so that the upload's own checks read them (app/jobs/dataset_checks.py):

    kind            written as                                              columns read
    labelled        data.jsonl, {"text", "label"[, "text_pair"]} a line     text, label, text_pair
    token-labelled  data.jsonl, {"tokens", "tags"} a line                   tokens, tags (else ner_tags)
    qa              data.json, SQuAD v2.0: a paragraph for each run of      id, title, context, question,
                    rows with one context; no answer: is_impossible         answers ({text, answer_start})
    pairs           data.jsonl, {"anchor", "positive", negatives[, "id"]}   anchor, positive, negative or
                                                                            negative_1 .. negative_n, id
    scored-pairs    data.jsonl, {"sentence1", "sentence2", "score"}         sentence1, sentence2, score
    corpus          data.jsonl, {"text"} a line                             text

`columns` renames the split's columns first ({"query": "anchor"}); without a kind, the columns say which, as an
upload's header does. Asked for pairs or scored pairs, a split whose columns have other names gives its text
columns in order, as sentence-transformers' losses take them (anchor, positive, then the negatives; sentence1,
sentence2), and a scored split its `score` column (else `label`). A column with ClassLabel names (the card's,
or the Parquet file's own) is written as names: imdb's labels are neg and pos, conll2003's tags B-PER ...

Bounds: a Parquet row group is read only when the columns read hold at most `max_bytes` uncompressed (its
metadata says so before anything is decompressed), and the file written stops at `max_bytes`.

References: sentence-transformers docs, "Dataset Overview" (column order and names); Rajpurkar et al. 2016,
2018 (SQuAD's JSON); huggingface/datasets' Parquet files (schema metadata `huggingface`).
"""

from __future__ import annotations

import csv
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from datadir.files import iter_jsonl_objects
from model.data.hub_layout import ClassLabel, parquet_labels
from model.errors import UserError

# The columns each kind's file has (pairs: and negative_1 .. negative_n), and those that tell the kind of a split.
KIND_COLUMNS: dict[str, tuple[str, ...]] = {
    "labelled": ("text", "label", "text_pair"),
    "token-labelled": ("tokens", "tags"),
    "qa": ("id", "title", "context", "question", "answers"),
    "pairs": ("anchor", "positive", "negative", "id"),
    "scored-pairs": ("sentence1", "sentence2", "score"),
    "corpus": ("text",),
}
SNIFFED = (
    ("pairs", {"anchor", "positive"}),
    ("scored-pairs", {"sentence1", "sentence2", "score"}),
    ("qa", {"question", "context", "answers"}),
    ("token-labelled", {"tokens", "tags"}),
    ("labelled", {"text", "label"}),
    ("corpus", {"text"}),
)
_NEGATIVE = re.compile(r"^negative_\d+$")
BATCH_ROWS = 1024
REPORT_EVERY = 5000  # rows between calls of `on_rows` (a cancel is noticed there)


@dataclass(frozen=True)
class SourceFile:
    path: Path  # on this machine
    name: str  # in the repo, for errors


@dataclass
class Written:
    """The file written (data.jsonl or data.json) and what went into it."""

    kind: str
    path: Path
    rows: int
    columns: dict[str, str] = field(default_factory=dict)  # a source column -> the column it became
    first_row: int = 0  # the split's index of the first row written (its line 1)


def importable_kinds() -> tuple[str, ...]:
    return tuple(KIND_COLUMNS)


def write_split(
    files: list[SourceFile],
    dest: Path,
    *,
    kind: str | None = None,
    columns: dict[str, str] | None = None,
    labels: dict[str, ClassLabel] | None = None,
    start: int = 0,
    stop: int | None = None,
    max_bytes: int,
    limit: str = "the most a dataset may hold",
    on_rows: Callable[[int], None] | None = None,
) -> Written:
    """Write rows start .. stop of `files` into folder `dest` as `kind` (else the kind their columns name).
    `labels`: ClassLabel names by source column (the Parquet files' own are added); `limit` names `max_bytes`
    in the refusal; `on_rows(rows so far)` is called every REPORT_EVERY rows and may raise to stop."""
    if not files:
        raise UserError("the split has no data files")
    if kind is not None and kind not in KIND_COLUMNS:
        raise UserError(f"kind: a Hub dataset imports as {', '.join(KIND_COLUMNS)}, not {kind}")
    source = columns_of(files[0])
    labels = {**file_labels(files[0]), **(labels or {})}
    kind, renames = _kind(source, _renames(source, columns or {}), kind, files[0])
    renames = {s: t for s, t in renames.items() if _written(kind, t)}
    by_target = {t: labels[s] for s, t in renames.items() if s in labels}
    rows = _rows(files, list(renames), max_bytes, start, stop)
    out = dest / ("data.json" if kind == "qa" else "data.jsonl")
    with _Sink(out, max_bytes, limit, kind) as sink:
        if kind == "qa":
            n = _write_squad(rows, renames, by_target, sink, start, on_rows)
        else:
            n, shape = 0, _SHAPES[kind]
            for n, row in enumerate(rows, 1):
                sink.write_line(shape(_renamed(row, renames, by_target, start + n - 1), start + n - 1), start + n - 1)
                if on_rows is not None and n % REPORT_EVERY == 0:
                    on_rows(n)
    if n == 0:
        raise UserError(f"the split has no rows{f' from row {start} on' if start else ''}")
    return Written(kind, out, n, {s: t for s, t in renames.items() if s != t}, start)


def lines_as_rows(message: str, first_row: int) -> str:
    """An upload check's words on a written JSONL file ("the file, line 3") as the split's rows ("row 2")."""
    return re.sub(r"the file, line (\d+)", lambda m: f"row {first_row + int(m[1]) - 1}", message)


# -- the columns, and the kind they name ----------------------------------------------------------


def _renames(source: list[str], asked: dict[str, str]) -> dict[str, str]:
    """Each source column -> its name in the file: `asked` for the named ones, the others as they are."""
    missing = [c for c in asked if c not in source]
    if missing:
        raise UserError(f"columns: the split has no column {missing[0]!r}; its columns: {', '.join(source)}")
    known = {c for cols in KIND_COLUMNS.values() for c in cols}
    for target in asked.values():
        if target not in known and not _NEGATIVE.match(target):
            raise UserError(
                f"columns: {target!r} is no column of a dataset kind; they are {', '.join(sorted(known))}, negative_N"
            )
    renames = {c: asked.get(c, c) for c in source}
    targets = list(renames.values())
    twice = next((t for t in targets if targets.count(t) > 1), None)
    if twice is not None:
        sources = [s for s, t in renames.items() if t == twice]
        raise UserError(f"columns: {' and '.join(sources)} would both be {twice!r}; rename one, or the other away")
    return renames


def _kind(source: list[str], renames: dict[str, str], kind: str | None, file: SourceFile) -> tuple[str, dict[str, str]]:
    names = set(renames.values())
    if kind is None:
        if "tags" not in names and "ner_tags" in names and "tokens" in names:
            kind = "token-labelled"
        else:
            kind = next((k for k, needed in SNIFFED if needed <= names), None)
        if kind is None:
            raise UserError(
                f"cannot tell what the columns {', '.join(source)} hold: name the kind, or map columns to a kind's "
                "(text and label; tokens and tags; question, context and answers; anchor and positive; "
                "sentence1, sentence2 and score; text alone for a corpus)"
            )
    if kind == "token-labelled" and "tags" not in names and "ner_tags" in names:
        renames = {s: ("tags" if t == "ner_tags" else t) for s, t in renames.items()}
    if (
        kind in ("pairs", "scored-pairs")
        and not ({"anchor", "positive"} if kind == "pairs" else {"sentence1"}) <= names
    ):
        renames = _by_position(kind, source, renames, _text_columns(file))
    return kind, renames


def _by_position(kind: str, source: list[str], renames: dict[str, str], texts: list[str]) -> dict[str, str]:
    """sentence-transformers' rule: the text columns in order are anchor, positive, negatives (sentence1,
    sentence2); a scored split's score is its `score` column, else `label`."""
    texts = [s for s in texts if renames[s] not in ("id", "score", "label")]
    if kind == "pairs":
        names = ["anchor", "positive"] + (
            ["negative"] if len(texts) == 3 else [f"negative_{i}" for i in range(1, len(texts) - 1)]
        )
    else:
        names = ["sentence1", "sentence2"]
        texts = texts[:2]
    if len(texts) < 2:
        raise UserError(f"{kind} need two text columns at least; the split's columns: {', '.join(source)}")
    placed = dict(zip(texts, names, strict=True))
    renames = {s: placed.get(s, t) for s, t in renames.items()}
    if kind == "scored-pairs" and "score" not in renames.values():
        renames = {s: ("score" if t == "label" else t) for s, t in renames.items()}
    return renames


def _written(kind: str, column: str) -> bool:
    return column in KIND_COLUMNS[kind] or (kind == "pairs" and _NEGATIVE.match(column) is not None)


def _renamed(row: dict, renames: dict[str, str], labels: dict[str, ClassLabel], index: int) -> dict[str, Any]:
    """The row's written columns under their new names, ClassLabel integers as their names."""
    out = {}
    for source, target in renames.items():
        value = row.get(source)
        label = labels.get(target)
        if label is not None and value is not None:
            value = (
                [label.name(v, target, index) for v in value]
                if label.sequence and isinstance(value, list)
                else (label.name(value, target, index))
            )
        out[target] = value
    return out


# -- each kind's record ---------------------------------------------------------------------------


def _labelled(row: dict, index: int) -> dict:
    return {k: row[k] for k in ("text", "text_pair", "label") if k in row}


def _token_labelled(row: dict, index: int) -> dict:
    return {"tokens": row.get("tokens"), "tags": row.get("tags")}


def _same(row: dict, index: int) -> dict:
    return row


_SHAPES: dict[str, Callable[[dict, int], dict]] = {
    "labelled": _labelled,
    "token-labelled": _token_labelled,
    "pairs": _same,
    "scored-pairs": _same,
    "corpus": _same,
}


def _write_squad(rows, renames, labels, sink: _Sink, start: int, on_rows) -> int:
    """SQuAD JSON: an article for each run of rows with one title, a paragraph for each run with one context."""
    sink.write(b'{"version": "v2.0", "data": [\n')
    article: dict | None = None
    n = written = 0
    for n, row in enumerate(rows, 1):
        index = start + n - 1
        row = _renamed(row, renames, labels, index)
        title, context = row.get("title") or "", row.get("context")
        if article is None or article["title"] != title:
            if article is not None:
                written += 1
                sink.write_article(article, index, written)
            article = {"title": title, "paragraphs": []}
        paragraphs = article["paragraphs"]
        if not paragraphs or paragraphs[-1]["context"] != context:
            paragraphs.append({"context": context, "qas": []})
        answers = _answers(row.get("answers"), index)
        qa = {"id": str(row["id"]) if row.get("id") is not None else str(index), "question": row.get("question")}
        paragraphs[-1]["qas"].append({**qa, "answers": answers, "is_impossible": answers == []})
        if on_rows is not None and n % REPORT_EVERY == 0:
            on_rows(n)
    if article is not None:
        sink.write_article(article, start + n - 1, written + 1)
    sink.write(b"\n]}\n")
    return n


def _answers(value: Any, index: int) -> Any:
    """`datasets`' answers ({"text": [...], "answer_start": [...]}) as SQuAD's list of {text, answer_start}."""
    if isinstance(value, dict):
        texts, starts = value.get("text"), value.get("answer_start")
        if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
            raise UserError(
                f"row {index}: answers is not a list of texts and a list of answer_starts of one length: {value!r:.200}"
            )
        return [{"text": t, "answer_start": s} for t, s in zip(texts, starts, strict=True)]
    return value  # already SQuAD's list (else the check says what it is)


class _Sink:
    """The file written, counting its bytes against `max_bytes`."""

    def __init__(self, path: Path, max_bytes: int, limit: str, kind: str):
        self.path, self.max_bytes, self.limit, self.kind = path, max_bytes, limit, kind
        self.bytes = 0
        self._file: BinaryIO | None = None

    def __enter__(self) -> _Sink:
        self._file = open(self.path, "wb")  # noqa: SIM115  (closed by __exit__)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._file is not None
        self._file.close()

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.bytes > self.max_bytes:
            raise UserError(
                f"the rows take more than {self.max_bytes:,} bytes as a {self.kind} file, {self.limit}; import fewer "
                "rows (a slice of the split, such as train[:10000])"
            )
        assert self._file is not None
        self._file.write(data)

    def write_line(self, record: dict, index: int) -> None:
        self.write(_json(record, index) + b"\n")

    def write_article(self, article: dict, index: int, number: int) -> None:
        self.write((b",\n" if number > 1 else b"") + _json(article, index))


def _json(value: dict, index: int) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise UserError(f"row {index}: a value is not text, a number or a list of them ({e})") from None


# -- reading the files ----------------------------------------------------------------------------


def columns_of(file: SourceFile) -> list[str]:
    """A data file's columns: a Parquet schema's, a JSON Lines file's first record's keys, a CSV/TSV header."""
    if _is_parquet(file):
        return list(_parquet(file).schema_arrow.names)
    if _is_jsonl(file):
        first = next(_jsonl_rows(file), None)
        return list(first) if first is not None else []
    with _open(file) as f:
        return next(csv.reader(f, delimiter=_delimiter(file)), [])


def _text_columns(file: SourceFile) -> list[str]:
    """The columns of text, in order: a Parquet schema's string columns, a JSON Lines file's first record's, a
    CSV/TSV file's every column."""
    if _is_parquet(file):
        import pyarrow as pa

        schema = _parquet(file).schema_arrow
        return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    if _is_jsonl(file):
        first = next(_jsonl_rows(file), {})
        return [c for c, v in first.items() if isinstance(v, str)]
    return columns_of(file)


def file_labels(file: SourceFile) -> dict[str, ClassLabel]:
    """The ClassLabel columns a Parquet file written by `datasets` names in its schema's metadata."""
    return parquet_labels(_parquet(file).schema_arrow.metadata) if _is_parquet(file) else {}


def _rows(files: list[SourceFile], columns: list[str], max_bytes: int, start: int, stop: int | None) -> Iterator[dict]:
    """Rows start .. stop of the files in order (a Parquet file's row groups before `start` are not read)."""
    skip, left = start, None if stop is None else stop - start
    for file in files:
        if left is not None and left <= 0:
            return
        if _is_parquet(file):
            rows: Iterator[dict] = _parquet_rows(file, columns, max_bytes, skip)
            skip = max(0, skip - _parquet(file).metadata.num_rows)
        else:
            rows = _jsonl_rows(file) if _is_jsonl(file) else _csv_rows(file)
            for _ in itertools.islice(rows, skip):
                skip -= 1
        for row in rows if left is None else itertools.islice(rows, left):
            if left is not None:
                left -= 1
            yield row


def _parquet(file: SourceFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file.path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{file.name} is not a readable Parquet file: {e}") from None


def _parquet_rows(file: SourceFile, columns: list[str], max_bytes: int, skip: int) -> Iterator[dict]:
    import pyarrow as pa

    pf = _parquet(file)
    wanted = [c for c in columns if c in pf.schema_arrow.names]
    meta = pf.metadata
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if skip >= group.num_rows:
            skip -= group.num_rows
            continue
        size = sum(
            group.column(i).total_uncompressed_size
            for i in range(group.num_columns)
            if group.column(i).path_in_schema.split(".")[0] in wanted
        )
        if size > max_bytes:
            raise UserError(
                f"{file.name}: row group {g} holds {size:,} bytes uncompressed, more than the {max_bytes:,} a dataset "
                "may hold"
            )
        try:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=wanted):
                rows = batch.to_pylist()
                yield from rows[skip:]
                skip = max(0, skip - len(rows))
        except pa.ArrowException as e:
            raise UserError(f"{file.name}: row group {g} cannot be read: {e}") from None


def _jsonl_rows(file: SourceFile) -> Iterator[dict]:
    with _open(file) as f:
        try:
            for _, record in iter_jsonl_objects(f, file.name):
                yield record
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(str(e) if isinstance(e, ValueError) else f"{file.name} is not UTF-8: {e}") from None


def _csv_rows(file: SourceFile) -> Iterator[dict]:
    from model.data.finetune import iter_csv_rows

    with _open(file) as f:
        try:
            for _, row in iter_csv_rows(f, file.name, _delimiter(file)):
                yield row
        except ValueError as e:
            raise UserError(str(e)) from None
        except UnicodeDecodeError as e:
            raise UserError(f"{file.name} is not UTF-8: {e}") from None


def _open(file: SourceFile):
    """A text data file, decompressed (.gz, .bz2), as the upload readers open theirs (here, so that the command
    line's parser imports no torch)."""
    from model.data.finetune import _open_text

    return _open_text(file.path)


def _bare(file: SourceFile) -> str:
    name = file.name.lower()
    for suffix in (".gz", ".bz2"):
        name = name.removesuffix(suffix)
    return name


def _is_parquet(file: SourceFile) -> bool:
    return _bare(file).endswith(".parquet")


def _is_jsonl(file: SourceFile) -> bool:
    return _bare(file).endswith((".jsonl", ".ndjson"))


def _delimiter(file: SourceFile) -> str:
    return "\t" if _bare(file).endswith(".tsv") else ","
