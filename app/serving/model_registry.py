"""the model registry: DATA_DIR/models/<name>/, each model's promoted version in Hugging Face layout.

The registry scans the directory (at start-up, on GET /models and when a request names a model it
does not know), so a model saved while the service runs is served without a restart. Hidden and
temporary directories ("." or "tmp" prefix, as datadir.files.atomic_dir writes) are skipped. An entry
is a model's promoted version (datadir.versions: model.json names it; a legacy flat directory
is its own version 1). Its identity is that of model.json and of the version's directory together,
so a promote (model.json rewritten) or a replaced directory (a new inode or mtime) makes the next
request read it again and load the new version; a request that already has the old LoadedModel
finishes on it. Weights come through model.modeling.load_model (safetensors, or weights-only
torch.load): nothing is ever unpickled.

Memory: the loaded models' weights and one forward pass's working set (model/sizing.py's estimates)
stay within a budget (BERT_MODEL_MEMORY_GB). Before a load that would pass it, models that are not
pinned are unloaded: first those that no key but the one loading used in the last RECENT_USERS_S,
then those fewest other keys used (the loading key's own first among equals, then the least recently
used), so a key that churns through models unloads its own before a model others use. A model that cannot fit beside
the pinned ones is a 507. The requests and work items running on a LoadedModel hold it (hold,
release): an unloaded model that is still held keeps its bytes counted until the last holder lets
go, so a load waits for them (at most `load_wait_s`, then a 503 with Retry-After) rather than pass
the budget; a request for a model that is unloaded but still held takes that copy back unloaded.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.errors import ONE_LINE, ServiceError
from app.keys import ownership
from app.keys.limits import CALLER
from app.prometheus import Metrics
from app.serving import model_jobs
from app.serving.stored_models import (
    HEAD_TITLES,
    LoadedModel,
    StoredModel,
    describe_failure,
    load_stored,
    model_identity,
    read_stored_model,
)
from datadir import DataDir, JobRecords, valid_name
from datadir.jobs import JobRecord
from datadir.versions import Access, read_access, resolve, version_numbers
from model.compute import kernels
from model.sizing import ARCHITECTURES, engine_working_bytes, format_bytes, inference_weight_bytes, packed_weight_bytes

log = logging.getLogger("bertserve.registry")
log.addFilter(ONE_LINE)  # a model's name and path, one line each (app/errors.py)

# How long a key's request keeps counting as a use of a model, for the order models are unloaded in.
RECENT_USERS_S = 60.0


def _usable(entries: list[StoredModel]) -> list[str]:
    """The names of those the request's key may use: a key is told of its own, the shared ones and, when it is
    limited to some models, of those alone (app/keys/ownership.py)."""
    caller = CALLER.get()
    if caller is None:
        return [e.name for e in entries]
    return caller.usable([e.name for e in entries if ownership.may_read_model(caller.key, e.name, e.access)])


class ModelRegistry:
    def __init__(
        self,
        data_dir: Path,
        default_model: str | None,
        device: torch.device,
        warm_up=None,
        default_mlm_model: str | None = None,
        precision=lambda name: "fp32",
        memory_budget: int | None = None,
        pinned: list[str] | None = None,
        max_batch_tokens: int = 4096,
        metrics: Metrics | None = None,
        load_wait_s: float = 5.0,
        loading: Callable[[StoredModel], None] | None = None,
    ):
        self.root = DataDir(data_dir).models
        self.jobs = JobRecords(data_dir)
        self.default_name = default_model
        self.default_mlm_name = default_mlm_model  # for the routes that need the MLM or NSP head
        self.precision_of = precision  # name -> "fp32" | "bf16" | "int8" (resolved: never "auto")
        self.device = device
        self.warm_up = warm_up  # async (LoadedModel) -> None: forward passes before first use
        self._entries: dict[str, StoredModel] = {}
        self._lock = threading.Lock()
        self.memory_budget = memory_budget  # bytes; None: no limit
        self.pinned = pinned  # never unloaded; None: the default model
        self.max_batch_tokens = max_batch_tokens  # sizes one forward pass's working set
        self.metrics = metrics
        self._wake = asyncio.Event()  # set (and replaced) when memory is freed or a load ends
        self._uses = itertools.count(1)  # orders requests for least-recently-used (no ties, unlike a clock)
        self.clock = time.monotonic  # when a key last asked for a model (StoredModel.users)
        self.load_wait_s = load_wait_s  # the longest a load waits for room before its 503
        self.loading = loading  # called in a load's thread before it loads (auto's background measurement)
        # Unloaded models that requests or work items may still run on: their bytes count until the last lets go.
        # Scans (in a thread) append replaced entries to `_retired`; the event loop moves them here.
        self._draining: list[tuple[StoredModel, LoadedModel]] = []
        self._retired: collections.deque[tuple[StoredModel, LoadedModel]] = collections.deque()

    # -- scanning (filesystem work: call through asyncio.to_thread from async code) ----------

    def scan(self) -> list[StoredModel]:
        """Bring the entries in line with the directory; return them sorted by name."""
        found = {}
        if self.root.is_dir():
            for child in self.root.iterdir():
                if not valid_name(child.name) or not child.is_dir():  # also skips .tmp-* and tmp* dirs
                    continue
                current = self._on_disk(child.name)
                if current is not None:
                    found[child.name] = current
        with self._lock:
            for name in list(self._entries):
                if name not in found:
                    self._retire(self._entries.pop(name))
            for name, current in found.items():
                self._update(name, *current)
            return [self._entries[n] for n in sorted(self._entries)]

    def _on_disk(self, name: str) -> tuple[Path, tuple, int, list[int]] | None:
        """(promoted version's directory, identity, version, versions) of a model, None: not servable."""
        model_root = self.root / name
        promoted = resolve(model_root)
        if promoted is None or not (promoted[1] / "config.json").is_file():
            return None
        identity = model_identity(model_root, promoted[1])
        if identity is None:
            return None
        return promoted[1], identity, promoted[0], version_numbers(model_root)

    def _update(self, name: str, path: Path, identity: tuple, version: int, versions: list[int]) -> None:
        """Read the entry again when its promoted version changed (call with self._lock held); a model.json
        that changed only its access (shared or not) keeps the loaded model."""
        old = self._entries.get(name)
        if old is None or old.identity[1] != identity[1] or old.path != path or old.version != version:
            if old is not None:
                self._retire(old)
            self._entries[name] = read_stored_model(name, path, identity, version, versions)
            self._entries[name].access = read_access(self.root / name)
            return
        if old.identity != identity:
            old.identity, old.access = identity, read_access(self.root / name)
        old.versions = versions

    def _retire(self, entry: StoredModel) -> None:
        """An entry replaced or removed by a scan: its loaded model goes on counting while requests hold it."""
        if entry.loaded is not None:
            self._retired.append((entry, entry.loaded))  # a deque: safe from the scan's thread

    def _refresh(self, name: str) -> StoredModel | None:
        """The entry for `name`, read again if its promoted version changed or was replaced since."""
        if self._entries.get(name) is None:
            return None
        current = self._on_disk(name)
        if current is None:  # removed (or mid-replacement): let a scan decide
            self.scan()
            return self._entries.get(name)
        with self._lock:
            self._update(name, *current)
            return self._entries[name]

    # -- lookups --------------------------------------------------------------------------------

    def default(self) -> str | None:
        """BERT_DEFAULT_MODEL, or the only model in DATA_DIR/models when it holds exactly one."""
        if self.default_name:
            return self.default_name
        names = list(self._entries)
        return names[0] if len(names) == 1 else None

    def peek(self, name: str) -> StoredModel | None:
        """The entry as last scanned, without touching the filesystem."""
        return self._entries.get(name)

    def entries(self) -> list[StoredModel]:
        return [self._entries[n] for n in sorted(self._entries)]

    async def lookup(self, name: str | None, head: str | None = None) -> StoredModel:
        """The stored model a request names (or the default); 404 when there is none, 503 while a
        training job is still producing it."""
        defaulted = name is None and head in ("mlm", "nsp") and bool(self.default_mlm_name)
        if defaulted:
            name = self.default_mlm_name
        if name is None:
            if self.default() is None:
                await asyncio.to_thread(self.scan)
            name = self.default()
            if name is None:
                raise ServiceError(
                    "not_found", "no model named in the request and no default model (set BERT_DEFAULT_MODEL)"
                )
        if not valid_name(name):
            raise ServiceError("not_found", f"model '{name}' not found")
        entry = self._entries.get(name)
        if entry is not None and model_identity(self.root / name, entry.path) == entry.identity:
            return entry  # the common case: two stats (model.json, the version's directory), no thread hop
        entry = await asyncio.to_thread(self._refresh, name)
        if entry is None:
            await asyncio.to_thread(self.scan)
            entry = self._entries.get(name)
        if entry is None:
            await asyncio.to_thread(self._raise_if_making, name, defaulted)
            known = ", ".join(_usable([self._entries[n] for n in sorted(self._entries)])) or "none"
            raise ServiceError("not_found", f"model '{name}' not found (available: {known})")
        return entry

    def _raise_if_making(self, name: str, defaulted: bool) -> None:
        """503 naming the job that will publish a model called `name`, when a queued or running one will; for
        the default MLM model (`defaulted`), also the job that was to and was cancelled or failed, and what
        answers meanwhile (app/serving/model_jobs.py)."""
        record = self.jobs.unfinished_job_for_model(name) if not defaulted else model_jobs.making(self.jobs, name)
        if record is not None and record["state"] in model_jobs.ENDED:
            raise model_jobs.ended(name, record)
        if record is not None:
            raise model_jobs.still_making(name, record, self._meanwhile() if defaulted else "")

    def _meanwhile(self) -> str:
        """What a request for the missing default MLM model can use until it is there: the default model."""
        default = self.default()
        entry = self._entries.get(default) if default else None
        if entry is None or entry.error is not None or not _usable([entry]):
            return ""
        return f"; meanwhile /embeddings and /similarity answer with model '{default}'"

    async def mlm_status(self) -> tuple[str | None, JobRecord | None]:
        """(the model /fill-mask and /nsp answer with now when a request names none, None when none can; the job
        making the default MLM model while it is missing, None when there is none)."""
        name = self.default_mlm_name
        if not name:
            default = self.default()
            entry = self._entries.get(default) if default else None
            return (default if entry is not None and entry.error is None and "mlm" in entry.heads else None), None
        if self._entries.get(name) is None:
            await asyncio.to_thread(self.scan)
        entry = self._entries.get(name)
        if entry is not None:
            return (name if entry.error is None and "mlm" in entry.heads else None), None
        return None, await asyncio.to_thread(model_jobs.making, self.jobs, name)

    async def get(
        self,
        name: str | None,
        head: str | None = None,
        route: str = "",
        check: Callable[[str, Access], None] | None = None,
        user: str | None = None,
        admit: Callable[[StoredModel], Callable[[], None]] | None = None,
    ) -> LoadedModel:
        """The loaded model for a request, loading it on first use, held for the caller: it stays counted
        against the memory budget until the caller lets go with `release`.

        `head` names what the route needs; a model without it is a 422 that names both. `check` may
        refuse the model by its name and access (the caller's key: app/keys/ownership.py) before anything
        is loaded. `user` names the caller's key, a use of the model for the order of unloading; `admit`
        is called before this request loads the model, and may refuse the load (it returns what gives
        back its charge if the load fails).
        """
        entry = await self.lookup(name, head)
        if check is not None:
            check(entry.name, entry.access)
        if entry.error is not None:
            raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}")
        if head is not None and head not in entry.heads:
            has = ", ".join(entry.heads) or "none"
            raise ServiceError(
                "validation",
                f"model '{entry.name}' has no {HEAD_TITLES[head]} head, which "
                f"{route} needs (it is a {entry.architecture}; heads: {has})",
            )
        loaded = await self.ensure_loaded(entry, warm_up=False, user=user, admit=admit)
        self.hold(loaded)  # nothing awaited since it was decided on: it cannot have been unloaded meanwhile
        return loaded

    async def ensure_loaded(
        self,
        entry: StoredModel,
        warm_up: bool = True,
        user: str | None = None,
        admit: Callable[[StoredModel], Callable[[], None]] | None = None,
    ) -> LoadedModel:
        """The entry's model, loaded (within the memory budget) and warmed up on first use. The value
        returned stays usable even if the model is unloaded while the caller still runs it. A request
        that loads a model (`warm_up` False) is its first use: warm-up passes would only queue
        before it, behind the engine's other work, and lengthen its wait. `user` and `admit`: as get's."""
        if user is not None:
            entry.users[user] = self.clock()
        loaded = entry.loaded
        if loaded is None:
            async with entry.lock:  # concurrent first requests load it once
                loaded = entry.loaded or self._take_back(entry)
                if loaded is None:
                    refund = admit(entry) if admit is not None else None
                    try:
                        loaded = await self._load_within_budget(entry, warm_up, user)
                    except BaseException:
                        if refund is not None:
                            refund()
                        raise
        entry.last_used = next(self._uses)
        return loaded

    def _take_back(self, entry: StoredModel) -> LoadedModel | None:
        """The entry's own model, unloaded but still held by requests: loaded again without a load (its
        bytes were counted all along)."""
        self._prune()
        for pair in self._draining:
            if pair[0] is entry:
                self._draining.remove(pair)
                entry.loaded, entry.reserved_bytes = pair[1], pair[1].weight_bytes
                self._changed()
                return pair[1]
        return None

    async def _load_within_budget(
        self, entry: StoredModel, warm_up: bool = True, user: str | None = None
    ) -> LoadedModel:
        await self._reserve(entry, user)
        start = time.perf_counter()
        try:
            loaded = await asyncio.to_thread(self._load, entry)
            if self.warm_up is not None and warm_up:
                await self.warm_up(loaded)
                loaded.warm = True
        except BaseException as e:  # cancelled too: the reservation goes with the load
            entry.reserved_bytes = 0
            self._changed()
            if isinstance(e, ServiceError) or not isinstance(e, Exception):
                raise
            log.exception("loading model %s failed", entry.name)  # remembered until the directory changes
            entry.error = f"loading failed: {describe_failure(e, self.root.parent)}"
            raise ServiceError("unavailable", f"model '{entry.name}' cannot be served: {entry.error}") from None
        loaded.weight_bytes, loaded.working_bytes = entry.reserved_bytes, self.estimate(entry)[1]
        entry.loaded = loaded
        entry.last_used = next(self._uses)
        if self.metrics is not None:
            self.metrics.model_loads.labels(entry.name).inc()
            self.metrics.model_load_seconds.labels(entry.name).observe(time.perf_counter() - start)
        self._changed()
        return loaded

    def _load(self, entry: StoredModel) -> LoadedModel:
        if self.loading is not None:
            self.loading(entry)
        return load_stored(entry, self.device, self.precision_of(entry.name))

    def loaded_count(self) -> int:
        return sum(e.loaded is not None for e in self._entries.values())

    # -- the memory budget --------------------------------------------------------------------------

    def is_pinned(self, name: str) -> bool:
        return name in self.pinned if self.pinned is not None else name == self.default()

    def estimate(self, entry: StoredModel) -> tuple[int, int]:
        """(weights, forward-pass working set) in bytes at the precision it is served in (model/sizing.py);
        (0, 0) for a directory that cannot be described."""
        if entry.config is None or entry.num_parameters is None:
            return 0, 0
        precision = self.precision_of(entry.name)
        weights = inference_weight_bytes(entry.config, entry.num_parameters, precision)
        if self._packs_dense_weights(precision) and entry.architecture in ARCHITECTURES:
            weights += packed_weight_bytes(entry.config, entry.architecture, precision)
        return weights, engine_working_bytes(entry.config, self.max_batch_tokens, precision)

    def _packs_dense_weights(self, precision: str) -> bool:
        """Whether oneDNN keeps a reordered copy of each dense weight of a model served here at `precision`."""
        path = {"fp32": "onednn-fp32", "bf16": "onednn-bf16"}.get(precision)
        return torch.device(self.device).type == "cpu" and path is not None and kernels.expected(path)

    def memory_in_use(self, entries: list[StoredModel] | None = None, held: bool = True) -> tuple[int, int]:
        """(weights, working set) counted against the budget: the loaded and loading models' weights, those of
        the unloaded models that requests still hold (`held`), and the largest working set among them all
        (one forward pass runs at a time, whichever model's)."""
        counted = [e for e in (list(self._entries.values()) if entries is None else entries) if e.reserved_bytes]
        draining = [lm for _, lm in self._prune()] if held else []
        return (
            sum(e.reserved_bytes for e in counted) + sum(lm.weight_bytes for lm in draining),
            max([self.estimate(e)[1] for e in counted] + [lm.working_bytes for lm in draining], default=0),
        )

    def held_bytes(self) -> int:
        """The weights of unloaded models that requests still run on (counted in memory_in_use)."""
        return sum(lm.weight_bytes for _, lm in self._prune())

    def fits(self, entry: StoredModel) -> bool:
        """Whether `entry` could load now without unloading another model."""
        if self.memory_budget is None or entry.reserved_bytes:
            return True
        weights, working = self.estimate(entry)
        held, held_working = self.memory_in_use()
        return held + weights + max(working, held_working) <= self.memory_budget

    async def _reserve(self, entry: StoredModel, user: str | None = None) -> None:
        """Count `entry`'s weights against the budget, unloading models to make room; while only models
        still loading, or unloaded ones that requests still hold, stand in the way, wait for them, at most
        `load_wait_s` (then a 503). Each decision runs without an await in it, so concurrent first requests
        for several models see each other's reservations and never decide on the same room twice."""
        deadline = asyncio.get_running_loop().time() + self.load_wait_s
        while not self._make_room(entry, user):
            wake = self._wake
            try:
                await asyncio.wait_for(wake.wait(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise self._no_room_yet(entry) from None

    def _make_room(self, entry: StoredModel, user: str | None = None) -> bool:
        """Reserve `entry`'s weights if they fit now; else unload models in _unload_order until they will
        fit once the held ones are let go, and answer False (wait)."""
        weights, working = self.estimate(entry)
        if self.memory_budget is not None:
            while not self._fits_beside(entry, weights, working):
                others = [e for e in list(self._entries.values()) if e is not entry and e.reserved_bytes]
                self._check_fits_beside_pinned(entry, weights, working, others)
                if self._fits_beside(entry, weights, working, held=False):
                    return False  # room once requests let go of unloaded models
                victims = [e for e in others if e.loaded is not None and not self.is_pinned(e.name)]
                if not victims:
                    return False  # the others are loading: each becomes unloadable once it is loaded
                self.unload(min(victims, key=lambda e: self._unload_order(e, user)))
        entry.reserved_bytes = weights
        self._changed()
        return True

    def _fits_beside(self, entry: StoredModel, weights: int, working: int, held: bool = True) -> bool:
        """Whether `entry` fits beside the other models counted now (`held`: and the held unloaded ones)."""
        assert self.memory_budget is not None
        others = [e for e in list(self._entries.values()) if e is not entry]
        in_use, in_use_working = self.memory_in_use(others, held)
        return in_use + weights + max(working, in_use_working) <= self.memory_budget

    def _unload_order(self, entry: StoredModel, user: str | None) -> tuple[int, bool, int]:
        """Which model a load by key `user` unloads first: the one fewest other keys asked for in the last
        RECENT_USERS_S (a model only the loading key churns: none); among equals, one `user` asked for
        itself before one it did not; then the least recently used."""
        since = self.clock() - RECENT_USERS_S
        recent = {key for key, when in entry.users.items() if when >= since}
        return len(recent - {user}), user not in recent, entry.last_used

    def _no_room_yet(self, entry: StoredModel) -> ServiceError:
        """503 for a load that waited load_wait_s for room in vain."""
        assert self.memory_budget is not None
        weights, working = self.estimate(entry)
        in_use, _ = self.memory_in_use([e for e in self._entries.values() if e is not entry])
        held = self.held_bytes()
        retry = max(1, math.ceil(self.load_wait_s))
        return ServiceError(
            "unavailable",
            f"model '{entry.name}' needs an estimated {format_bytes(weights + working)} of the "
            f"{format_bytes(self.memory_budget)} model memory budget, and after {self.load_wait_s:g} s "
            f"(BERT_LOAD_WAIT_SECONDS) the models in use still hold {format_bytes(in_use)} of it "
            f"({format_bytes(held)} of that by unloaded models that requests still run on); retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )

    def _check_fits_beside_pinned(
        self, entry: StoredModel, weights: int, working: int, others: list[StoredModel]
    ) -> None:
        """507 for a model that does not fit even with every unpinned model unloaded."""
        assert self.memory_budget is not None
        pinned = [e for e in others if self.is_pinned(e.name)]
        pinned_bytes, pinned_working = self.memory_in_use(pinned, held=False)
        working = max(working, pinned_working)
        if pinned_bytes + weights + working <= self.memory_budget:
            return
        budget = f"the {format_bytes(self.memory_budget)} model memory budget"
        if pinned:
            names = ", ".join(sorted(e.name for e in pinned))
            budget += f" less the {format_bytes(pinned_bytes)} that pinned models hold ({names})"
        raise ServiceError(
            "insufficient_memory",
            f"model '{entry.name}' needs an estimated {format_bytes(weights + working)} "
            f"({format_bytes(weights)} of {self.precision_of(entry.name)} weights and "
            f"{format_bytes(working)} for a forward pass of BERT_MAX_BATCH_TOKENS={self.max_batch_tokens}), "
            f"more than {budget}; raise BERT_MODEL_MEMORY_GB"
            + (" or pin fewer models (BERT_PINNED_MODELS)" if pinned else ""),
        )

    def unload(self, entry: StoredModel) -> None:
        """Drop the registry's reference to a loaded model. Requests running it keep theirs, and its bytes
        stay counted until the last of them lets go (release)."""
        log.info("unloading model %s to make room under the memory budget", entry.name)
        loaded, entry.loaded, entry.reserved_bytes = entry.loaded, None, 0
        if loaded is not None and loaded.holders:
            self._draining.append((entry, loaded))
        if self.metrics is not None:
            self.metrics.model_unloads.labels(entry.name).inc()
        if self.device.type == "cuda" and (loaded is None or not loaded.holders):
            self._empty_cache()  # what no tensor holds any more goes back to the device
        self._changed()

    def _empty_cache(self) -> None:
        """torch.cuda.empty_cache in a thread: cudaFree waits for the device, and the event loop must not wait for
        the pass running meanwhile."""
        try:
            asyncio.get_running_loop().run_in_executor(None, torch.cuda.empty_cache)
        except RuntimeError:  # no loop here (a test, a thread): nothing to keep waiting
            torch.cuda.empty_cache()

    # -- holders: the requests and work items running on a loaded model ----------------------------

    def hold(self, loaded: LoadedModel) -> None:
        """One more request or work item runs on `loaded` (event loop only)."""
        loaded.holders += 1

    def release(self, loaded: LoadedModel) -> None:
        """One request or work item less on `loaded`; the last one to let go of an unloaded model frees its
        bytes for the loads waiting (event loop only)."""
        loaded.holders -= 1
        assert loaded.holders >= 0, f"model {loaded.name} released more often than held"
        if loaded.holders == 0 and any(lm is loaded for _, lm in self._draining):
            self._prune()
            log.info("model %s: the last request on it ended; its memory is free", loaded.name)
            if self.device.type == "cuda":
                self._empty_cache()
            self._changed()

    def _prune(self) -> list[tuple[StoredModel, LoadedModel]]:
        """The unloaded models still held, the ones let go dropped (the scans' retired ones taken in first)."""
        while self._retired:
            self._draining.append(self._retired.popleft())
        self._draining = [(e, lm) for e, lm in self._draining if lm.holders]
        return self._draining

    def _changed(self) -> None:
        """After a reservation, load, failure, unload or release: wake the loads waiting for room, update the
        gauges."""
        self._wake.set()
        self._wake = asyncio.Event()
        if self.metrics is not None:
            held, working = self.memory_in_use()
            self.metrics.models_loaded.set(self.loaded_count())
            self.metrics.model_memory.set(held + working if held else 0)
