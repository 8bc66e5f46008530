"""The types of /jobs (app/api/routes/jobs.py): a training job's request, whose parameters are built
from model/options.py's table (so the API, the `bert` command and the console's form share one
declaration of each option), a mine-negatives job's request (sentence-transformers' mining options), and a
job's status as GET /jobs/{id} answers it (imports, batches and mining are jobs too).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, get_args

from pydantic import AfterValidator, BaseModel, Field, create_model, model_validator
from pydantic.json_schema import JsonDict

from app.schemas.shared import Name, Strict, invalid
from datadir import JOB_KINDS, STATES
from datadir.datasets import KINDS_OF_TASK
from datadir.jobs import LEGACY_OWNER, owner_of, phase_of, steps_of
from datadir.scheduling import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from model.data.question_answering import WindowMisfit, check_window
from model.options import TASKS, Option, check_task_options, defaults, format_default, options_for
from model.tokenizer import SPECIAL_TOKENS_IN_A_PAIR
from model.training.hard_negatives import MiningOptions
from model.training.sentence_embedding import check_embedding_options

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
    annotation: Any = Literal[o.choices] if o.choices else o.items or o.type  # a type expression built at runtime
    b = o.bounds(kind)
    constraints: dict[str, Any] = {
        k: v
        for k, v in {"ge": b.get("minimum"), "le": b.get("maximum"), "gt": b.get("above"), "lt": b.get("below")}.items()
        if v is not None
    }
    if o.items is not None:  # a list: the bounds are each item's, and it holds at least one
        annotation = list[Annotated[annotation, Field(**constraints)]]
        constraints = {"min_length": 1}
    if o.nullable:
        annotation = annotation | None
    description = o.help[0].upper() + o.help[1:] + "."
    extra: JsonDict | None = None
    if kind == "finetune" and o.by_task:
        description += f" Default: {format_default(o, kind)}."
        extra = {"x-task-defaults": {task: o.default_for(kind, task) for task in TASKS}}
    default = o.default_for(kind)
    default = list(default) if isinstance(default, tuple) else default  # a list option's default, as JSON has it
    return annotation, Field(default, description=description, json_schema_extra=extra, **constraints)


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

assert set(TASKS) == set(KINDS_OF_TASK)  # every fine-tuning task names the dataset kinds it trains on, and no more


class _FinetuneParams(TrainParams):
    @model_validator(mode="after")
    def _task_options(self) -> Self:
        try:  # an option of another task (model/options.py's `tasks`), set to other than its default
            check_task_options(self.task, {name: getattr(self, name) for name in self.model_fields_set})
        except ValueError as e:
            raise invalid(str(e)) from None
        if self.task == "sentence-embedding":
            return self._embedding_options()
        if self.task != "question-answering":
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

    def _embedding_options(self) -> Self:
        """What can be checked without the dataset and the base model (the job service checks the rest)."""
        if self.cached and self.devices > 1:
            raise invalid(f"cached (GradCache) trains in one process, not on devices {self.devices}")
        names = ("loss", "scale", "directions", "partition_mode", "cached", "mini_batch_size", "matryoshka_dims")
        try:
            check_embedding_options({n: getattr(self, n) for n in names}, defaults("finetune", self.task))
        except ValueError as e:
            raise invalid(str(e)) from None
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
    eval_dataset: Name | None = Field(
        None,
        description="Evaluate on this dataset instead of holding out params.eval_fraction of `dataset`: one of "
        "the same kind, or (task sentence-embedding or sparse-embedding on pairs) a retrieval set.",
    )
    params: FinetuneParams = Field(default_factory=FinetuneParams)
    priority: int = PRIORITY_FIELD


class MineNegativesParams(Strict):
    """How negatives are chosen: sentence-transformers' `mine_hard_negatives` options, with its names and
    defaults except range_min (10 here, 0 there: the nearest texts are often unlabelled positives)."""

    num_negatives: int = Field(
        3, ge=1, description="Negatives each row gets (negative_1 .. negative_n); at most BERT_MINE_MAX_NEGATIVES."
    )
    range_min: int = Field(10, ge=0, description="The nearest candidates skipped (after the filters), best first.")
    range_max: int | None = Field(
        None,
        ge=1,
        description="The deepest rank looked at. Default: range_min + num_negatives + the most positives an anchor "
        "has (10 x num_negatives with a margin or max_score). At most BERT_MINE_MAX_RANGE.",
    )
    max_score: float | None = Field(None, description="Candidates with a higher cosine to the anchor are skipped.")
    min_score: float | None = Field(None, description="Candidates with a lower cosine to the anchor are skipped.")
    absolute_margin: float | None = Field(
        None,
        description="Candidates scoring above (the anchor's lowest positive score - absolute_margin) are skipped; "
        "0: every negative scores below every positive.",
    )
    relative_margin: float | None = Field(
        None,
        description="Candidates scoring above (the lowest positive score - |that score| x relative_margin) are "
        "skipped; 0.05 keeps those at least 5% below it (NV-Retriever's TopK-PercPos).",
    )
    sampling_strategy: Literal["top", "random"] = Field(
        "top", description="top: the best candidates left; random: num_negatives of them drawn at random."
    )
    seed: int | None = Field(
        None, ge=0, le=2**31 - 1, description="random's generator seed. Default: drawn, and kept with the job."
    )
    query_prompt_name: str | None = Field(
        None,
        max_length=200,
        description="The model's prompt put before each anchor. Default: its 'query' prompt if it has one, else "
        "none, not even its default prompt (as sentence-transformers' mining embeds anchors: encode_query).",
    )
    query_prompt: str | None = Field(None, max_length=2000, description="A literal prompt put before each anchor.")
    corpus_prompt_name: str | None = Field(
        None,
        max_length=200,
        description="The model's prompt put before each corpus text. Default: its 'document' prompt if it has one, "
        "else none (encode_document).",
    )
    corpus_prompt: str | None = Field(
        None, max_length=2000, description="A literal prompt put before each corpus text."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for side in ("query", "corpus"):
            if getattr(self, f"{side}_prompt_name") is not None and getattr(self, f"{side}_prompt") is not None:
                raise invalid(f"send {side}_prompt_name or {side}_prompt, not both")
        try:
            self.options(0).check()
        except ValueError as e:
            raise invalid(str(e)) from None
        return self

    def options(self, seed: int) -> MiningOptions:
        return MiningOptions(
            **self.model_dump(include=set(MINING_OPTIONS) - {"seed"}),
            seed=self.seed if self.seed is not None else seed,
        )


MINING_OPTIONS = tuple(f.name for f in dataclasses.fields(MiningOptions))
assert set(MINING_OPTIONS) <= set(MineNegativesParams.model_fields)


class MineNegativesJobRequest(Strict):
    kind: Literal["mine-negatives"]
    model: Name = Field(description="The embedding model (as /embeddings embeds with it: its pooling and prompts).")
    dataset: Name = Field(description="A pairs dataset: its anchors get negatives; its rows' positives are theirs.")
    corpus: Name | None = Field(
        None,
        description="What negatives are mined from besides the positives: a pairs dataset (its positives and "
        "negatives) or a retrieval set (its documents). Default: the dataset's own negatives.",
    )
    name: Name = Field(description="The pairs dataset to publish (a new name).")
    params: MineNegativesParams = Field(default_factory=MineNegativesParams)


CreateJobRequest = Annotated[
    PretrainJobRequest | FinetuneJobRequest | MineNegativesJobRequest, Field(discriminator="kind")
]

CREATE_EXAMPLE = {
    "kind": "finetune",
    "model_name": "reviews-clf",
    "base_model": "bert-tiny",
    "dataset": "reviews",
    "params": {"max_steps": 200, "batch_size": 16, "lr": 5e-5, "save_every": 50},
}

MINE_EXAMPLE = {
    "kind": "mine-negatives",
    "model": "minilm",
    "dataset": "faq-pairs",
    "name": "faq-hard",
    "params": {"num_negatives": 3, "range_min": 0, "relative_margin": 0.05},
}


# -- responses ---------------------------------------------------------------------------------

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
assert set(get_args(JobState)) == set(STATES)
JobKind = Literal["pretrain", "finetune", "import", "batch", "mine-negatives"]
assert get_args(JobKind) == JOB_KINDS


class CreateJobResponse(BaseModel):
    id: str
    state: JobState
    status_url: str


class JobStatus(BaseModel):
    """A job as job.json has it, with the latest progress flattened in."""

    id: str
    kind: JobKind
    state: JobState
    model_name: str | None = Field(description="The model it publishes, or a batch runs on; null for a dataset import.")
    base_model: str | None
    dataset: str | None = Field(
        description="The training data (training jobs), the dataset a dataset import makes; null for a model import "
        "or a batch."
    )
    eval_dataset: str | None = Field(None, description="A fine-tuning job's evaluation data, when not held out.")
    params: dict[str, Any]
    step: int = Field(description="Optimizer steps done (as of the latest progress report).")
    total_steps: int
    loss: float | None = Field(description="Mean training loss over the latest logging window.")
    lr: float | None
    tokens_per_s: float | None
    eta_s: float | None = Field(description="Seconds to go at the current pace (running jobs only).")
    phase: str | None = Field(
        None,
        description="What a running job does before its first step report: loading the model, learning the "
        "vocabulary, tokenising the corpus (with the bytes read of all), training until that report; null after.",
    )
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
                    "eval_dataset",
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
            phase=phase_of(record),
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
