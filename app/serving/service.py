"""The running service: settings, model registry, batching engine and tokeniser pool, started and
stopped by the app's lifespan. Routes reach it as `request.app.state.service`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from app.errors import ServiceError
from app.keys.limits import CALLER, Caller, LoadLimits, load_tokens
from app.prometheus import Metrics
from app.serving.auto_precision import AutoPrecision
from app.serving.engine import Engine, WorkItem
from app.serving.forward import RUNNERS
from app.serving.model_registry import ModelRegistry
from app.serving.stored_models import LoadedModel, StoredModel
from app.settings import Settings
from datadir.defaults import read_defaults
from model.compute import kernels
from model.compute.device import memory_bytes, resolve_device
from model.compute.precision import recommendation, use_tf32
from model.tokenizer import SPECIAL_TOKENS_IN_ONE_TEXT, with_special_tokens

log = logging.getLogger("bertserve")
# BERT_MODEL_MEMORY_GB unset: the share of the device's memory the models may take. A CPU's RAM also holds
# the process, its tokenisers and the page cache; a GPU's holds little but the models and the CUDA context.
DEFAULT_MEMORY_SHARE = {"cpu": 0.5, "cuda": 0.8}
GPU_MAX_BATCH_TOKENS = 16384  # BERT_MAX_BATCH_TOKENS on a CUDA device when it is not set
# Longest warm-up row: long enough for the kernels a real batch takes, short enough to cost ~nothing.
WARM_UP_TOKENS = 128
# Set in an off_loop job's thread: its request is gone (deadline or disconnect), so the job should stop.
_REQUEST_GONE: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("request_gone", default=None)


class Lane:
    """Many concurrent requests of one owner (a batch job's lines), given to the engine as work items of
    one forward pass each, rows sorted by length across requests, and holding a bounded share of the
    tokeniser queue.

    Set with `LANE.set(lane)` in a task: the requests its child tasks make go through the lane. Service.run
    hands a work item to `submit`, which keeps its rows in the lane's pool. The lane keeps two passes of
    its own in the engine, one running and the next queued (the first `delay_s` after a request arrives
    to an idle lane): when one finishes, the next goes. The pool's rows, sorted by length across requests,
    are cut into passes (rows x longest within BERT_MAX_BATCH_TOKENS, as the engine fills one), and each
    request gets its own rows' results. While one of its passes runs, the lane cuts its pool only once it
    holds MIN_CUT passes' worth of tokens, or else when that pass ends: rows that arrive a few at a time
    (the first requests of a batch's next lines) wait to be sorted with the rest instead of filling
    passes of mixed lengths, mostly padding. So the engine runs what one large request of all those rows
    would give it (little padding, a pass always ready), and an online request waits for at most the
    pass under way (the engine puts a lane's passes after every online item). Service.off_loop waits for one of the lane's `pool_slots`
    instead of answering 429 when the lane's share is taken, so the lane never fills the tokeniser queue
    that online requests use.
    """

    AHEAD = 2
    MIN_CUT = 8  # passes' worth of tokens in the pool that are cut while one of the lane's passes runs

    def __init__(self, service: Service, pool_slots: int, delay_s: float = 0.002, cut_rows: int | None = None):
        self.service = service
        self.cut_rows = cut_rows  # the most rows one cut takes, oldest requests first (None: the whole pool)
        self.pool_gate = asyncio.Semaphore(pool_slots)
        self.delay_s = delay_s
        self._pool: dict[tuple, list[tuple[WorkItem, asyncio.Future]]] = {}  # by model, task and options
        self._passes: collections.deque[tuple[_LaneRun, WorkItem, list[tuple[int, int]]]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._runs: set[asyncio.Task] = set()  # the passes under way (the loop keeps only weak references)
        self._in_flight = 0  # passes given to the engine and not finished

    async def submit(self, item: WorkItem) -> list:
        key = _merge_key(item)
        if key is None:  # options that cannot be compared: on its own
            return await self.service.run_item(item)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pool.setdefault(key, []).append((item, future))
        if self._in_flight < self.AHEAD and self._timer is None:  # company for delay_s, then a pass
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self._fill)
        return await future

    def _fill(self) -> None:
        """Keep AHEAD passes in the engine: one running, the next queued behind it."""
        self._timer = None
        while self._in_flight < self.AHEAD:
            if not self._passes:
                pooled = sum(item.tokens_left for members in self._pool.values() for item, _ in members)
                if self._in_flight and pooled < self.MIN_CUT * self.service.settings.max_batch_tokens:
                    return  # the engine is busy with one of ours: let the pool grow until it ends
                for key in list(self._pool):
                    self._cut(key)
            run, merged, part = self._passes.popleft() if self._passes else (None, None, None)
            if run is None or merged is None or part is None:
                return
            if merged.cancelled:
                continue
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(run.run(self.service, merged, part))
            self._runs.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._runs.discard(task)
        self._in_flight -= 1
        self._fill()

    def _cut(self, key: tuple) -> None:
        """The pool's rows for `key` (the oldest requests' up to cut_rows), sorted by length across requests,
        cut into passes."""
        members = [(item, future) for item, future in self._pool.pop(key, []) if not future.done()]
        if not members:
            return
        if self.cut_rows is not None:  # the oldest requests whose rows fit, at least one
            totals = itertools.accumulate(len(item.rows) for item, _ in members)
            taken = max(1, sum(1 for total in totals if total <= self.cut_rows))
            if members[taken:]:
                self._pool[key] = members[taken:]
            members = members[:taken]
        budget = self.service.settings.max_batch_tokens
        rows = sorted(
            ((len(row[0]), m, i) for m, (item, _) in enumerate(members) for i, row in enumerate(item.rows)),
            key=lambda r: r[0],
        )
        parts: list[list[tuple[int, int]]] = [[]]
        for n, m, i in rows:
            if parts[-1] and (len(parts[-1]) + 1) * n > budget:
                parts.append([])
            parts[-1].append((m, i))
        run = _LaneRun(members)
        first = members[0][0]
        for part in parts:
            cut = [members[m][0].rows[i] for m, i in part]
            merged = WorkItem(first.task, first.lm, cut, first.params, background=True)  # after online work
            run.watch(merged, part)
            self._passes.append((run, merged, part))


class _LaneRun:
    """One flush's requests and the work items their rows went into: each request is answered when its
    last row's result is in; an item whose requests have all gone away is cancelled."""

    def __init__(self, members: list[tuple[WorkItem, asyncio.Future]]):
        self.members = members
        self.results: list[list] = [[None] * len(item.rows) for item, _ in members]
        self.left = [len(item.rows) for item, _ in members]
        self.items_of: dict[int, list[tuple[WorkItem, set[int]]]] = {}
        for m, (_, future) in enumerate(members):
            future.add_done_callback(functools.partial(self._gone, m))

    def watch(self, merged: WorkItem, part: list[tuple[int, int]]) -> None:
        owners = {m for m, _ in part}
        for m in owners:
            self.items_of.setdefault(m, []).append((merged, owners))

    def _gone(self, m: int, _: asyncio.Future) -> None:
        for merged, owners in self.items_of.get(m, []):
            if not merged.future.done() and all(self.members[o][1].done() for o in owners):
                merged.cancel()

    async def run(self, service: Service, merged: WorkItem, part: list[tuple[int, int]]) -> None:
        try:
            results = await service.run_item(merged)
        except BaseException as e:
            for m in {m for m, _ in part}:
                future = self.members[m][1]
                if not future.done():
                    future.set_exception(e if isinstance(e, Exception) else ServiceError("unavailable", "stopped"))
            if not isinstance(e, Exception):
                raise
            return
        for (m, i), result in zip(part, results):
            self.results[m][i] = result
            self.left[m] -= 1
            future = self.members[m][1]
            if self.left[m] == 0 and not future.done():
                future.set_result(self.results[m])


def _merge_key(item: WorkItem) -> tuple | None:
    """Work items with equal keys may share one: the same model, task and options."""
    try:
        options = json.dumps(item.params, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return (id(item.lm), item.task, options)


# The lane the current task's requests go through (None: each request on its own, as online).
LANE: contextvars.ContextVar[Lane | None] = contextvars.ContextVar("lane", default=None)


class WorkDropped(Exception):
    """Raised inside an off_loop job whose request has gone; nobody waits for its result."""


def check_dropped() -> None:
    """Between the inputs of an off_loop job: stop (WorkDropped) if its request has gone, so a long job
    does not run on for nobody. A no-op outside such a job."""
    gone = _REQUEST_GONE.get()
    if gone is not None and gone.is_set():
        raise WorkDropped()


def check_precisions(settings: Settings, device: torch.device) -> None:
    """int8 (model/compute/precision.py's Int8Linear) runs on the CPU only: asked for on a GPU, every model
    would fail to load while /health says ok. Refused at start, naming the setting."""
    if device.type != "cuda":
        return
    if settings.precision == "int8":
        raise ValueError("BERT_PRECISION=int8 runs on the CPU only; on a GPU use bf16 or auto")
    int8 = sorted(name for name, precision in settings.model_precision.items() if precision == "int8")
    if int8:
        raise ValueError(
            f"BERT_MODEL_PRECISION asks int8 for {', '.join(int8)}: int8 runs on the CPU only; "
            "on a GPU use bf16 or auto"
        )


def memory_budget(settings: Settings, device: torch.device) -> int:
    """Bytes the loaded models may take together: BERT_MODEL_MEMORY_GB, else DEFAULT_MEMORY_SHARE of the
    device's memory (model.compute.device.memory_bytes: RAM or the container's limit, or the GPU's free memory at
    start)."""
    if settings.model_memory_gb is not None:
        return int(settings.model_memory_gb * 1024**3)
    return int(DEFAULT_MEMORY_SHARE.get(device.type, 0.5) * memory_bytes(device))


class Service:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.metrics = metrics
        self.device = resolve_device(settings.device)
        if self.device.type == "cuda" and "max_batch_tokens" not in settings.model_fields_set:
            # A GPU pass of MiniLM at 4096 tokens is well under a millisecond: the host's per-pass work would rule.
            settings = settings.model_copy(update={"max_batch_tokens": GPU_MAX_BATCH_TOKENS})
        self.settings = settings
        check_precisions(settings, self.device)
        use_tf32(self.device, settings.tf32)
        self.auto = AutoPrecision(settings)  # what auto means for each model on this CPU
        self.registry = ModelRegistry(
            settings.data_dir,
            settings.default_model,
            self.device,
            warm_up=self.warm_up,
            # the setting, else the choice of the first start (DATA_DIR/defaults.json), else the default model
            default_mlm_model=settings.default_mlm_model or read_defaults(settings.data_dir).get("mlm"),
            precision=self.precision_for,
            pinned=settings.pinned_models,
            max_batch_tokens=settings.max_batch_tokens,
            metrics=metrics,
            load_wait_s=settings.load_wait_seconds,
            loading=self._measure_if_auto,
        )
        self.loads = LoadLimits(settings.max_loads_per_minute)  # per key (app/keys/limits.py)

        self.engine: Engine | None = None  # made by start(): an app's lifespan may run more than once
        self.pool: ThreadPoolExecutor | None = None
        self._pool_jobs = 0  # jobs given to the pool and not yet answered (app/serving/service.py off_loop)
        self._loader: asyncio.Task | None = None
        # SIGTERM (app/launcher/server.py): `draining` while the replica still serves but /ready answers
        # 503, so a balancer sends it nothing new; `leaving` once the drain is over and uvicorn stops
        # accepting, when long streams end so that their clients reconnect to another replica.
        self.draining = False
        self.leaving = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        self.registry.memory_budget = memory_budget(s, self.device)  # asks the device: at start, not on import
        self.metrics.model_memory_budget.set(self.registry.memory_budget)
        self.engine = Engine(
            self.device,
            RUNNERS,
            max_batch_tokens=s.max_batch_tokens,
            max_queue=s.max_queue,
            max_wait_ms=s.max_wait_ms,
            batching=s.batching,
            background_pass_tokens=s.batch_pass_tokens,
            metrics=self.metrics,
        )
        self.engine.start()
        if self.device.type == "cpu":
            info = kernels.cpu()
            log.info("cpu: %s, %d cores: %s", info.name, info.cores, info.summary())
        self.pool = ThreadPoolExecutor(s.tokenizer_threads, thread_name_prefix="tokenize")
        await asyncio.to_thread(self.registry.scan)
        log.info("fill-mask and NSP model: %s", self.mlm_model_words())
        if self.settings.load == "startup":
            self._loader = asyncio.create_task(self._load_all())

    async def stop(self) -> None:
        if self._loader is not None:
            self._loader.cancel()
        engine, pool, self.engine, self.pool = self.engine, self.pool, None, None
        if engine is not None:
            await asyncio.to_thread(engine.stop, 30.0)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _load_all(self) -> None:
        """BERT_LOAD=startup: load and warm up every stored model, the default first, as long as they
        fit in the memory budget without unloading one another (the rest load on first use)."""
        default = self.registry.default()
        entries = sorted(self.registry.entries(), key=lambda e: e.name != default)
        for entry in entries:
            if entry.error is not None:
                continue
            if entry.name != default and not self.registry.fits(entry):
                log.info(
                    "model %s is not loaded at start: it does not fit in the memory budget beside the others",
                    entry.name,
                )
                continue
            try:
                await self.registry.ensure_loaded(entry)
            except ServiceError as e:
                log.error("%s", e.message)

    def precision_for(self, name: str) -> str:
        """The precision model `name` is served in (precision_choice)."""
        return self.precision_choice(name)[0]

    def precision_choice(self, name: str) -> tuple[str, str]:
        """The precision model `name` is served in, and why in words: BERT_MODEL_PRECISION's entry, else
        BERT_PRECISION; "auto" is, on a CPU, the fastest precision the model's card measured within the bounds
        on this kind of CPU (app/serving/auto_precision.py), on a GPU model.compute.precision's recommendation
        for it; with its reason."""
        setting = "BERT_MODEL_PRECISION" if name in self.settings.model_precision else "BERT_PRECISION"
        precision = self.settings.model_precision.get(name, self.settings.precision)
        if precision != "auto":
            return precision, f"{precision} by {setting}"
        if self.device.type == "cpu":
            auto, why = self.auto.choice(self.registry.peek(name))
        else:
            auto, why = recommendation(self.device)
        return auto, f"{auto} by {setting}=auto ({why})"

    def _measure_if_auto(self, entry: StoredModel) -> None:
        """At a model's load (in its thread): measure its precisions in the background when it is served with
        auto on a CPU its card has no row for."""
        if (
            self.device.type == "cpu"
            and self.settings.model_precision.get(entry.name, self.settings.precision) == "auto"
        ):
            self.auto.measure_if_missing(entry, self.registry)

    # -- work -----------------------------------------------------------------------------------

    async def loaded_model(self, name: str | None, head: str | None = None, route: str = "") -> LoadedModel:
        """The model a request names (None: the route's default), when the request's key may use it. A load
        it causes is charged to its key (admit_load). The request's task holds the model until it ends, so
        the model's memory stays counted against the budget while the request runs on it, unloaded or not."""
        caller = CALLER.get()
        lm = await self.registry.get(
            name,
            head,
            route,
            check=caller.check_model if caller is not None else None,
            user=caller.key.name if caller is not None else None,
            admit=functools.partial(self.admit_load, caller),
        )
        task = asyncio.current_task()
        assert task is not None, "loaded_model runs in a task"
        task.add_done_callback(lambda _: self.registry.release(lm))
        return lm

    def admit_load(self, caller: Caller | None, entry: StoredModel) -> Callable[[], None]:
        """A request is about to load `entry`: one of its key's loads per minute (BERT_MAX_LOADS_PER_MINUTE;
        without a key, of the keyless requests' limit) and, where the key has a token rate, load_tokens of the
        model's parameters. A 429 when either is spent; returns what gives both back if the load fails."""
        who = caller.key.name if caller is not None else None
        try:
            self.loads.take(who, entry.name)
        except ServiceError:
            if caller is not None:
                caller.on_refused(caller.key.name, "loads")
            raise
        tokens = load_tokens(entry.num_parameters or 0)
        if caller is not None:
            try:
                caller.charge_load(entry.name, tokens)
            except ServiceError:
                self.loads.give(who)
                raise

        def refund() -> None:
            self.loads.give(who)
            if caller is not None:
                caller.refund_load(tokens)

        return refund

    def incoming(self):
        """`with service.incoming():` around a request's work before its work item is queued."""
        if self.engine is None:
            raise ServiceError("unavailable", "the service is not running")
        return self.engine.incoming()

    async def run(self, item: WorkItem) -> list:
        """Queue a work item for the inference thread and wait for its per-row results. If the
        request goes away meanwhile (this task is cancelled), so does the item's unrun work. In a
        lane (LANE), the lane queues it with its companions."""
        lane = LANE.get()
        if lane is not None:
            return await lane.submit(item)
        return await self.run_item(item)

    async def run_item(self, item: WorkItem) -> list:
        if self.engine is None:
            raise ServiceError("unavailable", "the service is not running")
        future = self.engine.submit(item)
        self._hold_until_done(item.lm, future)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            item.cancel()
            raise

    def _hold_until_done(self, lm: LoadedModel, future: concurrent.futures.Future) -> None:
        """A work item holds its model until the engine is done with it: a request that goes away mid-pass
        lets go of it first, but the pass still runs on the model's weights."""
        loop = asyncio.get_running_loop()
        self.registry.hold(lm)

        def done(_: concurrent.futures.Future) -> None:  # in the inference thread, or the event loop
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is left to count
                loop.call_soon_threadsafe(self.registry.release, lm)

        future.add_done_callback(done)

    async def off_loop(self, fn: Callable, *args) -> Any:
        """Tokeniser and other CPU work, in the thread pool, never on the event loop. At most
        BERT_MAX_TOKENIZER_QUEUE jobs wait for (or run on) its threads; one more is a 429. A job whose
        request goes away (this task is cancelled: deadline or disconnect) before a thread takes it is
        dropped unrun (the executor's future is cancelled with this task); one already running stops at
        its next check_dropped(), between its inputs."""
        lane = LANE.get()
        async with lane.pool_gate if lane is not None else contextlib.nullcontext():
            return await self._off_loop(fn, *args)

    async def _off_loop(self, fn: Callable, *args) -> Any:
        if self.pool is None:
            raise ServiceError("unavailable", "the service is not running")
        limit = self.settings.max_tokenizer_queue
        if self._pool_jobs >= limit:
            raise ServiceError("overloaded", f"the tokeniser queue is full ({limit} jobs waiting); retry later")
        self._pool_jobs += 1  # only the event loop counts, so no lock
        gone = threading.Event()
        context = contextvars.copy_context()
        context.run(_REQUEST_GONE.set, gone)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, context.run, fn, *args)
        except asyncio.CancelledError:
            gone.set()
            raise
        finally:
            self._pool_jobs -= 1

    async def warm_up(self, lm: LoadedModel) -> None:
        """Forward passes before the first request, so its latency has no kernel loading in it: a padded
        batch (two lengths: masked attention, or the packed path) and an unpadded one (plain attention),
        at up to WARM_UP_TOKENS, because each attention path loads its own kernels on a GPU."""
        tok = lm.tokenizer
        n = max(SPECIAL_TOKENS_IN_ONE_TEXT, min(WARM_UP_TOKENS, lm.max_length))
        specials = tok.cls_token_id, tok.sep_token_id
        long = with_special_tokens([tok.unk_token_id] * (n - SPECIAL_TOKENS_IN_ONE_TEXT), None, *specials)
        short = with_special_tokens([], None, *specials)
        for rows in ([short, long], [long, long]):
            await self.run(
                WorkItem(
                    "encode",
                    lm,
                    rows,
                    {"pooling": None, "normalize": None},  # as the model's own modules pool
                    wait=False,
                )
            )

    def check_count(self, n: int) -> None:
        if n > self.settings.max_inputs:
            raise ServiceError("validation", f"at most {self.settings.max_inputs} inputs per request, got {n}")

    def check_tokens(self, n: int, counted: str = "all inputs together") -> None:
        """A request's cost, known once it is tokenised: over budget it never reaches the engine, and the
        request's key is charged for its `n` tokens (once a request: the rows it runs). Safe to call from
        the thread pool."""
        self.check_request_tokens(n, counted)
        if (caller := CALLER.get()) is not None:  # the request's key: its token rate, its usage
            caller.charge_tokens(n)

    def check_request_tokens(self, n: int, counted: str = "all inputs together") -> None:
        """The bound alone (BERT_MAX_REQUEST_TOKENS), charging nothing: for a job that counts as it
        tokenises, before it makes its windows (their rows are charged once, when they are run)."""
        if n > self.settings.max_request_tokens:
            raise ServiceError(
                "validation",
                f"the request is {n} tokens long ({counted}), more than the "
                f"{self.settings.max_request_tokens} that BERT_MAX_REQUEST_TOKENS "
                "allows",
            )

    # -- readiness ------------------------------------------------------------------------------

    def mlm_model_words(self) -> str:
        """Which model /fill-mask and /nsp use when a request names none, and why, in words."""
        if self.settings.default_mlm_model:
            return f"'{self.settings.default_mlm_model}' (BERT_DEFAULT_MLM_MODEL)"
        if self.registry.default_mlm_name:
            return f"'{self.registry.default_mlm_name}' (chosen at first start: DATA_DIR/defaults.json)"
        return f"the default model ('{self.registry.default()}')" if self.registry.default() else "none"

    async def not_ready_reason(self) -> str | None:
        """None when the default model is loaded and warmed up; else why not."""
        if self.draining:
            return "stopping: this replica received SIGTERM and finishes what it holds; send requests elsewhere"
        name = self.registry.default()
        entry = self.registry.peek(name) if name else None
        if entry is None:  # perhaps saved since the last scan
            await asyncio.to_thread(self.registry.scan)
            name = self.registry.default()
            entry = self.registry.peek(name) if name else None
        if name is None:
            return "no default model: set BERT_DEFAULT_MODEL (or store exactly one model)"
        if entry is None:
            return f"default model '{name}' is not in DATA_DIR/models"
        if entry.error is not None:
            return f"default model '{name}' cannot be served: {entry.error}"
        if entry.loaded is None:
            if self.settings.load == "startup" and (self._loader is None or self._loader.done()):
                self._loader = asyncio.create_task(self._load_all())
            return f"default model '{name}' is not loaded and warmed up yet"
        return None
