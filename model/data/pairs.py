"""Pairs of texts for embedding and cross-encoder training, in sentence-transformers' column conventions,
so a file made for its trainer reads here unchanged:

    pairs          anchor, positive, and optionally hard negatives: one `negative` column, or
                   negative_1 .. negative_n (numbered from 1, without gaps); an `id` column may ride along
    scored-pairs   sentence1, sentence2, score (a float in 0..1, as CoSENTLoss and CosineSimilarityLoss
                   take it: STS-B's 0-5 divided by 5)

Either is CSV, TSV or JSONL, optionally .gz/.bz2 (model.data.finetune.read_table reads them); other
columns are ignored. Every row must hold every text: an empty anchor, positive or score, or a negative
that some rows have and another lacks (a batch needs the same columns in every row), is a ValueError
naming the file, the line and what the file's other rows hold.

References: sentence-transformers docs, "Dataset Overview" and "Loss Overview" (the column names and
orders losses expect); its datasets sentence-transformers/all-nli (anchor, positive, negative) and
sentence-transformers/stsb (sentence1, sentence2, score).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from model.data.finetune import read_table

ANCHOR, POSITIVE, NEGATIVE, ID = "anchor", "positive", "negative", "id"
SENTENCE1, SENTENCE2, SCORE = "sentence1", "sentence2", "score"
_NUMBERED = re.compile(r"^negative_(\d+)$")


@dataclass(frozen=True)
class Pair:
    """An anchor, its positive and its hard negatives (the same number in every row of a file)."""

    anchor: str
    positive: str
    negatives: tuple[str, ...] = ()
    id: str | None = None


@dataclass(frozen=True)
class ScoredPair:
    """Two sentences and how similar they are, in 0..1."""

    sentence1: str
    sentence2: str
    score: float


def negative_columns(path: str | os.PathLike, columns: list[str]) -> tuple[str, ...]:
    """The hard negatives' columns among `columns`, in order: (), ("negative",) or negative_1 .. negative_n.
    A ValueError for both kinds at once, or numbers that do not run 1 .. n."""
    numbered = sorted((int(m.group(1)), c) for c in columns if (m := _NUMBERED.match(c)))
    if not numbered:
        return (NEGATIVE,) if NEGATIVE in columns else ()
    if NEGATIVE in columns:
        raise ValueError(
            f"{path}: both a 'negative' column and numbered ones ({numbered[0][1]}, ...): use one or the other"
        )
    names = tuple(c for _, c in numbered)
    expected = tuple(f"{NEGATIVE}_{i}" for i in range(1, len(names) + 1))
    if names != expected:
        raise ValueError(
            f"{path}: the negative columns are {', '.join(names)}; they are numbered negative_1 .. negative_n "
            f"without gaps (here {', '.join(expected)})"
        )
    return names


def load_pairs(path: str | os.PathLike) -> list[Pair]:
    """The rows of a pairs file (anchor, positive, optional negatives and id), every one checked."""
    path = Path(path)
    rows = read_table(path)
    columns = _columns(rows)
    _require(path, columns, [ANCHOR, POSITIVE])
    negatives = negative_columns(path, columns)
    first = _first_lines(rows, negatives)
    for column in negatives:
        if column not in first:
            raise ValueError(f"{path}: the column {column!r} is empty in every row")
    pairs = []
    for lineno, row in rows:
        for column in negatives:
            if _blank(row.get(column)):
                raise ValueError(
                    f"{path}, line {lineno}: no {column!r}, which line {first[column]} has: every row needs the "
                    f"same {_count(len(negatives), 'negative')} ({', '.join(negatives)})"
                )
        pairs.append(
            Pair(
                anchor=_text(path, lineno, row, ANCHOR),
                positive=_text(path, lineno, row, POSITIVE),
                negatives=tuple(_text(path, lineno, row, c) for c in negatives),
                id=None if _blank(row.get(ID)) else str(row[ID]),
            )
        )
    return pairs


def load_scored_pairs(path: str | os.PathLike) -> list[ScoredPair]:
    """The rows of a scored-pairs file (sentence1, sentence2, a score in 0..1), every one checked."""
    path = Path(path)
    rows = read_table(path)
    _require(path, _columns(rows), [SENTENCE1, SENTENCE2, SCORE])
    return [
        ScoredPair(_text(path, lineno, row, SENTENCE1), _text(path, lineno, row, SENTENCE2), _score(path, lineno, row))
        for lineno, row in rows
    ]


def _columns(rows: list[tuple[int, dict]]) -> list[str]:
    """Every column any row has, in the order first seen (a CSV's header; the keys of a JSONL's records)."""
    seen: dict[str, None] = {}
    for _, row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _require(path: Path, columns: list[str], needed: list[str]) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {sorted(columns)}")


def _first_lines(rows: list[tuple[int, dict]], columns: tuple[str, ...]) -> dict[str, int]:
    """The first line holding each of `columns` (those that no row holds are absent)."""
    first: dict[str, int] = {}
    for lineno, row in rows:
        for column in columns:
            if column not in first and not _blank(row.get(column)):
                first[column] = lineno
        if len(first) == len(columns):
            break
    return first


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _text(path: Path, lineno: int, row: dict, column: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}, line {lineno}: {column!r} is empty or not text: {value!r}")
    return value


def _score(path: Path, lineno: int, row: dict) -> float:
    raw = row.get(SCORE)
    try:
        if isinstance(raw, bool):
            raise ValueError
        score = float(raw.strip() if isinstance(raw, str) else raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        score = math.nan
    if not 0.0 <= score <= 1.0:  # NaN fails too
        raise ValueError(
            f"{path}, line {lineno}: {SCORE!r} is {raw!r}, not a number in 0..1 "
            "(scale scores given on another range, such as STS-B's 0-5, to 0..1)"
        )
    return score


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
