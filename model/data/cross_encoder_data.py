"""Cross-encoder (reranker) data: (query, document) pairs from a pairs, scored-pairs or labelled file, the
held-out split, and batches for sentence-transformers 6's CrossEncoder losses.

    data = load_cross_encoder_data("pairs.csv", loss=None, eval_fraction=0.1, seed=0)
    train = CrossEncoderBatches(data.train, tokenizer, loss=data.loss, draw_negatives=sample_in_batch_negatives)

Files, in sentence-transformers' columns (model/data/pairs.py, model/data/finetune.py read them):

    pairs          anchor, positive[, negative | negative_1 .. negative_n]
    scored-pairs   sentence1, sentence2, score in 0..1
    labelled       text, text_pair, label: 0 or 1, or a number in 0..1

A file's kind is told by its header, as an upload's is: anchor and positive make pairs; sentence1,
sentence2 and score scored pairs; anything else is read as labelled.

Losses (model/training/losses.py):

    bce    every (first, second) pair with its label or score. A pairs row gives 1 + n pairs: (anchor,
           positive) labelled 1 and (anchor, negative_i) labelled 0, so `batch_size` counts pairs. A batch:
           input_ids, token_type_ids, attention_mask (B, T) and float labels (B,).
    mnrl   pairs only. A row is an anchor and its C = 1 + k + n candidates: its positive, k = num_negatives
           other rows' candidates drawn for it (model.training.losses.sample_in_batch_negatives, passed in
           as `draw_negatives`) and its n hard negatives, in that order, as
           CrossEncoderMultipleNegativesRankingLoss lays them out (the positive in column 0); `batch_size`
           counts anchors. A batch: input_ids, token_type_ids, attention_mask (B, C, T), each candidate
           tokenised as the pair (anchor, candidate). The draw's generator is seeded by (seed, epoch,
           batch index), so a batch is the same whenever it is made and a resumed run trains on the very
           candidates an unbroken one would.

The held-out rows are `eval_fraction` of the file's (model.data.finetune.split_holdout), or a second file.
Pairs are held out by anchor, so no query of the evaluation was trained on; the held-out pairs stay rows
(queries, their positives and negatives) for the reranking metrics.

Reference: sentence-transformers 6.x, cross_encoder/losses/BinaryCrossEntropyLoss.py and
MultipleNegativesRankingLoss.py; its docs' "Loss Overview" (the columns each loss takes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from model.data.batches import RowBatches
from model.data.finetune import load_classification_data, read_table, split_holdout
from model.data.pairs import Pair, load_pairs, load_scored_pairs

KINDS = ("pairs", "scored-pairs", "labelled")
LOSSES = ("bce", "mnrl")
DEFAULT_LOSS = {"pairs": "mnrl", "scored-pairs": "bce", "labelled": "bce"}

# (batch size, candidate columns, negatives to draw, generator) -> (B, k) indices into the candidates
# flattened column after column: model.training.losses.sample_in_batch_negatives
DrawNegatives = Callable[[int, int, int, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class LabelledPair:
    """A (first, second) pair and its label: 0 or 1, or a score in 0..1."""

    first: str
    second: str
    label: float


@dataclass
class CrossEncoderData:
    """A file's pairs for one loss: train rows (Pair for mnrl, LabelledPair for bce) and held-out rows
    (Pair for a pairs file, whatever the loss: they are scored by reranking; else LabelledPair)."""

    kind: str  # pairs, scored-pairs or labelled
    loss: str  # bce or mnrl
    train: list
    eval: list
    negatives: int = 0  # hard negatives in each pairs row


def file_kind(path: str | os.PathLike) -> str:
    """pairs, scored-pairs or labelled, by the file's columns (the upload's rule)."""
    rows = read_table(path)
    columns = set().union(*(row.keys() for _, row in rows[:1000]))
    if {"anchor", "positive"} <= columns:
        return "pairs"
    if {"sentence1", "sentence2", "score"} <= columns:
        return "scored-pairs"
    return "labelled"


def load_cross_encoder_data(
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike | None = None,
    *,
    loss: str | None = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
) -> CrossEncoderData:
    """Read a pairs, scored-pairs or labelled file for `loss` (None: mnrl for pairs, else bce) and hold out
    `eval_fraction` of it (whole anchors of pairs), or read `eval_path`, a file of the same kind."""
    kind = file_kind(train_path)
    loss = DEFAULT_LOSS[kind] if loss is None else loss
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if loss == "mnrl" and kind != "pairs":
        raise ValueError(
            f"{train_path} holds {kind}; loss mnrl ranks each anchor's positive above its negatives, so it "
            "trains on pairs (anchor, positive[, negative ...]): use loss bce"
        )
    if kind == "labelled":
        train, held = _labelled(train_path, eval_path, eval_fraction, seed)
        return CrossEncoderData(kind, loss, train, held)
    read: Callable[[str | os.PathLike], list[Any]] = load_pairs if kind == "pairs" else _scored
    rows = read(train_path)
    if eval_path is not None:
        if file_kind(eval_path) != kind:
            raise ValueError(f"{eval_path} is not a {kind} file as {train_path} is")
        held = read(eval_path)
    else:
        groups = [r.anchor for r in rows] if kind == "pairs" else None
        train_idx, eval_idx = split_holdout(len(rows), eval_fraction, seed, groups)
        rows, held = [rows[i] for i in train_idx], [rows[i] for i in eval_idx]
    if kind != "pairs":
        return CrossEncoderData(kind, loss, rows, held)
    negatives = len(rows[0].negatives)
    if loss == "bce" and not negatives:
        raise ValueError(
            f"{train_path} has no negatives (negative or negative_1 .. negative_n): with loss bce every pair "
            "would be a positive; add hard negatives, or use loss mnrl (its negatives come from the batch)"
        )
    train = [p for row in rows for p in as_labelled(row)] if loss == "bce" else rows
    return CrossEncoderData(kind, loss, train, held, negatives)


def as_labelled(row: Pair) -> list[LabelledPair]:
    """A pairs row as bce reads it: (anchor, positive) labelled 1, (anchor, negative_i) labelled 0."""
    return [LabelledPair(row.anchor, row.positive, 1.0), *(LabelledPair(row.anchor, n, 0.0) for n in row.negatives)]


def _scored(path: str | os.PathLike) -> list[LabelledPair]:
    return [LabelledPair(p.sentence1, p.sentence2, p.score) for p in load_scored_pairs(path)]


def _labelled(train_path, eval_path, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) LabelledPairs of a labelled file (text, text_pair, label in 0..1)."""
    table = load_classification_data(
        train_path, eval_path, regression=True, eval_fraction=eval_fraction, seed=seed
    )  # float labels, held out as a classifier's rows are
    if not table.is_pair:
        raise ValueError(f"{train_path} has no text_pair column: a cross-encoder scores (text, text_pair) pairs")
    out = []
    for examples in (table.train, table.eval):
        for e in examples:
            if not 0.0 <= float(e.label) <= 1.0:
                raise ValueError(
                    f"{train_path}: label {e.label!r} of ({e.text!r}, {e.text_pair!r}) is not 0, 1 or a score "
                    "in 0..1, which a cross-encoder's sigmoid can reach"
                )
        assert all(e.text_pair is not None for e in examples)  # is_pair: every row has its text_pair
        out.append([LabelledPair(e.text, str(e.text_pair), float(e.label)) for e in examples])
    return out[0], out[1]


