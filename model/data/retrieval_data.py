"""Retrieval evaluation sets: queries, a corpus and relevance judgements, in the three mappings
sentence-transformers' InformationRetrievalEvaluator takes (queries {qid: text}, corpus {cid: text},
relevant_docs {qid: {cid}}).

Two layouts:

    BEIR, a folder (uploaded as a .zip or .tar.gz of it)   one JSONL file
      corpus.jsonl   {"_id": "d1", "title": "...", "text": "..."}   {"_id": "d1", "text": "..."}         a document
      queries.jsonl  {"_id": "q1", "text": "..."}                   {"query": "...", "positive_ids": ["d1"]}  a query
      qrels.tsv or qrels/<split>.tsv: query-id, corpus-id, score     (an optional "_id" names the query)

A document's text is its title and its text joined by a space, as sentence-transformers' BEIR examples
join them. A judgement with a score above 0 makes the document relevant (BEIR's pytrec_eval rule). A
BEIR folder may judge several splits (train, dev, test): `load_retrieval` takes one, by default `test`
(a lone qrels.tsv is `test` too, as is a JSONL file), and keeps the queries that split judges, as BEIR's
GenericDataLoader does; queries.jsonl may hold other splits' queries. A duplicate id, a judgement naming an
unknown query or document, a judged query with no relevant document, or an empty text is a ValueError
naming the file (within the folder) and the line.

`unpack_retrieval` extracts an uploaded archive with model.sources' caps (members and bytes counted as
they stream) and keeps only the BEIR files, at the top of the folder it makes.

References: Thakur et al. 2021, "BEIR: A Heterogeneous Benchmark for Zero-shot Evaluation of Information
Retrieval Models" (the layout); beir-cellar/beir datasets/data_loader.py; sentence-transformers
evaluation/InformationRetrievalEvaluator.py.
"""

from __future__ import annotations

import csv
import os
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NamedTuple

from datadir.files import iter_jsonl_objects
from model.errors import UserError
from model.sources import extract_safely

CORPUS, QUERIES, QRELS, QRELS_DIR = "corpus.jsonl", "queries.jsonl", "qrels.tsv", "qrels"
QRELS_HEADER = ("query-id", "corpus-id", "score")
DEFAULT_SPLIT = "test"
MAX_ARCHIVE_MEMBERS = 100  # a BEIR archive holds about six (a folder, two JSONL files, qrels/ and its splits)


class RetrievalSet(NamedTuple):
    """One split of a retrieval set: what an InformationRetrievalEvaluator is built from."""

    queries: dict[str, str]  # the judged queries: id -> text
    corpus: dict[str, str]  # id -> title and text
    relevant: dict[str, set[str]]  # query id -> the ids of its relevant documents (never empty)


def load_retrieval(path: str | os.PathLike, split: str | None = None) -> RetrievalSet:
    """A retrieval set from a BEIR folder (its `split`, by default `test` or its only one) or a JSONL file."""
    path = Path(path)
    if not path.is_dir():
        if split not in (None, DEFAULT_SPLIT):
            raise ValueError(f"{path}: a JSONL retrieval file has one split, {DEFAULT_SPLIT!r}; not {split!r}")
        return _read_jsonl(path)
    splits = retrieval_splits(path)
    split = split or default_split(path, splits)
    if split not in splits:
        raise ValueError(f"{path}: no qrels for split {split!r}; it has {', '.join(splits)}")
    queries, corpus = _read_folder(path)
    return _judged(path, splits[split], queries, corpus)


def load_retrieval_splits(path: str | os.PathLike) -> dict[str, RetrievalSet]:
    """Every split of a BEIR folder (the corpus read once, shared), or the one of a JSONL file."""
    path = Path(path)
    if not path.is_dir():
        return {DEFAULT_SPLIT: _read_jsonl(path)}
    splits = retrieval_splits(path)
    queries, corpus = _read_folder(path)
    return {name: _judged(path, file, queries, corpus) for name, file in splits.items()}


