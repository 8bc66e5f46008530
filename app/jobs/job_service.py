"""Training jobs, app side: the JobService that the /jobs routes share.

The app writes the job record (datadir) and sends the job's id to the training queue through
worker.queue, the one module of worker/ it imports (task names, queue, transport options).

POST /jobs validates everything before anything is queued: the kind, names (plain identifiers, so no
path can be smuggled in) and every parameter against its bounds (app/schemas/jobs.py), then here, against
the data directory: that the dataset exists and suits the kind and that the base model exists and
fits (sequence length, label count). Then the record is written (state "queued") and the message
sent. If the broker cannot be reached the record is removed again and the answer is 503; if sending
fails any other way (a bug) the record is removed too and the answer is a logged 500. So an
accepted job (202) always has both a record and a message. A mining job (kind "mine-negatives") is checked
by app/jobs/mining.py and sent nowhere: this process runs it, as it runs batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from kombu.exceptions import OperationalError

from app.errors import ServiceError
from app.jobs.events import EventStreams
from app.jobs.mining import KIND as MINE_KIND
from app.jobs.mining import Mining, mining_spec
from app.jobs.quota import check_job_limit, check_room, job_disk_bytes
from app.jobs.task_checks import (
    FINETUNE_ARCHITECTURES,
    SPARSE_NEEDS_MLM,
    check_cross_encoder,
    check_embedding_job,
    check_labels,
    cross_encoder_loss,
)
from app.keys import ownership
from app.keys.keyfile import Key
from app.keys.keyring import ANONYMOUS
from app.schemas.jobs import FinetuneJobRequest, MineNegativesJobRequest, ModelSize, PretrainJobRequest
from app.settings import Settings
from datadir import (
    TERMINAL,
    JobFinished,
    JobNotFound,
    JobRecord,
    JobRecords,
    JobUnfinished,
    jobs,
    read_meta,
    scheduling,
)
from datadir.datasets import KINDS_OF_TASK, LABELLED_KINDS, eval_kinds, num_labels
from datadir.versions import access_of
from model.config import BertConfig
from model.options import defaults
from model.sizing import GB, TrainingSize, estimate_training, format_count
from worker.queue import producer, send_job
from worker.telemetry import tracing

log = logging.getLogger("bertserve")

JobRequest = PretrainJobRequest | FinetuneJobRequest  # a training job's

# What sending raises when the broker is down or unreachable: kombu wraps the transport's connection
# errors in OperationalError once its retries are spent; a socket error or timeout may also come
# through as itself (OSError, ConnectionError and TimeoutError are all OSErrors).
BROKER_ERRORS = (OperationalError, OSError)


class JobService:
    """What the /jobs routes share: settings, the job records and the Celery publisher (models and datasets are
    administered by app/jobs/catalog.py)."""

    def __init__(self, settings: Settings, data_dir: Path, registry=None, mining: Mining | None = None):
        self.settings, self.data_dir = settings, data_dir
        self.records = JobRecords(data_dir)
        self.registry = registry  # app.serving.model_registry.ModelRegistry, for base-model checks
        self.mining = mining  # runs the mining jobs in this process (app/jobs/mining.py); None: refused
        self.celery = producer(settings.broker_url, data_dir)
        # Name checks and record creation, one submission at a time; the catalog's changes take it too.
        self.submit_lock = asyncio.Lock()
        self.event_streams = EventStreams(
            settings.max_event_streams, settings.max_event_streams_per_job, settings.event_streams_per_key()
        )

    def publish(self, record: JobRecord) -> None:
        """Send the job's id to the training queue (blocking: call in a thread)."""
        send_job(self.celery, record["id"], retries=self.settings.publish_retries)

    async def submit(self, request: JobRequest | MineNegativesJobRequest, owner: Key = ANONYMOUS) -> JobRecord:
        """Validate, write the record (owned by `owner`, the key's name), send the message (or, for a mining
        job, start it in this process); the record as enqueued. 429 when the key has its `max_jobs` queued or
        running already."""
        async with self.submit_lock:  # this process's submissions queue here, not on the flock
            held = contextlib.ExitStack()  # the data directory's lock: other replicas' submissions too
            await asyncio.to_thread(held.enter_context, self.records.submitting())
            with held:
                await asyncio.to_thread(self._check_job_limit, owner)
                if isinstance(request, MineNegativesJobRequest):
                    await asyncio.to_thread(self._check_dataset_name, request.name, owner)
                    spec = await mining_spec(request, owner, self.settings, self.registry)
                else:
                    await asyncio.to_thread(self._check_model_name, request.model_name, owner)
                    spec = await self.validate(request, owner)
                    self._check_priority(request.priority, self.max_priority(owner), owner)
                await asyncio.to_thread(self._check_disk, owner, spec)
                # publish_any: an admin's job may publish a new version of any model (datadir/publish.py)
                mine = {"owner": owner.name, "worker_share": owner.worker_share, "publish_any": owner.is_admin}
                mine |= tracing.job_fields()  # the run continues this request's trace
                record = await asyncio.to_thread(self.records.create, {**spec, **mine})
        if isinstance(request, MineNegativesJobRequest):
            return await self._start_here(record)
        try:
            await asyncio.to_thread(self.publish, record)
        except BROKER_ERRORS as e:
            await asyncio.to_thread(self.records.discard_unclaimed, record["id"], "the broker could not be reached")
            log.warning("publishing job %s failed: %s: %s", record["id"], type(e).__name__, e)
            raise ServiceError(
                "unavailable",
                "the job queue (broker) cannot be reached, nothing was queued; "
                "retry later (the service log has the details)",
            ) from None
        except Exception:  # a bug: no record without a message; the app's handler logs it and answers 500
            await asyncio.to_thread(
                self.records.discard_unclaimed, record["id"], "sending the job failed on an internal error"
            )
            raise
        return await asyncio.to_thread(self.records.move, record["id"], jobs.enqueued)

    async def _start_here(self, record: JobRecord) -> JobRecord:
        """A job the API runs (a mining job): queued, and its task started in this process."""
        if self.mining is None:  # a JobService without the running service (the bootstrap): never the case here
            raise ServiceError("unavailable", "this process does not run mining jobs")
        record = await asyncio.to_thread(self.records.move, record["id"], jobs.enqueued)
        self.mining.start(record["id"])
        return record

    def _check_disk(self, owner: Key, spec: dict) -> None:
        """507 when the job's checkpoints and model (a mining job: its embeddings and dataset) would take the
        key past its disk quota."""
        kind, params = spec["kind"], spec["params"]
        if "disk_bytes" in spec["estimate"]:
            check_room(self.data_dir, owner, spec["estimate"]["disk_bytes"], "this job's embeddings and dataset")
            return
        keep_last = params.get("keep_last") or defaults(kind, params.get("task"))["keep_last"]
        adding = job_disk_bytes(spec["estimate"]["parameters"], keep_last)
        check_room(self.data_dir, owner, adding, "this job's checkpoints and model")

    def _check_job_limit(self, owner: Key) -> None:
        check_job_limit(self.records, owner)

    def visible(self, caller: Key) -> Callable[[Mapping], bool]:
        """Which records `caller` sees, and may see named by id: a key with the scope admin every job, any
        other its own (Key.sees_jobs_of)."""
        return lambda record: caller.sees_jobs_of(jobs.owner_of(record))

    def list_for(self, caller: Key, state: str | None = None) -> list[JobRecord]:
        """The jobs `caller` sees, newest first (blocking: call in a thread)."""
        return [r for r in self.records.list(state) if self.visible(caller)(r)]

    def cancel(self, job_id: str, caller: Key = ANONYMOUS) -> JobRecord:
        """Ask a queued or running job to stop (blocking: call in a thread); 409 once it has finished."""
        self.find(job_id, caller)  # another key's job is a 404, as if there were none
        try:
            return self.records.request_cancel(job_id)
        except JobNotFound:
            raise ServiceError("not_found", f"job '{job_id}' not found") from None
        except JobFinished as e:
            raise ServiceError(
                "conflict", f"job '{job_id}' has already finished ({e.state}): there is nothing to cancel"
            ) from None

    def queue_place(self, record: JobRecord, caller: Key = ANONYMOUS) -> dict | None:
        """A queued training job's position, what it waits for and an estimate, naming by id only the jobs
        `caller` sees (blocking: call in a thread)."""
        if record["state"] != "queued":
            return None
        return scheduling.queue_place(self.records.list(), record["id"], self.visible(caller))

    def restart(self, job_id: str) -> JobRecord:
        """Queue a cancelled or failed job again, to resume from its latest checkpoint (blocking)."""
        record = self.records.restart(job_id)
        try:
            self.publish(record)
        except BROKER_ERRORS as e:  # the record stays queued: a worker's start-up sweep sends it
            raise ServiceError(
                "unavailable", f"job {job_id} is queued again, but the broker cannot be reached: {e}"
            ) from None
        return self.records.move(job_id, jobs.enqueued)

    def find(self, job_id: str, caller: Key = ANONYMOUS) -> JobRecord:
        """A job's record; 404 when there is none, or when it is not `caller`'s to see (blocking: call in
        a thread)."""
        try:
            record = self.records.read(job_id)
        except JobNotFound:
            raise ServiceError("not_found", f"job '{job_id}' not found") from None
        if not self.visible(caller)(record):
            raise ServiceError("not_found", f"job '{job_id}' not found")
        return record

    def job_seconds(self, records: list[JobRecord] | None = None) -> dict[str, float]:
        """Worker time of every key's jobs in seconds, from the records (read here if not given: in a thread)."""
        seconds: dict[str, float] = {}
        for record in self.records.list() if records is None else records:
            owner = jobs.owner_of(record)
            seconds[owner] = seconds.get(owner, 0.0) + float(record.get("runtime_s") or 0.0)
        return seconds

    def delete_job(self, job_id: str, caller: Key = ANONYMOUS) -> int:
        """Delete a finished job's directory, checkpoints included; the bytes freed (blocking: call in
        a thread). 404 when there is none (or it is another key's); 409 while it is queued or running."""
        self.find(job_id, caller)
        try:
            return self.records.delete(job_id)
        except JobNotFound:
            raise ServiceError("not_found", f"job '{job_id}' not found") from None
        except JobUnfinished as e:
            raise ServiceError(
                "conflict", f"job '{job_id}' is {e.state}: only a finished job can be deleted (cancel it first)"
            ) from None

    # -- validation against the data directory ---------------------------------------------------

    async def validate(self, req: JobRequest, caller: Key = ANONYMOUS) -> dict:
        """Checks pydantic cannot make (they need the disk), `caller`'s rights among them (the model it
        publishes to, its base model and dataset: app/keys/ownership.py); returns the spec to store. (That
        no other job trains the model's name is checked before, by submit.)"""
        access = await asyncio.to_thread(access_of, self.data_dir, req.model_name)
        ownership.check_publish(caller, req.model_name, access)
        task = None if req.kind == "pretrain" else req.params.task
        needs = ("corpus",) if task is None else KINDS_OF_TASK[task]
        dataset = await asyncio.to_thread(self._dataset, req.dataset, needs, task)
        ownership.check_dataset(caller, dataset)
        eval_dataset = getattr(req, "eval_dataset", None)
        if eval_dataset is not None:
            assert task is not None  # only a fine-tuning request has an eval_dataset
            meta = await asyncio.to_thread(self._eval_dataset, eval_dataset, dataset, task)
            ownership.check_dataset(caller, meta, field="eval_dataset")
        params = req.params.to_record()  # what the request set: the run's defaults apply to the rest
        if req.base_model is not None:
            base = await self._base_model(req.base_model)
            ownership.check_model(caller, req.base_model, base.access, field="base_model")
            _check_seq_len(
                req.params.max_seq_len, base.config.max_position_embeddings, f"base model '{req.base_model}'"
            )
        if req.kind == "pretrain":
            params = _pretrain_params(req, params)
        elif task == "sentence-embedding":
            await asyncio.to_thread(check_embedding_job, req, base, dataset)
        elif task == "sparse-embedding" and "mlm" not in base.heads:  # SPLADE's terms are the MLM head's logits
            raise ServiceError("validation", f"base_model: '{base.name}' has no MLM head; {SPARSE_NEEDS_MLM}")
        elif task == "cross-encoder":
            check_cross_encoder(req.params, base, dataset)
            params = await self._with_retriever(req.params, params, dataset, caller)
        elif task == "late-interaction" and req.params.teacher_model is not None:
            await self._check_teacher(req.params.teacher_model, caller)
        elif not req.params.regression:  # a regressor's labels are numbers, one output
            self._check_label_count(dataset)
            check_labels(base, dataset)
        params["max_runtime"] = self._max_runtime(params["max_runtime"])
        self._check_devices(params["devices"])
        size = _training_size(req, base.config if req.base_model is not None else None, dataset)
        self._check_size(size)
        return {
            "kind": req.kind,
            "model_name": req.model_name,
            "base_model": req.base_model,
            "dataset": req.dataset,
            **({"eval_dataset": eval_dataset} if eval_dataset is not None else {}),
            "params": params,
            "estimate": size.to_dict(),
            "priority": req.priority,
        }

    async def _with_retriever(self, p, params: dict, dataset: dict, caller: Key) -> dict:
        """A cross-encoder on pairs: params with retriever_model, the first stage of its reranking evaluation
        (the one named, else the service's default model, else none: every held-out document a candidate)."""
        if dataset["kind"] != "pairs":
            if p.retriever_model is not None:
                raise ServiceError(
                    "validation",
                    f"params.retriever_model: the first stage of the reranking evaluation of pairs; dataset "
                    f"'{dataset['name']}' is {dataset['kind']}",
                )
            return params
        name = p.retriever_model or self.registry.default()
        if name is None:
            return params
        entry = await self._model(name, "params.retriever_model")
        ownership.check_model(caller, name, entry.access, field="params.retriever_model")
        return {**params, "retriever_model": name}

    async def _check_teacher(self, name: str, caller: Key) -> None:
        """A late-interaction job's teacher_model: a cross-encoder (one-label classifier) the caller may use."""
        entry = await self._model(name, "params.teacher_model")
        ownership.check_model(caller, name, entry.access, field="params.teacher_model")
        if "classifier" not in entry.heads or entry.config is None or entry.config.num_labels != 1:
            raise ServiceError(
                "validation",
                f"params.teacher_model: '{name}' is not a cross-encoder (a sequence classifier with one label), "
                "whose scores a late-interaction model could learn",
            )

    def _check_label_count(self, dataset: dict) -> None:
        have, limit = num_labels(dataset), self.settings.max_labels
        if dataset["kind"] in LABELLED_KINDS and have > limit:
            raise ServiceError(
                "validation",
                f"dataset: '{dataset['name']}' has {have} labels, more than the {limit} "
                "this service trains (BERT_MAX_LABELS)",
            )

    def max_priority(self, caller: Key) -> int:
        """The highest priority `caller` may give a job: BERT_JOB_MAX_PRIORITY, or its key's `max_priority`
        when that is lower."""
        limit = self.settings.job_max_priority
        if caller.max_priority is not None:
            limit = min(limit, caller.max_priority)
        return limit

    def _check_priority(self, asked: int, limit: int, caller: Key) -> None:
        if asked > limit:
            whose = (
                f"key '{caller.name}' may give ({limit}, its max_priority)"
                if caller.max_priority is not None and limit == caller.max_priority
                else f"this service allows ({limit}, BERT_JOB_MAX_PRIORITY)"
            )
            raise ServiceError("validation", f"priority: {asked} is more than {whose}")

    def _check_devices(self, asked: int) -> None:
        limit = self.settings.job_max_devices
        if asked > limit:
            raise ServiceError(
                "validation",
                f"params.devices: {asked} is more than this service allows ({limit}, BERT_JOB_MAX_DEVICES)",
            )

    def _max_runtime(self, asked: int | None) -> int:
        limit = self.settings.job_max_runtime
        if asked is not None and asked > limit:
            raise ServiceError(
                "validation",
                f"params.max_runtime: {asked} s is more than this service allows ({limit} s, BERT_JOB_MAX_RUNTIME)",
            )
        return limit if asked is None else asked

    def _check_size(self, size: TrainingSize) -> None:
        """422 naming the estimate and the limit, for each limit the job is over."""
        over = []
        if size.parameters > self.settings.job_max_params:
            over.append(
                f"{format_count(size.parameters)} parameters ({size.parameters:,}) is more than the limit "
                f"of {format_count(self.settings.job_max_params)} (BERT_JOB_MAX_PARAMS)"
            )
        if size.memory_gb > self.settings.job_max_memory_gb:
            states = size.weights_bytes + size.gradient_bytes + size.optimizer_bytes
            over.append(
                f"an estimated {size.memory_gb:,.1f} GB of peak training memory ({size.precision}: weights, "
                f"gradients and AdamW state {_gb(states)} GB, activations {_gb(size.activation_bytes)} GB, "
                f"runtime {_gb(size.overhead_bytes)} GB) is more than the limit of "
                f"{self.settings.job_max_memory_gb:g} GB (BERT_JOB_MAX_MEMORY_GB); a smaller batch_size "
                f"or max_seq_len uses less (grad_accum_steps keeps the effective batch)"
            )
        if over:
            raise ServiceError("validation", "params: the job is too large: " + "; ".join(over))

    def _check_dataset_name(self, name: str, caller: Key = ANONYMOUS) -> None:
        """Two mining jobs at once may not publish one dataset name (409, naming the other job by id when it
        is `caller`'s to see); a dataset of that name already there is mining_spec's 409."""
        record = next(
            (
                r
                for r in self.records.list()
                if r.get("kind") == MINE_KIND and r["params"].get("name") == name and r["state"] not in TERMINAL
            ),
            None,
        )
        if record is not None:
            job = scheduling.job_words(record, self.visible(caller))
            raise ServiceError(
                "conflict", f"name: {job} ({record['state']}) is already making a dataset named '{name}'"
            )

    def _check_model_name(self, name: str, caller: Key = ANONYMOUS) -> None:
        """A model that exists gets the job's output as its next version; two jobs at once may not
        train one name (409, naming the other job by id when it is `caller`'s to see)."""
        record = self.records.unfinished_job_for_model(name)
        if record is not None:
            job = scheduling.job_words(record, self.visible(caller))
            raise ServiceError(
                "conflict", f"model_name: {job} ({record['state']}) is already training a model named '{name}'"
            )

    def _dataset(self, name: str, kinds: tuple[str, ...], task: str | None) -> dict:
        meta = read_meta(self.data_dir, name)
        if meta is None:
            raise ServiceError("validation", f"dataset: '{name}' not found (upload it with POST /datasets)")
        if meta["kind"] not in kinds:
            wanted = " or ".join(filter(None, [", ".join(kinds[:-1]), kinds[-1]]))
            needs = f"task {task} needs a {wanted} one" if task else f"this job needs a {wanted} one"
            only = " (a retrieval dataset is for evaluation only)" if meta["kind"] == "retrieval" else ""
            raise ServiceError("validation", f"dataset: '{name}' is a {meta['kind']} dataset; {needs}{only}")
        return meta

    def _eval_dataset(self, name: str, dataset: dict, task: str) -> dict:
        kinds = eval_kinds(task, dataset["kind"])
        meta = read_meta(self.data_dir, name)
        if meta is None:
            raise ServiceError("validation", f"eval_dataset: '{name}' not found (upload it with POST /datasets)")
        if meta["kind"] not in kinds:
            raise ServiceError(
                "validation",
                f"eval_dataset: '{name}' is a {meta['kind']} dataset; task {task} on {dataset['kind']} dataset "
                f"'{dataset['name']}' evaluates on a {' or '.join(kinds)} one",
            )
        return meta

    async def _base_model(self, name: str):
        return await self._model(name, "base_model")

    async def _model(self, name: str, field: str):
        """The registry's entry of a model a job names in `field`; 422 when there is none or it cannot be used."""
        try:
            entry = await self.registry.lookup(name)
        except ServiceError:
            raise ServiceError("validation", f"{field}: model '{name}' not found in DATA_DIR/models") from None
        if entry.error is not None:
            raise ServiceError("validation", f"{field}: model '{name}' cannot be used: {entry.error}")
        return entry


