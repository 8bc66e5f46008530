"""The batching engine: one inference thread per device, fed by a bounded queue of work items.

A work item is one request's tokenised inputs for one model and one task ("encode", "mlm", "nsp",
"classify"). The inference thread takes the oldest item; with batching on it waits up to
`max_wait_ms` for more work while other requests are still being tokenised (a lone request is
never held), then takes every queued item for the same model and task up to the token budget,
sorts their sequences by length, cuts them into batches whose padded size (rows x longest) stays
under `max_batch_tokens`, pads each batch to its own longest row, and runs the task's forward pass
under torch.inference_mode, in the precision the model's weights were converted to when it was
loaded (app/store.py, model.precision.apply_precision): the engine casts nothing itself. Results go
back through concurrent futures that the event loop awaits with asyncio.wrap_future; no forward
pass ever runs on the event loop.

Batching off: each item runs alone, at once (the benchmark's baseline).
References: text-embeddings-inference's queue/batching (token-budget batches); NVIDIA Triton's
dynamic batcher (max queue delay).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import ServiceError

log = logging.getLogger("bertserve.engine")


@dataclass
class WorkItem:
    """One request's work: `rows` are (input_ids, token_type_ids) pairs, `params` task options."""

    task: str  # a key of the engine's runners: "encode", "mlm", "nsp" or "classify"
    model: Any  # app.store.LoadedModel
    rows: list[tuple[list[int], list[int]]]
    params: dict = field(default_factory=dict)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.monotonic)
    wait: bool = True  # may wait up to max_wait_ms for company (warm-ups do not)
    results: list = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)
        self.remaining = len(self.rows)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.rows)

    @property
    def key(self) -> tuple:
        return (id(self.model), self.task)


@dataclass
class Batch:
    """Padded tensors for one forward pass; `origin[i]` = (work item, row index) of tensor row i."""

    input_ids: torch.Tensor  # (B, T)
    token_type_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    origin: list[tuple[WorkItem, int]]
    tokens: int  # real (unpadded) tokens

    @property
    def params(self) -> list[dict]:
        return [item.params for item, _ in self.origin]

    @property
    def model_mask(self) -> torch.Tensor | None:
        """The attention mask to give the model: None when no row is padded, which lets it skip
        the mask (SDPA's fastest path) without first asking the device whether it is all ones."""
        return None if self.tokens == self.input_ids.numel() else self.attention_mask


# task -> runner(model, batch) -> one result per batch row (see app/inference.py)
Runner = Callable[[Any, Batch], list]


def plan_batches(rows: list[tuple[WorkItem, int, int]], max_tokens: int) -> list[list[tuple[WorkItem, int, int]]]:
    """Cut (work item, row, length) triples, sorted by length, into batches with rows x longest <= max_tokens.

    A single row longer than the budget still runs, alone.
    """
    batches, current = [], []
    for item in sorted(rows, key=lambda r: r[2]):
        # sorted ascending, so the newest row is the longest of the batch it joins
        if current and (len(current) + 1) * item[2] > max_tokens:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches


class Engine:
    def __init__(self, device: torch.device, runners: dict[str, Runner], *, max_batch_tokens: int,
                 max_queue: int, max_wait_ms: float, batching: bool, metrics=None):
        self.device = device
        self.runners = runners
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.max_wait = max_wait_ms / 1000.0
        self.batching = batching
        self.metrics = metrics
        self._pending: deque[WorkItem] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self._incoming = 0  # requests on their way to the queue (being tokenised)

    # -- the event loop's side ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"inference-{self.device}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the queued work, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, item: WorkItem) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping:
                raise ServiceError("unavailable", "the service is shutting down")
            if len(self._pending) >= self.max_queue:
                raise ServiceError("overloaded", f"the inference queue is full ({self.max_queue} requests "
                                                 "waiting); retry later")
            self._pending.append(item)
            self._set_depth()
            self._cond.notify()
        return item.future

    @contextlib.contextmanager
    def incoming(self):
        """Mark a request as on its way (tokenising): the batcher waits for it, and only for such."""
        with self._cond:
            self._incoming += 1
        try:
            yield
        finally:
            with self._cond:
                self._incoming -= 1
                self._cond.notify()

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return self._busy

    # -- the inference thread ----------------------------------------------------------------

    def _main(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            items = self._take()
            if items is None:
                return
            self._busy = True
            try:
                self._run(items)
            finally:
                self._busy = False

    def _take(self) -> list[WorkItem] | None:
        """Block until there is work; return the items of the next forward passes (None: stop)."""
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    return None
                if self.batching and self._pending[0].wait:
                    self._wait_for_more()
                items = self._pick()
                self._set_depth()
                # Items whose request went away (client disconnected) are dropped here, unrun.
                items = [i for i in items if i.future.set_running_or_notify_cancel()]
                if items:
                    return items

    def _wait_for_more(self) -> None:
        """Hold the oldest item up to max_wait for company, but only while more requests are coming:
        a lone client is never delayed."""
        deadline = self._pending[0].enqueued + self.max_wait
        while not self._stopping and self._incoming > 0:
            left = deadline - time.monotonic()
            if left <= 0 or sum(i.tokens for i in self._pending) >= self.max_batch_tokens:
                return
            self._cond.wait(left)

    def _pick(self) -> list[WorkItem]:
        first = self._pending.popleft()
        if not self.batching:
            return [first]
        items, tokens, kept = [first], first.tokens, deque()
        while self._pending:
            item = self._pending.popleft()
            if item.key == first.key and tokens + item.tokens <= self.max_batch_tokens:
                items.append(item)
                tokens += item.tokens
            else:
                kept.append(item)
        self._pending = kept
        return items

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))

    def _run(self, items: list[WorkItem]) -> None:
        rows = [(item, i, len(ids)) for item in items for i, (ids, _) in enumerate(item.rows)]
        for planned in plan_batches(rows, self.max_batch_tokens):
            batch = self._pad(planned)
            try:
                results = self._forward(items[0], batch)
            except Exception as e:  # one bad batch fails its requests, not the thread
                log.exception("forward pass failed")
                for item, _ in batch.origin:
                    _settle(item.future, exc=e)
                continue
            for (item, i), result in zip(batch.origin, results):
                item.results[i] = result
                item.remaining -= 1
                if item.remaining == 0:
                    _settle(item.future, result=item.results)

    def _pad(self, planned: list[tuple[WorkItem, int, int]]) -> Batch:
        pad_id = planned[0][0].model.pad_token_id
        longest = max(n for _, _, n in planned)
        ids = torch.full((len(planned), longest), pad_id, dtype=torch.long)
        types = torch.zeros((len(planned), longest), dtype=torch.long)
        mask = torch.zeros((len(planned), longest), dtype=torch.long)
        for r, (item, i, n) in enumerate(planned):
            row_ids, row_types = item.rows[i]
            ids[r, :n] = torch.tensor(row_ids)
            types[r, :n] = torch.tensor(row_types)
            mask[r, :n] = 1
        return Batch(ids, types, mask, [(item, i) for item, i, _ in planned], sum(n for _, _, n in planned))

    def _forward(self, first: WorkItem, batch: Batch) -> list:
        if self.metrics is not None:
            self.metrics.observe_batch(first.model.name, first.task, batch)
        batch.input_ids = batch.input_ids.to(self.device, non_blocking=True)
        batch.token_type_ids = batch.token_type_ids.to(self.device, non_blocking=True)
        batch.attention_mask = batch.attention_mask.to(self.device, non_blocking=True)
        start = time.perf_counter()
        with torch.inference_mode():
            results = self.runners[first.task](first.model, batch)
        if self.metrics is not None:
            self.metrics.forward_seconds.labels(first.model.name, first.task).observe(time.perf_counter() - start)
        return results


def _settle(future: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
