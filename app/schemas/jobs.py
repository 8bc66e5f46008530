"""The types of /jobs (app/api/routes/jobs.py): a training job's request, whose parameters are built
from model/options.py's table (so the API, the `bert` command and the console's form share one
declaration of each option), and a job's status as GET /jobs/{id} answers it (imports and batches are
jobs too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, get_args

from pydantic import AfterValidator, BaseModel, Field, create_model, model_validator
from pydantic.json_schema import JsonDict

from app.schemas.shared import Name, Strict, invalid
from datadir import STATES
from datadir.datasets import KINDS_OF_TASK
from datadir.jobs import LEGACY_OWNER, owner_of, steps_of
from datadir.scheduling import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from model.data.question_answering import WindowMisfit, check_window
from model.options import TASKS, Option, format_default, options_for
from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR

# -- requests ----------------------------------------------------------------------------------

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+)([smhd])")
MAX_RUNTIME_CEILING = 366 * 86400  # a sanity bound; BERT_JOB_MAX_RUNTIME is the deployment's


def _seconds(value: int | str) -> int:
    """A duration in seconds: an integer, or a string of <number><unit> parts ("90m", "1h30m", "2d")."""
    if isinstance(value, str):
        text = value.replace(" ", "")
        if not text or _DURATION.sub("", text):
            raise invalid(f"'{value}' is not a duration: give seconds (an integer) or e.g. '90m', '12h', '1d12h'")
        value = sum(int(n) * _DURATION_UNITS[unit] for n, unit in _DURATION.findall(text))
    if not 1 <= value <= MAX_RUNTIME_CEILING:
        raise invalid(f"must be between 1 second and 366 days, got {value} s")
    return value


# Seconds, or a duration string; always seconds once validated.
Duration = Annotated[int | str, AfterValidator(_seconds)]


def option_fields(kind: str, names: list[str]) -> dict[str, Any]:
    """Pydantic fields of model/options.py's options `names` for a job of `kind`: type, default, bounds,
    choices and description from the table. A fine-tuning option whose default depends on the task shows
    the default task's, and the others in its description and under `x-task-defaults`."""
    by_name = {o.name: o for o in options_for(kind, job=True)}
    return {name: _option_field(by_name[name], kind) for name in names}


def _option_field(o: Option, kind: str) -> tuple[Any, Any]:
    annotation: Any = Literal[o.choices] if o.choices else o.type  # a type expression built at runtime
    if o.nullable:
        annotation = annotation | None
    b = o.bounds(kind)
    constraints: dict[str, Any] = {
        "ge": b.get("minimum"),
        "le": b.get("maximum"),
        "gt": b.get("above"),
        "lt": b.get("below"),
    }
    description = o.help[0].upper() + o.help[1:] + "."
    extra: JsonDict | None = None
    if kind == "finetune" and o.by_task:
        description += f" Default: {format_default(o, kind)}."
        extra = {"x-task-defaults": {task: o.default_for(kind, task) for task in TASKS}}
    return annotation, Field(
        o.default_for(kind),
        description=description,
        json_schema_extra=extra,
        **{k: v for k, v in constraints.items() if v is not None},
    )


def _job_option_names(kind: str) -> list[str]:
    return [o.name for o in options_for(kind, job=True)]


# Job options both kinds share with the same default go on TrainParams; the others on each kind's class.
_SHARED = [
    o.name
    for o in options_for("pretrain", job=True)
    if "finetune" in o.kinds
    and not o.by_task
    and o.default_for("pretrain") == o.default_for("finetune")
    and o.bounds("pretrain") == o.bounds("finetune")
]