def retrieval_splits(folder: Path) -> dict[str, Path]:
    """The qrels of a BEIR folder by split: qrels/<split>.tsv, or a lone qrels.tsv as `test`."""
    top, below = folder / QRELS, sorted((folder / QRELS_DIR).glob("*.tsv"))
    if top.is_file() and below:
        raise ValueError(f"{folder}: both {QRELS} and {QRELS_DIR}/*.tsv: keep one")
    if top.is_file():
        return {DEFAULT_SPLIT: top}
    if not below:
        raise ValueError(f"{folder}: no relevance judgements: expected {QRELS} or {QRELS_DIR}/<split>.tsv")
    return {file.stem: file for file in below}


def default_split(path: str | os.PathLike, splits: Collection[str]) -> str:
    """The split a retrieval set is evaluated on unless one is named: `test` when judged, else the only one."""
    if DEFAULT_SPLIT in splits:
        return DEFAULT_SPLIT
    if len(splits) == 1:
        return next(iter(splits))
    raise ValueError(f"{path}: no {DEFAULT_SPLIT} split among {', '.join(splits)}: name the split to use")


def unpack_retrieval(
    archive: Path, dest: Path, max_bytes: int, max_members: int = MAX_ARCHIVE_MEMBERS, label: str | None = None
) -> Path:
    """Extract a .zip/.tar.gz of a BEIR folder safely (model.sources.extract_safely: at most `max_members`
    members and `max_bytes` in all) and move its corpus, queries and qrels to the top of `dest`, which must
    not exist; the rest of the archive is dropped. UserError for an archive that is refused or holds no BEIR
    folder (corpus.jsonl at its top, or in one folder)."""
    label = label or archive.name
    work = dest.with_name(f".{dest.name}.unpacking")
    try:
        extract_safely(archive, work, max_bytes, label=label, max_members=max_members, into="the dataset's folder")
        root = _beir_root(work, label)
        dest.mkdir()
        for name in (CORPUS, QUERIES, QRELS, QRELS_DIR):
            if (root / name).exists():
                os.rename(root / name, dest / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _beir_root(work: Path, label: str) -> Path:
    if (work / CORPUS).is_file():
        return work
    found = [p.parent for p in sorted(work.glob(f"*/{CORPUS}")) if p.parent.name != "__MACOSX"]
    if len(found) == 1:
        return found[0]
    raise UserError(f"{label} holds no BEIR folder ({CORPUS}, {QUERIES} and qrels at its top, or in one folder)")


# ---------------------------------------------------------------------------- BEIR


def _read_folder(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(queries, corpus) of a BEIR folder: every query, judged or not, and every document."""
    for name in (CORPUS, QUERIES):
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: no {name}")
    queries: dict[str, str] = {}
    for where, record in _records(folder, QUERIES):
        _new(queries, where, "query", _id(where, record), _required_text(where, record, "text"))
    corpus: dict[str, str] = {}
    for where, record in _records(folder, CORPUS):
        _new(corpus, where, "document", _id(where, record), _document(where, record))
    if not corpus:
        raise ValueError(f"{CORPUS}: no documents")
    return queries, corpus


def _records(folder: Path, name: str) -> Iterator[tuple[str, dict]]:
    with open(folder / name, encoding="utf-8") as f:
        for lineno, record in iter_jsonl_objects(f, name):
            yield f"{name}, line {lineno}", record


def _judged(folder: Path, qrels: Path, queries: dict[str, str], corpus: dict[str, str]) -> RetrievalSet:
    """The split `qrels` judges: its queries, the corpus, and each query's relevant documents."""
    name = qrels.relative_to(folder).as_posix()
    scores: dict[str, dict[str, float]] = {}
    for where, qid, cid, score in _qrels_rows(qrels, name):
        if qid not in queries:
            raise ValueError(f"{where}: query-id {qid!r} is not an _id of {QUERIES}")
        if cid not in corpus:
            raise ValueError(f"{where}: corpus-id {cid!r} is not an _id of {CORPUS}")
        scores.setdefault(qid, {})[cid] = score  # a pair judged twice: the last line counts, as in BEIR
    if not scores:
        raise ValueError(f"{name}: no judgements")
    relevant = {qid: {cid for cid, s in judged.items() if s > 0} for qid, judged in scores.items()}
    unanswered = [qid for qid, cids in relevant.items() if not cids]
    if unanswered:
        raise ValueError(
            f"{name}: {len(unanswered)} judged quer{'y has' if len(unanswered) == 1 else 'ies have'} no relevant "
            f"document (every score 0), the first {unanswered[0]!r}: give each at least one score above 0"
        )
    return RetrievalSet({qid: queries[qid] for qid in relevant}, corpus, relevant)


def _qrels_rows(qrels: Path, name: str) -> Iterator[tuple[str, str, str, float]]:
    """(where, query id, corpus id, score) of each line of a qrels TSV after its header."""
    with open(qrels, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != QRELS_HEADER:
            raise ValueError(f"{name}, line 1: expected the header {'<TAB>'.join(QRELS_HEADER)}, got {header!r}")
        for row in reader:
            where = f"{name}, line {reader.line_num}"
            if not row or not "".join(row).strip():
                continue
            if len(row) != 3:
                raise ValueError(f"{where}: expected 3 tab-separated fields (query-id, corpus-id, score), got {row!r}")
            qid, cid, raw = (field.strip() for field in row)
            try:
                score = float(raw)
            except ValueError:
                raise ValueError(f"{where}: score {raw!r} is not a number") from None
            yield where, qid, cid, score


# ---------------------------------------------------------------------------- one JSONL file


def _read_jsonl(path: Path) -> RetrievalSet:
    """Documents ({"_id", "text", "title"?}) and queries ({"query", "positive_ids", "_id"?}) in one file."""
    corpus: dict[str, str] = {}
    queries: dict[str, str] = {}
    positives: dict[str, tuple[str, list[str]]] = {}  # qid -> (where, its positive ids)
    with open(path, encoding="utf-8") as f:
        for lineno, record in iter_jsonl_objects(f, path):
            where = f"{path}, line {lineno}"
            if ("query" in record) == ("text" in record):
                raise ValueError(
                    f'{where}: a record is a query ({{"query", "positive_ids"}}) or a document '
                    f'({{"_id", "text"}}): it has {"both" if "query" in record else "neither"}'
                )
            if "text" in record:
                _new(corpus, where, "document", _id(where, record), _document(where, record))
                continue
            qid = _id(where, record) if "_id" in record else f"line-{lineno}"
            _new(queries, where, "query", qid, _required_text(where, record, "query"))
            positives[qid] = (where, _positive_ids(where, record))
    if not queries or not corpus:
        raise ValueError(f"{path}: no {'queries' if not queries else 'documents'}")
    for where, ids in positives.values():
        unknown = next((i for i in ids if i not in corpus), None)
        if unknown is not None:
            raise ValueError(f"{where}: positive id {unknown!r} is not the _id of any document")
    return RetrievalSet(queries, corpus, {qid: set(ids) for qid, (_, ids) in positives.items()})


def _positive_ids(where: str, record: dict) -> list[str]:
    ids = record.get("positive_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{where}: 'positive_ids' is {ids!r}: a query needs a list of at least one document id")
    return [_as_id(where, "positive_ids", i) for i in ids]


# ---------------------------------------------------------------------------- fields


def _new(seen: dict[str, str], where: str, what: str, key: str, text: str) -> None:
    if key in seen:
        raise ValueError(f"{where}: duplicate {what} _id {key!r}")
    seen[key] = text


def _id(where: str, record: dict) -> str:
    return _as_id(where, "_id", record.get("_id"))


def _as_id(where: str, field: str, value: object) -> str:
    """An id: a non-empty string, or an integer (BEIR's qrels hold ids as text, so 7 and "7" are one id)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {field!r} is {value!r}, not an id (a non-empty string)")
    return value.strip()


def _required_text(where: str, record: dict, field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {field!r} is empty or not text: {value!r}")
    return value


def _document(where: str, record: dict) -> str:
    """Title and text joined by a space; empty both is an error."""
    title, text = record.get("title") or "", record.get("text") or ""
    if not isinstance(text, str) or not isinstance(title, str):
        raise ValueError(f"{where}: 'text' and 'title' must be text, got {text!r} and {title!r}")
    joined = " ".join(part for part in (title.strip(), text.strip()) if part)
    if not joined:
        raise ValueError(f"{where}: the document has no text (its 'text' and 'title' are empty)")
    return joined
