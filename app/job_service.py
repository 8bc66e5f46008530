"""Training jobs, app side: request/response types, validation against the data directory, and the
Celery publisher. The app writes the job record (model.datadir) and sends the job's id to the training
queue through worker.queue, the one module of worker/ it imports (task names, queue, transport options).

POST /jobs validates everything before anything is queued: the kind, names (plain identifiers, so no
path can be smuggled in), that the dataset exists and suits the kind, that the base model exists and
fits (sequence length, label count), and every parameter against its bounds. Then the record is
written (state "queued") and the message sent; if the broker cannot be reached the record is removed
again and the answer is 503, so an accepted job (202) always has both a record and a message.
"""

from __future__ import annotations

import asyncio
import hmac
import shutil
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from model.datadir import (NAME_RULE, STATES, DataDir, JobNotFound, JobStore, add_event, now_iso,
                           read_meta, valid_name)
from model.files import TMP_PREFIX
from worker.queue import producer, send_job

from .errors import ServiceError
from .settings import Settings


# ---------------------------------------------------------------------------- request types

def _invalid(message: str) -> PydanticCustomError:
    """A validation error whose message is shown as is (a ValueError would get "Value error, " before it)."""
    return PydanticCustomError("invalid", message)


def _check_name(value: str) -> str:
    if not valid_name(value):
        raise _invalid(NAME_RULE)
    return value


Name = Annotated[str, Field(min_length=1, max_length=64, examples=["reviews"]), AfterValidator(_check_name)]


