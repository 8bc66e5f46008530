"""Batches of text pairs for embedding training, and their held-out share, as sentence-transformers' trainer
makes them:

    data = load_embedding_data("pairs.csv", eval_path=None, eval_fraction=0.1, seed=0)   # EmbeddingData
    batches = PairBatches(data.train, tokenizer, batch_size=64, max_seq_len=128, seed=0)
    batch = next(batches.iter_batches(epoch=0))   # input_ids, token_type_ids, attention_mask: (B, C, T)

Each text is tokenised on its own ([CLS] text [SEP], cut to `max_seq_len` tokens, token type 0), as the
Transformer module of a SentenceTransformer tokenises each column; a batch holds C columns of B rows, padded
to its longest text: anchor, positive and any hard negatives (pairs), or sentence1 and sentence2 with
`scores` (B,) (scored pairs). Each distinct text is tokenised once.

Pairs are batched as sentence-transformers' NoDuplicatesBatchSampler batches them: rows in a seeded shuffled
order, each added to the batch unless one of its texts (any column) is already in it, in which case it
waits, in order, for a later batch; so no in-batch negative is a copy of a row's positive. Scored pairs,
whose loss (CoSENT) compares each row only with its own pair, are batched as its default sampler batches
them: shuffled, in order. The shuffle is the samplers' own (torch.randperm seeded with seed + epoch), so a
seed gives the batches sentence-transformers' trainer gives. Either way the batches of an epoch are planned whole from (seed, epoch), so a
batch is a pure function of (seed, epoch, index), and a run resumes exactly (model/training/trainer.py's
BatchSource).

The held-out share: without an evaluation file, `eval_fraction` of the rows, whole anchors at a time (a
pair whose anchor is held out never trains), by split_holdout's seeded draw. Held-out pairs are evaluated
as retrieval (`retrieval_set`: the anchors search every held-out positive and negative, each anchor's
positives relevant); an evaluation file may be pairs, scored pairs or a retrieval set
(model/data/retrieval_data.py).

References: sentence-transformers 6.x, base/sampler.py (NoDuplicatesBatchSampler, DefaultBatchSampler),
base/modules/transformer.py (tokenisation), sentence_transformer/evaluation/information_retrieval.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.data.batches import pad
from model.data.finetune import read_table, split_holdout
from model.data.pairs import (
    ANCHOR,
    POSITIVE,
    SCORE,
    SENTENCE1,
    SENTENCE2,
    Pair,
    ScoredPair,
    load_pairs,
    load_scored_pairs,
)
from model.data.retrieval_data import RetrievalSet, load_retrieval

PAIRS, SCORED_PAIRS, RETRIEVAL = "pairs", "scored-pairs", "retrieval"  # the dataset kinds (datadir.datasets)
TOKENIZE_CHUNK = 1024  # distinct texts tokenised per call


@dataclass(frozen=True)
class EmbeddingData:
    """Training rows and what they are evaluated on: held-out or given pairs, scored pairs or a retrieval set."""

    kind: str  # PAIRS or SCORED_PAIRS, the training rows'
    train: list[Pair] | list[ScoredPair]
    eval: list[Pair] | list[ScoredPair] | RetrievalSet | None


# ---------------------------------------------------------------------------- files


def pair_file_kind(path: str | os.PathLike) -> str | None:
    """PAIRS (anchor and positive columns), SCORED_PAIRS (sentence1, sentence2, score) or None, by the
    columns of a table's first row."""
    _, row = read_table(path)[0]
    if {ANCHOR, POSITIVE} <= row.keys():
        return PAIRS
    if {SENTENCE1, SENTENCE2, SCORE} <= row.keys():
        return SCORED_PAIRS
    return None


def load_embedding_data(
    train_path: str | os.PathLike, eval_path: str | os.PathLike | None, eval_fraction: float, seed: int
) -> EmbeddingData:
    """The training file's rows (pairs or scored pairs, by its columns), and the evaluation file's, or a
    held-out `eval_fraction` of the training rows."""
    kind = pair_file_kind(train_path)
    if kind is None:
        raise ValueError(
            f"{train_path}: not pairs (columns anchor, positive and optionally negatives) nor scored pairs "
            "(columns sentence1, sentence2 and score)"
        )
    train = load_pairs(train_path) if kind == PAIRS else load_scored_pairs(train_path)
    if eval_path is not None:
        return EmbeddingData(kind, train, _load_eval(Path(eval_path), kind))
    held, kept = _hold_out(train, eval_fraction, seed)
    return EmbeddingData(kind, kept, held)


