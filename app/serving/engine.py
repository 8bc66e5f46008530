"""The batching engine: one inference thread per device, fed by a bounded queue of work items.

A work item is one request's tokenised inputs for one model and one task ("encode", "mlm", "nsp",
"classify", "token_classify", "qa", "sparse_encode", "token_encode", "late_interaction"). The inference thread runs one forward pass at a time and chooses each pass afresh:
it starts from the oldest queued item that has not run yet, else from the item whose last pass
is the longest ago; a batch job's items (`background`) only when no online item waits, in passes of their
own. While online requests come (one in the last ONLINE_RECENT_S), a batch job's pass holds at most
`background_pass_tokens`, so an online request that arrives meanwhile waits behind a short pass, not a full
one, and its own pass carries no batch rows; with no online traffic, batches fill whole passes. So a new request waits for the pass under way and for the first pass of each
request queued before it that has not started, never for the rest of a large one; requests that
have started take turns, one pass each (round robin), so none is starved. With batching on it
first lets a new item wait up to `max_wait_ms` for company while other requests are still being
tokenised (a lone request is never held), then fills the pass with rows of queued
items for the same model and task in the same order, each item's rows shortest first, while
the padded size (rows x longest) stays within `max_batch_tokens`; a row longer than that runs
alone. Large requests progress in a small one's pass too.
An item leaves the queue when its last row is in a pass. The pass runs the task's forward pass
under torch.inference_mode, in the precision
the model's weights were converted to when it was loaded (app/serving/model_registry.py,
model.compute.precision.apply_precision): the engine casts nothing itself. Results go back through
concurrent futures that the event loop awaits with asyncio.wrap_future; no forward pass ever runs
on the event loop.

A request that goes away (its client disconnected, or its deadline passed: app/api/middleware.py)
cancels its item: still queued, it never runs; part-way through, its remaining rows are dropped
before the next pass.

Batching off: each pass holds rows of one item only (the benchmark's baseline).
References: text-embeddings-inference's queue/batching (token-budget batches); NVIDIA Triton's
dynamic batcher (max queue delay); for the order, new work first then round robin, as the
"foreground-background" schedulers of operating systems.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.errors import ServiceError
from worker.telemetry import tracing

log = logging.getLogger("bertserve.engine")


@dataclass
class WorkItem:
    """One request's work: `rows` are (input_ids, token_type_ids) pairs, `params` task options."""

    task: str  # a key of the engine's runners: "encode", "mlm", "nsp", "classify", "token_classify", "qa", ... (forward.py)
    lm: Any  # the app.serving.stored_models.LoadedModel it runs on (not imported: the engine knows no registry)
    rows: list[tuple[list[int], list[int]]]
    params: dict = field(default_factory=dict)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.monotonic)
    wait: bool = True  # may wait up to max_wait_ms for company (warm-ups do not)
    background: bool = False  # a batch job's rows (a lane's pass): every online item goes before it
    cancelled: bool = False  # the request went away: run no more of it (set by the event loop)
    claimed: bool = False  # in a pass already: its future is running and can no longer be cancelled
    results: list = field(init=False)
    remaining: int = field(init=False)  # rows without a result yet
    todo: list[int] = field(init=False)  # row indices not yet in a pass, shortest first
    last_pass: float = 0.0  # when a pass last took rows of this item (0: none yet): the scheduler's order
    trace: Any = field(default_factory=tracing.current)  # its request's span context (None: tracing off)
    traced_wait: bool = False  # its `queue` span was sent (tracing on: its first pass)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)
        self.remaining = len(self.rows)
        self.todo = sorted(range(len(self.rows)), key=lambda i: len(self.rows[i][0]))

    @property
    def tokens_left(self) -> int:
        return sum(len(self.rows[i][0]) for i in self.todo)

    @property
    def key(self) -> tuple:
        return (id(self.lm), self.task)

    def claim(self) -> bool:
        """Mark the future running as the item joins its first pass; False if the request went away."""
        if not self.claimed and not self.future.done():
            self.claimed = self.future.set_running_or_notify_cancel()
        return self.claimed and not self.cancelled

    def cancel(self) -> None:
        """From the event loop: drop this item's work, queued or part-way (thread-safe)."""
        self.cancelled = True
        self.future.cancel()  # succeeds only while no row has run


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

    host_mask: torch.Tensor | None = None  # attention_mask as built, on the CPU, once it has moved
    host_ids: torch.Tensor | None = None  # input_ids as built, on the CPU: runners read them there (no sync)

    @property
    def ids_on_host(self) -> torch.Tensor:
        return self.host_ids if self.host_ids is not None else self.input_ids

    @property
    def model_mask(self) -> torch.Tensor | None:
        """The attention mask to give the model: None when no row is padded, which lets it skip
        the mask (SDPA's fastest path) without first asking the device whether it is all ones; else
        the host copy, from which the model reads where sequences start without a device sync."""
        if self.tokens == self.input_ids.numel():
            return None
        return self.host_mask if self.host_mask is not None else self.attention_mask

    @property
    def lengths(self) -> list[int]:
        """Real tokens per row, from the host copy of the mask (no device sync)."""
        mask = self.host_mask if self.host_mask is not None else self.attention_mask
        return mask.sum(1).tolist()