class Strict(BaseModel):
    # Unknown fields, strings for numbers and NaN/inf are errors, not guesses.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TrainParams(Strict):
    """Shared by both kinds. Bounds guard the service, not good practice: see the README for that."""

    max_steps: int = Field(1000, ge=1, le=1_000_000, description="Optimizer steps to train.")
    batch_size: int = Field(32, ge=1, le=4096, description="Examples per micro-batch.")
    grad_accum_steps: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    max_seq_len: int = Field(128, ge=8, le=4096, description="Tokens per example, [CLS]/[SEP] included.")
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="Linear warmup; at most max_steps.")
    save_every: int = Field(100, ge=0, le=1_000_000, description="Checkpoint every N steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, le=100, description="Checkpoints kept (besides the best).")
    log_every: int = Field(10, ge=1, le=100_000, description="A metrics.jsonl line every N steps.")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    eval_every: int = Field(0, ge=0, le=1_000_000, description="Evaluate every N steps (0: only at the end).")

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps > self.max_steps:
            raise _invalid(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.eval_every and not self.eval_fraction:
            raise _invalid("eval_every needs eval_fraction > 0 (there is nothing to evaluate on)")
        return self


class FinetuneParams(TrainParams):
    lr: float = Field(5e-5, gt=0.0, le=1.0, description="Peak learning rate (BERT paper: 2e-5 to 5e-5).")
    eval_fraction: float = Field(0.1, ge=0.0, le=0.5, description="Share of the rows held out for eval.")


class ModelSize(Strict):
    """The size of a model pretrained from scratch (BERT-base: 768, 12, 12, 3072, 512)."""

    hidden_size: int = Field(256, ge=8, le=4096)
    num_hidden_layers: int = Field(4, ge=1, le=48)
    num_attention_heads: int = Field(4, ge=1, le=64)
    intermediate_size: int = Field(1024, ge=8, le=16384)
    max_position_embeddings: int = Field(512, ge=16, le=4096)

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_attention_heads:
            raise _invalid(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        return self


class PretrainParams(TrainParams):
    lr: float = Field(1e-4, gt=0.0, le=1.0, description="Peak learning rate (BERT: 1e-4).")
    eval_fraction: float = Field(0.02, ge=0.0, le=0.5,
                                 description="Share of the documents held out for eval (at most 1000).")
    nsp: bool = Field(True, description="Next-sentence prediction beside MLM (BertForPreTraining).")
    masked_lm_prob: float = Field(0.15, ge=0.01, le=0.5)
    freeze_encoder: bool = Field(False, description="With base_model: train only the heads; the encoder stays as loaded.")
    config: ModelSize | None = Field(None, description="From scratch only: the model's size.")
    vocab_size: int | None = Field(None, ge=32, le=200_000,
                                   description="From scratch only: WordPiece vocabulary learnt from the corpus.")
    lowercase: bool | None = Field(None, description="From scratch only: lowercase the vocabulary.")


class PretrainJobRequest(Strict):
    kind: Literal["pretrain"]
    model_name: Name = Field(description="Name of the model to publish in DATA_DIR/models/.")
    base_model: Name | None = Field(None, description="Continue pretraining this model; omitted: from scratch.")
    dataset: Name = Field(description="A corpus uploaded with POST /datasets.")
    params: PretrainParams = Field(default_factory=PretrainParams)


class FinetuneJobRequest(Strict):
    kind: Literal["finetune"]
    model_name: Name = Field(description="Name of the classifier to publish in DATA_DIR/models/.")
    base_model: Name = Field(description="The model whose encoder is fine-tuned.")
    dataset: Name = Field(description="A labelled dataset uploaded with POST /datasets.")
    params: FinetuneParams = Field(default_factory=FinetuneParams)


CreateJobRequest = Annotated[Union[PretrainJobRequest, FinetuneJobRequest], Field(discriminator="kind")]

CREATE_EXAMPLE = {"kind": "finetune", "model_name": "reviews-clf", "base_model": "bert-tiny", "dataset": "reviews",
                  "params": {"max_steps": 200, "batch_size": 16, "lr": 5e-5, "save_every": 50}}


# ---------------------------------------------------------------------------- response types

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
assert set(JobState.__args__) == set(STATES)


class CreateJobResponse(BaseModel):
    id: str
    state: JobState
    status_url: str


class JobStatus(BaseModel):
    """A job as job.json has it, with the latest progress flattened in."""

    id: str
    kind: Literal["pretrain", "finetune"]
    state: JobState
    model_name: str
    base_model: str | None
    dataset: str
    params: dict[str, Any]
    step: int = Field(description="Optimizer steps done (as of the latest progress report).")
    total_steps: int
    loss: float | None = Field(description="Mean training loss over the latest logging window.")
    lr: float | None
    tokens_per_s: float | None
    eta_s: float | None = Field(description="Seconds to go at the current pace (running jobs only).")
    epoch: float | None
    latest_checkpoint: str | None = Field(description="Relative to the job directory, e.g. checkpoints/step-200.")
    attempts: int = Field(description="Times a worker started the job (a worker death costs one).")
    cancel_requested: bool
    error: str | None
    eval: dict[str, Any] | None = Field(description="The latest evaluation (fine-tuning).")
    result: dict[str, Any] | None = Field(description="Set on success: the published model and final numbers.")
    created_at: str
    enqueued_at: str | None
    started_at: str | None
    finished_at: str | None
    updated_at: str
    heartbeat_at: str | None = Field(description="Last sign of life of the training process (running jobs).")
    worker: str | None
    events: list[dict[str, Any]]
    status_url: str
    metrics_url: str


class JobsResponse(BaseModel):
    jobs: list[JobStatus]


class JobMetricsResponse(BaseModel):
    id: str
    records: list[dict[str, Any]] = Field(description='metrics.jsonl: {"type": "train"|"eval"|"resume", "step", ...}')


def job_status(record: dict) -> JobStatus:
    progress = record.get("progress") or {}
    running = record["state"] == "running"
    return JobStatus(
        **{k: record.get(k) for k in ("id", "kind", "state", "model_name", "base_model", "dataset", "params",
                                      "attempts", "error", "eval", "result", "created_at", "enqueued_at",
                                      "started_at", "finished_at", "updated_at", "worker", "latest_checkpoint")},
        cancel_requested=bool(record.get("cancel_requested")), events=record.get("events") or [],
        heartbeat_at=record.get("heartbeat_at") if running else None,
        step=progress.get("step") or 0, total_steps=progress.get("total_steps") or record["params"]["max_steps"],
        loss=progress.get("loss"), lr=progress.get("lr"), tokens_per_s=progress.get("tokens_per_s"),
        eta_s=progress.get("eta_s") if running else None, epoch=progress.get("epoch"),
        status_url=f"/jobs/{record['id']}", metrics_url=f"/jobs/{record['id']}/metrics")


# ---------------------------------------------------------------------------- the service

class JobService:
    """What the /jobs and /datasets routes share: settings, the job store and the Celery publisher."""

    def __init__(self, settings: Settings, data_dir: Path, models=None):
        self.settings, self.data_dir = settings, data_dir
        self.store = JobStore(data_dir)
        self.models = models  # app.store.ModelStore, for base-model checks
        self.celery = producer(settings.broker_url, data_dir)
        self._submit_lock = asyncio.Lock()  # name checks and record creation, one submission at a time

    def publish(self, record: dict) -> None:
        """Send the job's task by name (blocking: call in a thread)."""
        send_job(self.celery, record["id"], record["kind"], retries=self.settings.publish_retries)

    async def submit(self, request: PretrainJobRequest | FinetuneJobRequest) -> dict:
        async with self._submit_lock:
            spec = await self.validate(request)
            record = await asyncio.to_thread(self.store.create, spec)
        try:
            await asyncio.to_thread(self.publish, record)
        except Exception as e:
            await asyncio.to_thread(self._discard, record["id"])
            raise ServiceError("unavailable", f"the job queue (broker) cannot be reached, nothing was queued: "
                                              f"{type(e).__name__}: {e}") from None
        return await asyncio.to_thread(self.store.update, record["id"], _mark_enqueued)

    def _discard(self, job_id: str) -> None:
        """Remove a record whose message never left; closed first, under the record lock, so a worker
        that found it anyway (a recovery sweep) sees a finished job and leaves it alone."""
        unclaimed = False

        def close(r: dict) -> None:
            nonlocal unclaimed
            if r["state"] == "queued" and r["attempts"] == 0:
                unclaimed = True
                r["state"], r["error"] = "failed", "the broker could not be reached; the job was never queued"

        self.store.update(job_id, close)
        if unclaimed:
            job_dir = self.store.job_dir(job_id)
            doomed = job_dir.parent / f"{TMP_PREFIX}discard-{job_id}-{uuid.uuid4().hex[:6]}"
            job_dir.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # -- validation against the data directory ---------------------------------------------------

    async def validate(self, req: PretrainJobRequest | FinetuneJobRequest) -> dict:
        """Checks pydantic cannot make (they need the disk); returns the spec to store."""
        await asyncio.to_thread(self._check_model_name, req.model_name)
        needs = "corpus" if req.kind == "pretrain" else "labelled"
        dataset = await asyncio.to_thread(self._dataset, req.dataset, needs)
        params = req.params.model_dump()
        if req.base_model is not None:
            base = await self._base_model(req.base_model)
            _check_seq_len(req.params.max_seq_len, base.config.max_position_embeddings,
                           f"base model '{req.base_model}'")
        if req.kind == "pretrain":
            params = _pretrain_params(req, params)
        else:
            _check_labels(base, dataset)
        return {"kind": req.kind, "model_name": req.model_name, "base_model": req.base_model,
                "dataset": req.dataset, "params": params}

    def _check_model_name(self, name: str) -> None:
        if DataDir(self.data_dir).model(name).exists():
            raise ServiceError("validation", f"model_name: model '{name}' already exists; choose another name")
        record = self.store.unfinished_job_for_model(name)
        if record is not None:
            raise ServiceError("validation", f"model_name: job {record['id']} ({record['state']}) "
                                             f"is already training a model named '{name}'")

    def _dataset(self, name: str, kind: str) -> dict:
        meta = read_meta(self.data_dir, name)
        if meta is None:
            raise ServiceError("validation", f"dataset: '{name}' not found (upload it with POST /datasets)")
        if meta["kind"] != kind:
            raise ServiceError("validation", f"dataset: '{name}' is a {meta['kind']} dataset; this job needs a "
                                             f"{kind} one")
        return meta

    async def _base_model(self, name: str):
        try:
            entry = await self.models.lookup(name)
        except ServiceError:
            raise ServiceError("validation", f"base_model: model '{name}' not found in DATA_DIR/models") from None
        if entry.error is not None:
            raise ServiceError("validation", f"base_model: model '{name}' cannot be used: {entry.error}")
        return entry


def _mark_enqueued(record: dict) -> None:
    record["enqueued_at"] = now_iso()
    add_event(record, "enqueued")


def _check_seq_len(max_seq_len: int, positions: int, what: str) -> None:
    if max_seq_len > positions:
        raise ServiceError("validation", f"params.max_seq_len: {max_seq_len} is more than {what} has "
                                         f"positions for ({positions})")


def _pretrain_params(req: PretrainJobRequest, params: dict) -> dict:
    scratch_only = [k for k in ("config", "vocab_size", "lowercase") if params[k] is not None]
    if req.base_model is not None:
        if scratch_only:
            raise ServiceError("validation", f"params.{scratch_only[0]}: only for pretraining from scratch; "
                                             f"with base_model the model's own size and vocabulary are used")
        return {k: v for k, v in params.items() if k not in ("config", "vocab_size", "lowercase")}
    if params["freeze_encoder"]:
        raise ServiceError("validation", "params.freeze_encoder: needs a base_model (a from-scratch encoder "
                                         "has nothing worth freezing)")
    config = req.params.config or ModelSize()
    _check_seq_len(req.params.max_seq_len, config.max_position_embeddings, "params.config")
    return {**params, "config": config.model_dump(), "vocab_size": params["vocab_size"] or 8000,
            "lowercase": True if params["lowercase"] is None else params["lowercase"]}


def _check_labels(base, dataset: dict) -> None:
    """A base that is already a classifier keeps its head, so the label count must match."""
    if "classifier" not in base.heads:
        return
    have, want = base.config.num_labels, len(dataset["labels"])
    if have != want:
        raise ServiceError("validation", f"base_model: '{base.name}' is a classifier with {have} labels; "
                                         f"dataset '{dataset['name']}' has {want}")


# ---------------------------------------------------------------------------- dependencies

def get_jobs(request: Request) -> JobService:
    """The app's JobService, made on first use (so create_app needs nothing but the include_router lines)."""
    jobs = getattr(request.app.state, "jobs", None)
    if jobs is None:
        service = request.app.state.service
        jobs = request.app.state.jobs = JobService(service.settings, service.settings.data_dir, service.store)
    return jobs


JobsDep = Annotated[JobService, Depends(get_jobs)]
_bearer = HTTPBearer(auto_error=False, description="BERT_ADMIN_KEY (or BERT_API_KEY when no admin key is set).")


async def require_admin_key(request: Request, jobs: JobsDep,
                            credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """BERT_ADMIN_KEY opens the training routes; without one, BERT_API_KEY does; without either, open."""
    key = jobs.settings.admin_key_value()
    which = "BERT_ADMIN_KEY"
    if key is None:
        key, which = request.app.state.service.settings.api_key_value(), "BERT_API_KEY"
    if key is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ServiceError("unauthorized", f"missing or wrong key: send 'Authorization: Bearer <{which}>'")


def find_job(jobs: JobService, job_id: str) -> dict:
    try:
        return jobs.store.read(job_id)
    except JobNotFound:
        raise ServiceError("not_found", f"job '{job_id}' not found") from None