def _check_seq_len(max_seq_len: int, positions: int, what: str) -> None:
    if max_seq_len > positions:
        raise ServiceError(
            "validation", f"params.max_seq_len: {max_seq_len} is more than {what} has positions for ({positions})"
        )


SCRATCH_VOCAB_SIZE = 8000  # a from-scratch job's vocabulary unless params.vocab_size says otherwise
SCRATCH_ONLY = ("config", "vocab_size", "lowercase")  # pretraining params that size a new model


def _pretrain_params(req: PretrainJobRequest, params: dict) -> dict:
    scratch_only = [k for k in SCRATCH_ONLY if params.get(k) is not None]
    if req.base_model is not None:
        if scratch_only:
            raise ServiceError(
                "validation",
                f"params.{scratch_only[0]}: only for pretraining from scratch; "
                f"with base_model the model's own size and vocabulary are used",
            )
        return {k: v for k, v in params.items() if k not in SCRATCH_ONLY}
    if req.params.freeze_encoder:
        raise ServiceError(
            "validation",
            "params.freeze_encoder: needs a base_model (a from-scratch encoder has nothing worth freezing)",
        )
    config = req.params.config or ModelSize()
    _check_seq_len(req.params.max_seq_len, config.max_position_embeddings, "params.config")
    return {
        **params,
        "config": config.model_dump(),
        "vocab_size": req.params.vocab_size or SCRATCH_VOCAB_SIZE,
        "lowercase": True if req.params.lowercase is None else req.params.lowercase,
    }