def eval_file_kind(path: str | os.PathLike) -> str | None:
    """PAIRS, SCORED_PAIRS (a table, by its columns), RETRIEVAL (a BEIR folder, or a JSONL file whose records
    are no pairs) or None."""
    path = Path(path)
    if path.is_dir():
        return RETRIEVAL
    return pair_file_kind(path) or (RETRIEVAL if path.name.endswith(".jsonl") else None)


def read_eval_file(path: str | os.PathLike) -> tuple[str, list[Pair] | list[ScoredPair] | RetrievalSet]:
    """(kind, what it holds) of evaluation data: pairs, scored pairs or a retrieval set (eval_file_kind)."""
    kind = eval_file_kind(path)
    if kind is None:
        raise ValueError(f"{path}: not pairs, scored pairs nor a retrieval set")
    if kind == PAIRS:
        return kind, load_pairs(path)
    return kind, load_scored_pairs(path) if kind == SCORED_PAIRS else load_retrieval(path)


def _load_eval(path: Path, kind: str) -> list[Pair] | list[ScoredPair] | RetrievalSet:
    """An evaluation file for training rows of `kind`: the same kind, or (pairs) a retrieval set."""
    if eval_file_kind(path) not in ((PAIRS, RETRIEVAL) if kind == PAIRS else (SCORED_PAIRS,)):
        words = "pairs or a retrieval set" if kind == PAIRS else "scored pairs"
        raise ValueError(f"{path}: the model trains on {kind}, so its evaluation data must be {words}")
    return read_eval_file(path)[1]