# task -> runner(model, batch) -> one result per batch row (see app/serving/forward.py)
Runner = Callable[[Any, Batch], list]


def plan_batch(items: list[WorkItem], max_tokens: int) -> list[tuple[WorkItem, int, int]]:
    """Take one pass's rows, as (work item, row, length), from `items` in order, each item's shortest
    first, while rows x longest <= max_tokens; the taken rows leave the items' `todo`.

    The first row is always taken, so a row longer than the budget runs alone.
    """
    planned: list[tuple[WorkItem, int, int]] = []
    longest = 0
    for item in items:
        while item.todo:
            n = len(item.rows[item.todo[0]][0])
            if planned and (len(planned) + 1) * max(longest, n) > max_tokens:
                break  # the item's next rows are longer still; a later item's may fit
            planned.append((item, item.todo.pop(0), n))
            longest = max(longest, n)
    return planned


class Engine:
    ONLINE_RECENT_S = 1.0  # an online item this recent keeps batch jobs' passes at background_pass_tokens

    def __init__(
        self,
        device: torch.device,
        runners: dict[str, Runner],
        *,
        max_batch_tokens: int,
        max_queue: int,
        max_wait_ms: float,
        batching: bool,
        background_pass_tokens: int | None = None,
        metrics=None,
    ):
        self.device = device
        self.runners = runners
        self.max_batch_tokens = max_batch_tokens
        # a batch job's pass while online requests come (None: max_batch_tokens, as any pass)
        self.background_pass_tokens = min(background_pass_tokens or max_batch_tokens, max_batch_tokens)
        self._online_at = -float("inf")  # when the last online item was queued (time.monotonic)
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
                raise ServiceError(
                    "overloaded", f"the inference queue is full ({self.max_queue} requests waiting); retry later"
                )
            self._pending.append(item)
            if not item.background:
                self._online_at = item.enqueued
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
            planned = self._take()
            if planned is None:
                return
            self._busy = True
            try:
                self._run(planned)
            finally:
                self._busy = False

    def _take(self) -> list[tuple[WorkItem, int, int]] | None:
        """Block until there is work; return the rows of the next forward pass (None: stop)."""
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:
                    return None
                first = self._first()
                if first is None:
                    continue
                if self.batching and first.wait and not first.claimed:
                    self._wait_for_more(first)
                    first = self._first()  # the wait may have seen it cancelled
                    if first is None:
                        continue
                now = time.monotonic()
                online_recent = now - self._online_at < self.ONLINE_RECENT_S
                budget = self.background_pass_tokens if first.background and online_recent else self.max_batch_tokens
                planned = plan_batch(self._companions(first), budget)
                for item, _, _ in planned:
                    if not item.last_pass and self.metrics is not None:  # its first pass: it waited until now
                        self.metrics.queue_wait.labels(item.lm.name, item.task).observe(now - item.enqueued)
                    item.last_pass = now
                self._pending = deque(i for i in self._pending if i.todo)
                self._set_depth()
                return planned

    def _first(self) -> WorkItem | None:
        """Drop the items whose request went away; of the rest, the oldest that has not run yet, else
        the one whose last pass is the longest ago."""
        self._drop_gone()
        return min(self._pending, key=_priority, default=None)

    def _drop_gone(self) -> None:
        gone = [i for i in self._pending if i.cancelled or i.future.done()]  # done: cancelled or failed
        if gone:
            self._pending = deque(i for i in self._pending if not (i.cancelled or i.future.done()))
            for item in gone:
                _settle(item.future, exc=concurrent.futures.CancelledError())
            self._set_depth()

    def _companions(self, first: WorkItem) -> list[WorkItem]:
        """`first`, then (batching on) the other items of its model and task, in the same order (an online
        item's pass takes online items only: a batch job's rows would make it longer); each marked running as
        it joins (a cancelled one is left out, and dropped next time)."""
        items = [first]
        if self.batching:
            others = [
                i
                for i in self._pending
                if i is not first and i.key == first.key and (first.background or not i.background)
            ]
            items += sorted(others, key=_priority)
        return [i for i in items if i.claim()]

    def _wait_for_more(self, first: WorkItem) -> None:
        """Hold a new item up to max_wait for company, but only while more requests are coming:
        a lone client is never delayed."""
        deadline = first.enqueued + self.max_wait
        while not self._stopping and self._incoming > 0:
            left = deadline - time.monotonic()
            if left <= 0 or sum(i.tokens_left for i in self._pending) >= self.max_batch_tokens:
                return
            self._cond.wait(left)

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))

    def _run(self, planned: list[tuple[WorkItem, int, int]]) -> None:
        if not planned:
            return
        batch = self._pad(planned)
        span = _traced_pass(planned[0][0], batch) if tracing.enabled() else None
        try:
            results = self._forward(planned[0][0], batch)
        except Exception as e:  # one bad batch fails its requests, not the thread
            log.exception("forward pass failed")
            tracing.fail(span, f"{type(e).__name__}: {e}")
            for item, _ in batch.origin:
                _settle(item.future, exc=e)
            return
        finally:
            if span is not None:
                span.end()
        for (item, i), result in zip(batch.origin, results):
            item.results[i] = result
            item.remaining -= 1
            if item.remaining == 0:
                _settle(item.future, result=item.results)

    def _pad(self, planned: list[tuple[WorkItem, int, int]]) -> Batch:
        """The rows padded into three tensors, each built once from Python lists; on a GPU straight into pinned
        memory (torch caches pinned blocks), so the copies to the device are asynchronous."""
        pad_id = planned[0][0].lm.pad_token_id
        longest = max(n for _, _, n in planned)
        ids, types, mask = [], [], []
        for item, i, n in planned:
            row_ids, row_types = item.rows[i]
            ids.append([*row_ids, *[pad_id] * (longest - n)])
            types.append([*row_types, *[0] * (longest - n)])
            mask.append([1] * n + [0] * (longest - n))
        pin = self.device.type == "cuda"
        ids_t, types_t, mask_t = (torch.tensor(t, dtype=torch.long, pin_memory=pin) for t in (ids, types, mask))
        return Batch(ids_t, types_t, mask_t, [(item, i) for item, i, _ in planned], sum(n for _, _, n in planned))

    def _forward(self, first: WorkItem, batch: Batch) -> list:
        if self.metrics is not None:
            self.metrics.observe_batch(first.lm.name, first.task, batch)
        batch.host_ids, batch.input_ids = batch.input_ids, batch.input_ids.to(self.device, non_blocking=True)
        batch.token_type_ids = batch.token_type_ids.to(self.device, non_blocking=True)
        batch.host_mask = batch.attention_mask
        batch.attention_mask = batch.attention_mask.to(self.device, non_blocking=True)
        start = time.perf_counter()
        with torch.inference_mode():
            results = self.runners[first.task](first.lm, batch)
        if self.metrics is not None:
            self.metrics.forward_seconds.labels(first.lm.name, first.task).observe(time.perf_counter() - start)
        return results