class _TrainParams(Strict):
    """Shared by both kinds. Bounds guard the service, not good practice: see docs/training.md for that."""

    devices: int = Field(
        1,
        ge=1,
        le=64,
        description="Data-parallel processes on the worker's machine (one per "
        "GPU on CUDA), through torchrun; batch_size stays the "
        "global batch. At most BERT_JOB_MAX_DEVICES.",
    )
    max_runtime: Duration | None = Field(
        None,
        description="Training time allowed, summed over attempts: seconds, or a duration such as '90m', "
        "'12h', '1d12h'. Past it the job saves a checkpoint and fails with \"time limit\". "
        "At most BERT_JOB_MAX_RUNTIME, which is also the default.",
    )

    if TYPE_CHECKING:
        # The options' fields are added by create_model (option_fields, from model/options.py), which
        # mypy cannot see; to it they read as Any here and on every subclass.
        def __getattr__(self, name: str) -> Any: ...

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.warmup_steps is not None and self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise invalid(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        if self.eval_every and not self.eval_fraction:
            raise invalid("eval_every needs eval_fraction > 0 (there is nothing to evaluate on)")
        return self

    def to_record(self) -> dict[str, Any]:
        """What the job stores: the parameters the request set, and the service's own (devices, max_runtime)."""
        return {**self.model_dump(exclude_unset=True), "devices": self.devices, "max_runtime": self.max_runtime}


# Only the parameters a request sets are stored with its job; the run gives the others the defaults shown,
# the same `bert pretrain` / `bert finetune` give (model/options.py).
_UNSET_DEFAULTS = (
    "Parameters left out take the defaults shown, the same as the `bert {}` command's (per task "
    "where a description says so)."
)
TrainParams = create_model(
    "TrainParams",
    __base__=_TrainParams,
    __module__=__name__,
    __doc__=_TrainParams.__doc__,
    **option_fields("pretrain", _SHARED),
)

assert set(TASKS) <= set(KINDS_OF_TASK)  # every fine-tuning task names the dataset kinds it trains on


class _FinetuneParams(TrainParams):
    @model_validator(mode="after")
    def _task_options(self) -> Self:
        if self.regression and self.task != "sequence-classification":
            raise invalid(f"regression is for task sequence-classification, not {self.task}")
        if self.task != "question-answering":
            if self.doc_stride is not None:
                raise invalid(f"doc_stride is for task question-answering, not {self.task}")
            return self
        try:
            check_window(self.max_seq_len, self.max_query_length, self.doc_stride or 0)
        except WindowMisfit as e:
            if e.no_room:
                raise invalid(
                    f"max_seq_len ({self.max_seq_len}) leaves no room for the context beside a question "
                    f"of max_query_length ({self.max_query_length}) and {SPECIAL_TOKENS_IN_A_PAIR} special tokens"
                ) from None
            raise invalid(
                f"doc_stride ({self.doc_stride}) must be less than the {e.room} context tokens a window "
                f"of max_seq_len {self.max_seq_len} holds beside a question of max_query_length "
                f"{self.max_query_length}"
            ) from None
        return self


FinetuneParams = create_model(
    "FinetuneParams",
    __base__=_FinetuneParams,
    __module__=__name__,
    __doc__=_UNSET_DEFAULTS.format("finetune"),
    **option_fields("finetune", [n for n in _job_option_names("finetune") if n not in _SHARED]),
)


class ModelSize(Strict):
    """The size of a model pretrained from scratch (BERT-base: 768, 12, 12, 3072, 512)."""

    hidden_size: int = Field(256, ge=8, le=4096)
    num_hidden_layers: int = Field(4, ge=1, le=48)
    num_attention_heads: int = Field(4, ge=1, le=64)
    intermediate_size: int = Field(1024, ge=8, le=16384)
    max_position_embeddings: int = Field(512, ge=16, le=4096)

    @model_validator(mode="after")
    def _heads_divide(self) -> Self:
        if self.hidden_size % self.num_attention_heads:
            raise invalid(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        return self


class _PretrainParams(TrainParams):
    config: ModelSize | None = Field(None, description="From scratch only: the model's size.")
    vocab_size: int | None = Field(
        None, ge=32, le=200_000, description="From scratch only: WordPiece vocabulary learnt from the corpus."
    )
    lowercase: bool | None = Field(None, description="From scratch only: lowercase the vocabulary.")


PretrainParams = create_model(
    "PretrainParams",
    __base__=_PretrainParams,
    __module__=__name__,
    __doc__=_UNSET_DEFAULTS.format("pretrain"),
    **option_fields("pretrain", [n for n in _job_option_names("pretrain") if n not in _SHARED]),
)


PRIORITY_FIELD = Field(
    DEFAULT_PRIORITY,
    ge=PRIORITY_MIN,
    le=PRIORITY_MAX,
    description=(
        "Higher runs first; equal priorities run in the order they came. A job of higher priority that finds every "
        "worker busy makes the lowest-priority running job hand its worker back (it resumes later from its "
        "checkpoint). At most BERT_JOB_MAX_PRIORITY."
    ),
)


class PretrainJobRequest(Strict):
    kind: Literal["pretrain"]
    model_name: Name = Field(description="Name of the model to publish in DATA_DIR/models/.")
    base_model: Name | None = Field(None, description="Continue pretraining this model; omitted: from scratch.")
    dataset: Name = Field(description="A corpus uploaded with POST /datasets.")
    params: PretrainParams = Field(default_factory=PretrainParams)
    priority: int = PRIORITY_FIELD


class FinetuneJobRequest(Strict):
    kind: Literal["finetune"]
    model_name: Name = Field(description="Name of the classifier to publish in DATA_DIR/models/.")
    base_model: Name = Field(description="The model whose encoder is fine-tuned.")
    dataset: Name = Field(description="A labelled dataset uploaded with POST /datasets.")
    params: FinetuneParams = Field(default_factory=FinetuneParams)
    priority: int = PRIORITY_FIELD


CreateJobRequest = Annotated[PretrainJobRequest | FinetuneJobRequest, Field(discriminator="kind")]

CREATE_EXAMPLE = {
    "kind": "finetune",
    "model_name": "reviews-clf",
    "base_model": "bert-tiny",
    "dataset": "reviews",
    "params": {"max_steps": 200, "batch_size": 16, "lr": 5e-5, "save_every": 50},
}


# -- responses ---------------------------------------------------------------------------------

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
assert set(get_args(JobState)) == set(STATES)


class CreateJobResponse(BaseModel):
    id: str
    state: JobState
    status_url: str


class JobStatus(BaseModel):
    """A job as job.json has it, with the latest progress flattened in."""

    id: str
    kind: Literal["pretrain", "finetune", "import", "batch"]
    state: JobState
    model_name: str | None = Field(description="The model it publishes, or a batch runs on; null for a dataset import.")
    base_model: str | None
    dataset: str | None = Field(
        description="The training data (training jobs), the dataset a dataset import makes; null for a model import "
        "or a batch."
    )
    params: dict[str, Any]
    step: int = Field(description="Optimizer steps done (as of the latest progress report).")
    total_steps: int
    loss: float | None = Field(description="Mean training loss over the latest logging window.")
    lr: float | None
    tokens_per_s: float | None
    eta_s: float | None = Field(description="Seconds to go at the current pace (running jobs only).")
    epoch: float | None
    rank_tokens_per_s: list[float] | None = Field(
        None, description="Tokens/s of each process, rank 0 first (jobs with devices > 1)."
    )
    latest_checkpoint: str | None = Field(description="Relative to the job directory, e.g. checkpoints/step-200.")
    attempts: int = Field(description="Times a worker started the job (a worker death costs one).")
    runtime_s: float | None = Field(description="Training time so far, summed over attempts (max_runtime counts this).")
    estimate: dict[str, Any] | None = Field(
        description="The size POST /jobs estimated (model/sizing.py): parameters and peak training memory."
    )
    cancel_requested: bool
    error: str | None = Field(
        description="Why the job failed; while it runs, why its last attempt was lost "
        "(e.g. the worker process was killed)."
    )
    eval: dict[str, Any] | None = Field(description="The latest evaluation (fine-tuning).")
    result: dict[str, Any] | None = Field(description="Set on success: the published model and final numbers.")
    created_at: str
    enqueued_at: str | None
    started_at: str | None
    finished_at: str | None
    updated_at: str
    heartbeat_at: str | None = Field(description="Last sign of life of the training process (running jobs).")
    worker: str | None
    owner: str = Field(
        LEGACY_OWNER, description="The name of the key that made the job (`admin` for jobs from before keys had names)."
    )
    events: list[dict[str, Any]]
    downloaded_bytes: int | None = Field(None, description="An import's bytes downloaded so far.")
    total_bytes: int | None = Field(None, description="An import's bytes to download in all.")
    status_url: str
    metrics_url: str
    disk_bytes: int | None = Field(None, description="Bytes its directory holds (checkpoints, mostly).")
    priority: int = Field(description="Higher runs first (training jobs); see POST /jobs.")
    queue_position: int | None = Field(
        None, description="A queued training job's place in the queue, 1 = next (GET /jobs/{id} only)."
    )
    waiting_for: str | None = Field(
        None,
        description="What a queued training job waits for: the queued jobs ahead and the running job(s) "
        "(id, priority, step of total), or a free worker (GET /jobs/{id} only).",
    )
    start_estimate_s: float | None = Field(
        None,
        description="Seconds until a queued job starts, from the pace of the running job it waits for; null when "
        "none can be had (GET /jobs/{id} only).",
    )

    @classmethod
    def from_record(
        cls, record: Mapping[str, Any], disk_bytes: int | None = None, place: Mapping[str, Any] | None = None
    ) -> JobStatus:
        """The answer for a job record (datadir's job.json); `place`: a queued job's position
        (datadir.scheduling.queue_place)."""
        progress = record.get("progress") or {}
        running = record["state"] == "running"
        step, total_steps = steps_of(record)
        return cls(
            **{
                k: record.get(k)
                for k in (
                    "id",
                    "kind",
                    "state",
                    "model_name",
                    "base_model",
                    "dataset",
                    "params",
                    "attempts",
                    "runtime_s",
                    "estimate",
                    "error",
                    "eval",
                    "result",
                    "created_at",
                    "enqueued_at",
                    "started_at",
                    "finished_at",
                    "updated_at",
                    "worker",
                    "latest_checkpoint",
                )
            },
            cancel_requested=bool(record.get("cancel_requested")),
            events=[_shown(e) for e in record.get("events") or []],
            owner=owner_of(record),
            heartbeat_at=record.get("heartbeat_at") if running else None,
            step=step,
            total_steps=total_steps,
            loss=progress.get("loss"),
            lr=progress.get("lr"),
            tokens_per_s=progress.get("tokens_per_s"),
            eta_s=progress.get("eta_s") if running else None,
            epoch=progress.get("epoch"),
            rank_tokens_per_s=progress.get("rank_tokens_per_s"),
            downloaded_bytes=progress.get("downloaded_bytes"),
            total_bytes=progress.get("total_bytes"),
            status_url=f"/jobs/{record['id']}",
            metrics_url=f"/jobs/{record['id']}/metrics",
            disk_bytes=disk_bytes,
            priority=record.get("priority", DEFAULT_PRIORITY),
            **(place or {}),
        )


def _shown(event: dict[str, Any]) -> dict[str, Any]:
    """An entry of the job's `events` as answers show it: when, what and its words. The fields the records
    keep for the scheduler (the job a running one made way for, and its owner) are another key's."""
    return {k: event[k] for k in ("at", "event", "detail") if k in event}


class JobsResponse(BaseModel):
    jobs: list[JobStatus]


class JobMetricsResponse(BaseModel):
    id: str
    records: list[dict[str, Any]] = Field(description='metrics.jsonl: {"type": "train"|"eval"|"resume", "step", ...}')