# ---------------------------------------------------------------------------- batches


def batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator that draws batch `index` of `epoch`'s in-batch negatives: a function of the three."""
    state = np.random.SeedSequence([seed, epoch, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class CrossEncoderBatches(RowBatches):
    """Shuffled-per-epoch batches of LabelledPairs (bce) or of Pair rows with their candidates (mnrl); see
    the module docstring for the tensors."""

    def __init__(
        self,
        rows: list,
        tokenizer,
        *,
        loss: str,
        batch_size: int = 32,
        max_seq_len: int = 128,
        seed: int = 0,
        shuffle: bool = True,
        num_negatives: int = 4,
        draw_negatives: DrawNegatives | None = None,
    ):
        super().__init__(rows, batch_size, seed, shuffle)
        if loss == "mnrl" and draw_negatives is None:
            raise ValueError("mnrl batches need draw_negatives (model.training.losses.sample_in_batch_negatives)")
        self.tokenizer, self.max_seq_len, self.loss = tokenizer, max_seq_len, loss
        self.num_negatives, self.draw_negatives = num_negatives, draw_negatives

    def _iter_from(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        n = self.num_examples(epoch)
        for lo in range(start, n, self.batch_size):
            rows = [self.example(epoch, i) for i in range(lo, min(lo + self.batch_size, n))]
            yield self.collate_batch(rows, epoch, lo // self.batch_size)

    def collate_batch(self, rows: list, epoch: int, index: int) -> dict[str, torch.Tensor]:
        """Batch `index` of `epoch` from its rows (its in-batch negatives drawn for that position)."""
        if self.loss == "bce":
            batch = self._pairs([r.first for r in rows], [r.second for r in rows])
            batch["labels"] = torch.tensor([r.label for r in rows], dtype=torch.float)
            return batch
        candidates = self.candidates(rows, batch_generator(self.seed, epoch, index))
        width = len(candidates[0])
        batch = self._pairs([r.anchor for r in rows for _ in range(width)], [c for row in candidates for c in row])
        return {k: v.view(len(rows), width, -1) for k, v in batch.items()}  # (B * C, T) -> (B, C, T)

    def candidates(self, rows: list[Pair], generator: torch.Generator) -> list[list[str]]:
        """Each row's candidate documents: its positive, the in-batch negatives drawn for it, its own negatives."""
        columns = [[r.positive for r in rows]] + [[r.negatives[j] for r in rows] for j in range(len(rows[0].negatives))]
        flat = [text for column in columns for text in column]  # column c's row i is c * B + i
        assert self.draw_negatives is not None  # __init__ refuses mnrl without it
        drawn = self.draw_negatives(len(rows), len(columns), self.num_negatives, generator).tolist()  # (B, k)
        return [[r.positive, *(flat[j] for j in drawn[i]), *r.negatives] for i, r in enumerate(rows)]

    def _pairs(self, firsts: list[str], seconds: list[str]) -> dict[str, torch.Tensor]:
        return self.tokenizer(firsts, seconds, max_length=self.max_seq_len, truncation=True, padding=True)