def _traced_pass(first: WorkItem, batch: Batch) -> Any:
    """_trace_pass, whose failure (a bug) is logged and costs the pass its span, never its requests."""
    try:
        return _trace_pass(first, batch)
    except Exception:
        log.exception("tracing a forward pass failed")
        return None


def _trace_pass(first: WorkItem, batch: Batch) -> Any:
    """Tracing on: a `queue` span for each request whose first pass this is (queued until now), and the pass's
    one `forward` span, linked to the span of every request it carries rows of (a child of the first's)."""
    now = time.time_ns()
    items = list({id(item): item for item, _ in batch.origin if item.trace is not None}.values())
    for item in items:
        if not item.traced_wait:
            item.traced_wait = True
            tracing.ended_span("queue", item.trace, tracing.wall_ns(item.enqueued), now)
    if not items:
        return None
    rows, longest = batch.input_ids.shape
    return tracing.linked_span(
        "forward",
        [item.trace for item in items],
        **{
            "bertserve.model": first.lm.name,
            "bertserve.task": first.task,
            "bertserve.batch_size": rows,
            "bertserve.padded_tokens": rows * longest,
            "bertserve.tokens": batch.tokens,
            "bertserve.requests": len(items),
        },
    )


def _priority(item: WorkItem) -> tuple:
    """Online items before background ones; of each, new work first (oldest first), then round robin."""
    return (item.background, 1, item.last_pass) if item.last_pass else (item.background, 0, item.enqueued)


def _settle(future: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
