"""Resumable batch streams: the position in the data is (epoch, example), and every batch is a pure function
of (seed, epoch, example indices), so a trainer that stores `state_dict()` in its checkpoint resumes exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class ResumableBatches:
    """Base for a dataset that yields batches epoch by epoch and can restart at any batch.

    Subclasses define `num_examples(epoch)`, `example(epoch, index)` and `collate(examples)`; the
    order of examples within an epoch is already decided by `example` (shuffled per epoch there).

    Two ways to drive it:
      * stateless: `for batch in data.iter_batches(epoch, start_batch)`;
      * stateful: `for batch in data` runs the rest of the current epoch and then moves to the next;
        `state_dict()` says where the next batch starts, `load_state_dict()` goes back there.
    """

    def __init__(self, batch_size: int, seed: int, drop_last: bool):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size, self.seed, self.drop_last = batch_size, int(seed), bool(drop_last)
        self.epoch, self.position = 0, 0  # next example to hand out

    # -- to implement
    def num_examples(self, epoch: int) -> int:
        raise NotImplementedError

    def example(self, epoch: int, index: int) -> Any:  # whatever the subclass's collate takes a list of
        raise NotImplementedError

    def collate(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # -- derived
    def num_batches(self, epoch: int) -> int:
        n = self.num_examples(epoch)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def iter_batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches `start_batch`, `start_batch + 1`, ... of `epoch`; the same every time they are asked for."""
        yield from self._iter_from(epoch, start_batch * self.batch_size)

    def _iter_from(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        n = self.num_examples(epoch)
        stop = (n // self.batch_size) * self.batch_size if self.drop_last else n
        for lo in range(start, stop, self.batch_size):
            hi = min(lo + self.batch_size, n)
            yield self.collate([self.example(epoch, i) for i in range(lo, hi)])

    def epoch_dataset(self, epoch: int) -> Dataset:
        """Map-style view of one epoch, for a DataLoader with workers (keep shuffle=False; order is built in)."""
        self.num_examples(epoch)  # work out the epoch here, once, before workers fork
        return _EpochView(self, epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The rest of the current epoch; `state_dict()` taken after a batch points just past it."""
        epoch = self.epoch
        for batch in self._iter_from(epoch, self.position):
            self.position += len(next(iter(batch.values())))
            yield batch
        self.epoch, self.position = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "example": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"data state was saved with seed {state['seed']}, this dataset has seed {self.seed}")
        epoch, position = int(state["epoch"]), int(state["example"])
        if epoch < 0 or position < 0:
            raise ValueError(f"bad data state: epoch {epoch}, example {position}")
        self.epoch, self.position = epoch, position


class _EpochView(Dataset):
    def __init__(self, data: ResumableBatches, epoch: int):
        self.data, self.epoch = data, epoch

    def __len__(self) -> int:
        return self.data.num_examples(self.epoch)

    def __getitem__(self, index: int) -> dict:
        return self.data.example(self.epoch, index)


class RowBatches(ResumableBatches):
    """Batches of encoded rows (lists of ids), shuffled per epoch by (seed, epoch) unless `shuffle=False`;
    `collate` pads them (see `pad`). Token classification and QA windows batch this way."""

    def __init__(self, rows: list, batch_size: int, seed: int, shuffle: bool, drop_last: bool = False):
        super().__init__(batch_size, seed, drop_last)
        if not rows:
            raise ValueError("no examples to batch")
        self.rows, self.shuffle = rows, shuffle
        self._order: tuple[int, np.ndarray] | None = None

    def num_examples(self, epoch: int) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            n = len(self.rows)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (epoch, order)
        return self._order[1]

    def example(self, epoch: int, index: int):
        return self.rows[self._epoch_order(epoch)[index]]


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    """(B, T) long tensor of `rows` padded with `value` to the longest."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def padded_inputs(input_ids: list[list[int]], token_type_ids: list[list[int]] | None, pad_id: int) -> dict:
    """input_ids, token_type_ids and attention_mask (B, T) of unpadded rows."""
    ids = pad(input_ids, pad_id)
    types = pad(token_type_ids, 0) if token_type_ids is not None else torch.zeros_like(ids)
    mask = pad([[1] * len(r) for r in input_ids], 0)
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