def _hold_out(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """(held out, kept): pairs by whole anchors, scored pairs row by row (split_holdout's seeded draw)."""
    groups = [r.anchor for r in rows] if isinstance(rows[0], Pair) else None
    kept, held = split_holdout(len(rows), fraction, seed, groups)
    return [rows[i] for i in held], [rows[i] for i in kept]


def retrieval_set(pairs: Sequence[Pair]) -> RetrievalSet:
    """Pairs as a retrieval set, as InformationRetrievalEvaluator is built from them: each distinct anchor a
    query, every distinct positive and negative a document, an anchor's positives its relevant documents."""
    qids: dict[str, str] = {}  # text -> query id
    dids: dict[str, str] = {}  # text -> document id
    relevant: dict[str, set[str]] = {}
    for pair in pairs:
        for text in (pair.positive, *pair.negatives):
            dids.setdefault(text, f"d{len(dids):08d}")
        qid = qids.setdefault(pair.anchor, f"q{len(qids):08d}")
        relevant.setdefault(qid, set()).add(dids[pair.positive])
    return RetrievalSet({q: t for t, q in qids.items()}, {d: t for t, d in dids.items()}, relevant)


# ---------------------------------------------------------------------------- batches


class ColumnBatches:
    """Rows of C texts (and optional scores) in batches of (B, C, T) tensors; see the module docstring.
    `no_duplicates`: NoDuplicatesBatchSampler's batches, else shuffled rows in order (`shuffle=False`: as given)."""

    def __init__(
        self,
        rows: Sequence[Sequence[str]],
        tokenizer,
        *,
        batch_size: int,
        max_seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        no_duplicates: bool = False,
        scores: Sequence[float] | None = None,
    ):
        if not rows:
            raise ValueError("no pairs to batch")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size, self.seed, self.shuffle, self.no_duplicates = batch_size, int(seed), shuffle, no_duplicates
        self.pad_id = tokenizer.pad_token_id
        index: dict[str, int] = {}
        self.rows = np.array([[index.setdefault(t, len(index)) for t in row] for row in rows], dtype=np.int64)  # (N, C)
        self.ids = tokenize(tokenizer, list(index), max_seq_len)  # per distinct text
        self.scores = None if scores is None else torch.tensor(list(scores), dtype=torch.float32)
        self._plan: tuple[int, list[np.ndarray]] | None = None

    @property
    def num_columns(self) -> int:
        return self.rows.shape[1]

    def num_batches(self, epoch: int) -> int:
        return len(self.plan(epoch))

    def iter_batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches `start_batch`, `start_batch + 1`, ... of `epoch`; the same every time they are asked for."""
        for rows in self.plan(epoch)[start_batch:]:
            yield self.collate(rows)

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The row indices of each batch of `epoch`, worked out once per epoch from (seed, epoch)."""
        if self._plan is None or self._plan[0] != epoch:
            n = len(self.rows)
            order = shuffled(n, self.seed, epoch) if self.shuffle else np.arange(n)
            if self.no_duplicates:
                batches = no_duplicate_batches(order, self.rows, self.batch_size)
            else:
                batches = [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
            self._plan = (epoch, batches)
        return self._plan[1]

    def collate(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """input_ids, token_type_ids and attention_mask (B, C, T) of `rows`, padded to their longest text;
        `scores` (B,) for scored pairs."""
        texts = self.rows[rows]  # (B, C) text indices
        flat = [self.ids[t] for t in texts.reshape(-1)]  # row by row, column by column
        ids = pad(flat, self.pad_id).view(len(rows), self.num_columns, -1)  # (B * C, T) -> (B, C, T)
        mask = pad([[1] * len(r) for r in flat], 0).view_as(ids)
        batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}
        if self.scores is not None:
            batch["scores"] = self.scores[torch.as_tensor(rows)]
        return batch


class PairBatches(ColumnBatches):
    """(anchor, positive, negative_1..n) columns, no text twice in a batch."""

    def __init__(self, pairs: Sequence[Pair], tokenizer, *, batch_size: int, max_seq_len: int, seed: int = 0, **kw):
        rows = [(p.anchor, p.positive, *p.negatives) for p in pairs]
        super().__init__(
            rows, tokenizer, batch_size=batch_size, max_seq_len=max_seq_len, seed=seed, no_duplicates=True, **kw
        )


class ScoredPairBatches(ColumnBatches):
    """(sentence1, sentence2) columns and their `scores`."""

    def __init__(
        self, pairs: Sequence[ScoredPair], tokenizer, *, batch_size: int, max_seq_len: int, seed: int = 0, **kw
    ):
        rows = [(p.sentence1, p.sentence2) for p in pairs]
        scores = [p.score for p in pairs]
        super().__init__(
            rows, tokenizer, batch_size=batch_size, max_seq_len=max_seq_len, seed=seed, scores=scores, **kw
        )


def shuffled(n: int, seed: int, epoch: int) -> np.ndarray:
    """The rows' order in `epoch`: sentence-transformers' samplers' draw, torch.randperm seeded with seed + epoch
    (so the same seed batches as its trainer does)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy()


def no_duplicate_batches(order: np.ndarray, rows: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """NoDuplicatesBatchSampler's one pass: rows taken in `order`, each into the current batch unless one of its
    texts (`rows[i]`, text indices) is already there, in which case it waits, keeping its place, for the next
    batch; a batch ends when full or when no waiting row fits. Every row lands in exactly one batch."""
    following = np.append(np.arange(1, len(order)), -1)  # a linked list over `order`'s positions
    head, batches = 0, []
    while head != -1:
        batch: list[int] = []
        seen: set[int] = set()
        position, previous = head, -1
        while position != -1 and len(batch) < batch_size:
            after, row = int(following[position]), int(order[position])
            texts = set(rows[row].tolist())
            if seen.isdisjoint(texts):
                batch.append(row)
                seen |= texts
                if previous == -1:
                    head = after
                else:
                    following[previous] = after
            else:
                previous = position
            position = after
        batches.append(np.array(batch, dtype=np.int64))
    return batches


def tokenize(tokenizer, texts: list[str], max_seq_len: int) -> list[list[int]]:
    """Each text's ids, [CLS] text [SEP] cut to `max_seq_len`, as a SentenceTransformer's Transformer module
    tokenises one column."""
    ids: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = texts[start : start + TOKENIZE_CHUNK]
        ids += tokenizer(chunk, max_length=max_seq_len, truncation=True, padding=False, return_tensors=None)[
            "input_ids"
        ]
    return ids