def _training_size(req: JobRequest, base_config, dataset: dict) -> TrainingSize:
    """The job's size by model/sizing.py: the base model's config, or the from-scratch one."""
    p = req.params  # with the defaults the run will use
    batch_size = p.batch_size
    if req.kind == "finetune":
        architecture, config = FINETUNE_ARCHITECTURES[p.task], base_config
        labels = 1 if p.regression or p.task == "cross-encoder" else num_labels(dataset) or 2
        extra: dict = {}
        if "batch_size" not in p.model_fields_set:  # the task's own default (model/options.py)
            batch_size = defaults("finetune", p.task)["batch_size"]
        if p.task == "late-interaction":  # each text of a row encoded alone, as sentence-embedding's
            extra = {"columns": 2 + int(dataset.get("negatives") or 0)}
        if p.task == "sentence-embedding":  # each text of a row embedded alone; GradCache a mini-batch at a time
            columns = 2 + int(dataset.get("negatives") or 0) if dataset["kind"] == "pairs" else 2
            extra = {"columns": columns, "mini_batch_size": p.mini_batch_size if p.cached else None}
        if p.task == "sparse-embedding":  # every text's logits over the whole vocabulary, as an MLM of every token
            extra = {"columns": 2 + int(dataset.get("negatives") or 0), "masked_lm_prob": 1.0}
        if p.task == "cross-encoder" and cross_encoder_loss(p, dataset) == "mnrl":  # an anchor's 1 + k + n pairs
            batch_size *= 1 + p.num_negatives + (dataset.get("negatives") or 0)
    else:
        architecture = "BertForPreTraining" if p.nsp else "BertForMaskedLM"
        config = base_config or BertConfig.from_dict(
            {**(p.config or ModelSize()).model_dump(), "vocab_size": p.vocab_size or SCRATCH_VOCAB_SIZE}
        )
        labels, extra = 2, {"masked_lm_prob": p.masked_lm_prob, "freeze_encoder": p.freeze_encoder}
    return estimate_training(
        config,
        architecture,
        batch_size=batch_size,
        seq_len=p.max_seq_len,
        precision=p.precision,
        num_labels=labels,
        **extra,
    )


def _gb(n: int) -> str:
    return f"{n / GB:,.1f}"
