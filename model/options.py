"""Training options, declared once: name, type, default per job kind (and per fine-tuning task where it
differs), bounds, choices, help, and where each is accepted.

Everything else is built from `OPTIONS`: TrainConfig's and the run specs' defaults (model/training/trainer.py,
model/training/runs.py), TrainConfig's checks (`check_value`), the API's job parameters (app/schemas/jobs.py),
the `bert pretrain` / `bert finetune` flags (app/cli/train_commands.py), the worker's pass-through
(worker/recipes.py), the console's job form and the configuration reference (`options_markdown`).
Standard library only, so `bert --help` reads it without importing torch.

Defaults follow BERT (Devlin et al. 2018, appendix A): fine-tuning picks lr from {5e-5, 3e-5, 2e-5},
batch 32, 2-4 epochs, 10% warmup; pretraining uses lr 1e-4 with 10k warmup steps of 1M, scaled here to
runs of a thousand steps. Sentence-embedding training takes sentence-transformers 6.x's: its losses'
defaults (scale 20, query_to_doc, joint, GradCache's mini-batch 32), and its training examples' one epoch,
lr 2e-5 and 10% warmup, with a batch of 64 (in-batch negatives learn more from a larger one) and the
base model evaluated first (eval_on_start), so its scores before and after training stand side by side.
"""

from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass, field
from typing import Any

KINDS = ("pretrain", "finetune")
TASKS = (
    "sequence-classification",
    "token-classification",
    "question-answering",
    "sentence-embedding",
    "cross-encoder",
    "late-interaction",
    "sparse-embedding",
)
PRECISIONS = ("fp32", "bf16", "int8")  # what a model runs in (int8: dynamic quantisation, inference only)
IMPORT_POOLINGS = ("splade",)  # what an import may say of a model whose files do not (model.model_dir.import_model)
TRAIN_PRECISIONS = ("auto", "fp32", "bf16")  # autocast modes a run trains in; auto: bf16 on CUDA, fp32 on CPU
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")  # in-batch negatives' similarities
PARTITION_MODES = ("joint", "per_direction")  # one softmax over the directions, or one per direction
BASE_PREFIX = "base_"  # eval_on_start: an evaluation's base_<metric> is that metric of the model before training


@dataclass(frozen=True)
class Option:
    name: str  # the TrainConfig / spec field, the job parameter, and the flag (--name-with-dashes)
    type: type  # int, float, bool or str; list for a list of `items` (a JSON array, a comma-separated flag)
    help: str
    default: Any = None  # for every kind it applies to, unless `by_kind` says otherwise
    by_kind: dict[str, Any] = field(default_factory=dict)  # kind -> default
    by_task: dict[str, Any] = field(default_factory=dict)  # fine-tuning task -> default
    kinds: tuple[str, ...] = KINDS
    trainer: bool = True  # a TrainConfig field (else a PretrainSpec / FinetuneSpec field)
    job: bool = True  # accepted by POST /jobs (else `bert` only: paths, columns, the local device)
    cli: bool = True  # a flag of its own (warmup_steps and warmup_ratio share `bert`'s --warmup)
    nullable: bool = False  # None is a value (e.g. "from the other option")
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive minimum
    below: float | None = None  # exclusive maximum
    choices: tuple[str, ...] | None = None
    bounds_by_kind: dict[str, dict[str, float | None]] = field(default_factory=dict)  # kind -> bounds it changes
    flag: str | None = None  # the CLI flag when it is not --name-with-dashes
    items: builtins.type | None = None  # a list option's items: int or str (its choices and bounds are each item's)
    tasks: tuple[str, ...] | None = None  # the fine-tuning tasks it is for (None: all); others refuse a value

    def bounds(self, kind: str | None) -> dict[str, float]:
        """{minimum, maximum, above, below} of `kind` (None: without any kind's own), those that are set."""
        values = {
            "minimum": self.minimum,
            "maximum": self.maximum,
            "above": self.above,
            "below": self.below,
            **(self.bounds_by_kind.get(kind, {}) if kind else {}),
        }
        return {k: v for k, v in values.items() if v is not None}

    def default_for(self, kind: str, task: str | None = None) -> Any:
        if kind == "finetune" and task in self.by_task:
            return self.by_task[task]
        return self.by_kind.get(kind, self.default)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


def task_option(name: str, type_: type, help: str, *, tasks: tuple[str, ...], **fields: Any) -> Option:
    """An option of some fine-tuning tasks only: a FinetuneSpec field, not a TrainConfig one."""
    return Option(name, type_, help, kinds=("finetune",), trainer=False, tasks=tasks, **fields)


OPTIONS: tuple[Option, ...] = (
    # -- length of the run ------------------------------------------------------------------------
    Option(
        "max_steps",
        int,
        "optimizer steps to train; unset: `epochs` passes over the data",
        nullable=True,
        by_kind={"pretrain": 1000, "finetune": None},  # pretrain: BERT's 1M steps scaled to a small run
        minimum=1,
        maximum=1_000_000,
    ),
    Option(
        "epochs",
        float,
        "passes over the data, used when max_steps is unset",
        nullable=True,
        by_kind={"pretrain": None, "finetune": 3.0},  # BERT: 2-4 epochs; 3 is the middle
        # sentence-transformers' (and PyLate's) training examples
        by_task={"sentence-embedding": 1.0, "cross-encoder": 1.0, "late-interaction": 1.0, "sparse-embedding": 1.0},
        above=0.0,
        maximum=1000.0,
    ),
    # -- optimiser -----------------------------------------------------------------------------
    Option(
        "lr",
        float,
        "peak learning rate, reached at the end of warmup",
        by_kind={"pretrain": 1e-4, "finetune": 2e-5},  # BERT: 1e-4 pretraining; 2e-5, the grid's safest
        by_task={"question-answering": 5e-5},  # BERT's SQuAD v1.1 run: 5e-5, 3 epochs, batch 32
        above=0.0,
        maximum=1.0,
    ),
    Option(
        "warmup_ratio",
        float,
        "share of the run's steps to warm the learning rate up over (when warmup_steps is unset)",
        by_kind={"pretrain": 0.01, "finetune": 0.1},  # BERT: 10k of 1M steps (1%); fine-tuning 10%
        minimum=0.0,
        below=1.0,
        cli=False,
    ),
    Option(
        "warmup_steps",
        int,
        "linear warmup in steps; unset: warmup_ratio of the run",
        nullable=True,
        minimum=0,
        maximum=1_000_000,
        cli=False,
    ),  # unset, so the ratio scales with the run's length
    Option(
        "weight_decay",
        float,
        "AdamW decoupled weight decay, on weight matrices only",
        default=0.01,  # BERT's
        minimum=0.0,
        maximum=1.0,
    ),
    Option(
        "grad_accum_steps",
        int,
        "micro-batches per optimizer step: effective batch = batch_size x this",
        default=1,
        minimum=1,
        maximum=1024,
        flag="--grad-accum",
    ),  # one step per batch, as BERT
    Option(
        "max_grad_norm",
        float,
        "clip the global gradient norm to this; unset: no clipping",
        default=1.0,  # BERT's
        nullable=True,
        above=0.0,
        maximum=1e6,
    ),
    Option(
        "seed", int, "seed of init, data order, masking and dropout", default=0, minimum=0, maximum=2**31 - 1
    ),  # any fixed seed makes runs repeatable
    # -- batches (spec fields) -------------------------------------------------------------------
    Option(
        "batch_size",
        int,
        "examples per micro-batch, over all devices (a step takes grad_accum_steps of them)",
        default=32,
        by_task={"sentence-embedding": 64},  # in-batch negatives: every other row's texts are negatives
        trainer=False,
        minimum=1,
        maximum=4096,
    ),  # BERT fine-tuning's 32; pretraining's 256 needs more memory
    Option(
        "max_seq_len",
        int,
        "tokens per example, [CLS] and [SEP] included",
        default=128,
        trainer=False,
        minimum=8,
        maximum=4096,
    ),  # BERT's first 90% of pretraining; fits most sentence tasks
    Option(
        "eval_fraction",
        float,
        "share held out for evaluation when no eval data is given (0: none)",
        by_kind={"pretrain": 0.02, "finetune": 0.1},  # pretrain: documents (capped); finetune: rows
        trainer=False,
        minimum=0.0,
        maximum=0.5,
        bounds_by_kind={"finetune": {"minimum": None, "above": 0.0}},
    ),  # fine-tuning picks its best checkpoint on them
    # -- pretraining ---------------------------------------------------------------------------
    Option(
        "nsp",
        bool,
        "next-sentence prediction beside masked LM (BertForPreTraining); false: MLM only",
        default=True,
        kinds=("pretrain",),
        trainer=False,
    ),  # BERT's two objectives
    Option(
        "masked_lm_prob",
        float,
        "share of tokens masked for the MLM objective",
        default=0.15,  # BERT's 15%
        kinds=("pretrain",),
        trainer=False,
        minimum=0.01,
        maximum=0.5,
        flag="--mlm-probability",
    ),
    Option(
        "whole_word_mask",
        bool,
        "mask every piece of a chosen word together",
        default=False,  # BERT's first release
        kinds=("pretrain",),
        trainer=False,
    ),
    Option(
        "freeze_encoder",
        bool,
        "warm start: train only the heads (and pooler); the encoder stays as loaded",
        default=False,
        kinds=("pretrain",),
        trainer=False,
    ),  # full training is what BERT does
    # -- fine-tuning ---------------------------------------------------------------------------
    Option(
        "task",
        str,
        "sequence-classification (a labelled table), token-classification (NER; best checkpoint "
        "by entity f1), question-answering (SQuAD; best checkpoint by f1), sentence-embedding (pairs or "
        "scored pairs; best checkpoint by cosine_ndcg@10 or spearman_cosine) or cross-encoder (a reranker: "
        "pairs, scored pairs or labelled pairs; best checkpoint by rerank_ndcg@10, spearman or f1), late-interaction "
        "(a ColBERT, as PyLate trains one: pairs; best checkpoint by MaxSim_ndcg@10) or sparse-embedding (SPLADE, "
        "from a model with an MLM head: pairs; best checkpoint by dot_ndcg@10)",
        default="sequence-classification",
        kinds=("finetune",),
        trainer=False,
        choices=TASKS,
    ),  # the common case
    task_option(
        "regression",
        bool,
        "sequence-classification: float labels, one output, MSE loss (a reranker trains better as a cross-encoder)",
        default=False,
        tasks=("sequence-classification",),
    ),  # labels are classes
    task_option(
        "doc_stride",
        int,
        "question-answering: context tokens that windows of a long context share; unset: "
        "128, or half a short window's context",
        nullable=True,
        minimum=0,
        maximum=4096,
        tasks=("question-answering",),
    ),  # BERT's SQuAD script: 128
    Option(
        "max_query_length",
        int,
        "question-answering: question tokens kept",
        default=64,  # BERT's SQuAD script
        kinds=("finetune",),
        trainer=False,
        minimum=1,
        maximum=4096,
    ),
    Option(
        "max_answer_len",
        int,
        "question-answering evaluation: the longest answer, in tokens",
        default=30,
        kinds=("finetune",),
        trainer=False,
        minimum=1,
        maximum=4096,
    ),  # BERT's SQuAD script
    # -- sentence embeddings and cross-encoders: sentence-transformers 6.x's losses and their defaults --------
    # (model/training/sentence_embedding.py and model/training/cross_encoder.py)
    task_option(
        "loss",
        str,
        "sentence-embedding: mnrl (in-batch negatives; pairs) or cosent (scored pairs); cross-encoder: bce "
        "(binary cross-entropy on each pair's label or score; a pairs file gives its positive 1 and each "
        "negative 0) or mnrl (each anchor's positive against its negatives: in-batch and given); unset: mnrl "
        "for pairs, cosent (sentence-embedding) or bce (cross-encoder) otherwise",
        nullable=True,
        choices=("mnrl", "cosent", "bce"),
        tasks=("sentence-embedding", "cross-encoder"),
    ),
    task_option(
        "num_negatives",
        int,
        "cross-encoder mnrl: negatives drawn for each anchor from the other rows of its batch",
        default=4,  # sentence-transformers' CrossEncoder MultipleNegativesRankingLoss
        minimum=0,
        maximum=1024,
        tasks=("cross-encoder",),
    ),
    task_option(
        "scale",
        float,
        "sentence-embedding: the loss's similarity scale (the inverse of a softmax temperature); cross-encoder "
        "mnrl: sigmoid(logit) times this are the softmax's logits; late-interaction: MaxSim scores times this "
        "(PyLate's Contrastive temperature is 1 / scale)",
        default=20.0,  # MultipleNegativesRankingLoss's and CoSENTLoss's
        # sentence-transformers' CrossEncoder MultipleNegativesRankingLoss; PyLate's Contrastive (temperature 1)
        by_task={"cross-encoder": 10.0, "late-interaction": 1.0},
        above=0.0,
        maximum=1000.0,
        tasks=("sentence-embedding", "cross-encoder", "late-interaction"),
    ),
    task_option(
        "directions",
        list,
        "sentence-embedding, mnrl: the similarities each softmax ranks the positive among: query_to_doc, and "
        "any of query_to_query, doc_to_query, doc_to_doc (symmetric: query_to_doc,doc_to_query)",
        default=("query_to_doc",),  # the classic in-batch negatives loss
        items=str,
        choices=DIRECTIONS,
        tasks=("sentence-embedding",),
    ),
    task_option(
        "partition_mode",
        str,
        "sentence-embedding, mnrl: one softmax over every direction's similarities (joint) or one per "
        "direction, averaged (per_direction)",
        default="joint",
        choices=PARTITION_MODES,
        tasks=("sentence-embedding",),
    ),
    task_option(
        "cached",
        bool,
        "sentence-embedding, mnrl: GradCache (CachedMultipleNegativesRankingLoss): the same loss and gradients "
        "in the memory of mini_batch_size texts, for batches of thousands",
        default=False,
        tasks=("sentence-embedding",),
    ),
    task_option(
        "mini_batch_size",
        int,
        "sentence-embedding, cached: texts embedded at a time",
        default=32,  # CachedMultipleNegativesRankingLoss's
        minimum=1,
        maximum=4096,
        tasks=("sentence-embedding",),
    ),
    task_option(
        "matryoshka_dims",
        list,
        "sentence-embedding: also train the embedding's first N components alone, for each N (descending, "
        "at most the model's size; MatryoshkaLoss), e.g. 384,256,128,64",
        nullable=True,
        items=int,
        minimum=1,
        maximum=65536,
        tasks=("sentence-embedding",),
    ),
    task_option(
        "pos_weight",
        float,
        "cross-encoder bce: the weight of a positive's loss (e.g. the negatives per positive); unset: 1",
        nullable=True,  # sentence-transformers' BinaryCrossEntropyLoss: None
        above=0.0,
        maximum=10000.0,
        tasks=("cross-encoder",),
    ),
    task_option(
        "retriever_model",
        str,
        "cross-encoder on pairs: the embedding model whose top 100 of the held-out documents the reranker "
        "reorders in evaluation (a job: a model name, default the service's default model; `bert`: a model "
        "directory); "
        "unset: every held-out document is a candidate",
        nullable=True,
        tasks=("cross-encoder",),
    ),
    task_option(
        "teacher_model",
        str,
        "late-interaction: a cross-encoder (a one-label classifier) whose logits for each anchor's positive and "
        "negatives the model learns, by PyLate's Distillation loss (KL divergence from the teacher's scores) "
        "instead of its Contrastive loss (a job: a model name; `bert`: a model directory); unset: Contrastive",
        nullable=True,
        tasks=("late-interaction",),
    ),
    # -- sparse embeddings (SPLADE): sentence-transformers 6.x's SpladeLoss and its weight scheduler --------
    # (model/training/sparse_embedding.py)
    task_option(
        "query_regularizer_weight",
        float,
        "sparse-embedding: the weight of the queries' FLOPS regulariser (more: fewer terms a query)",
        default=5e-5,  # sentence-transformers' SPLADE training examples (lambda_q)
        minimum=0.0,
        maximum=100.0,
        tasks=("sparse-embedding",),
    ),
    task_option(
        "document_regularizer_weight",
        float,
        "sparse-embedding: the weight of the documents' FLOPS regulariser (positives and negatives; more: "
        "fewer terms a document)",
        default=3e-5,  # sentence-transformers' SPLADE training examples (lambda_d)
        minimum=0.0,
        maximum=100.0,
        tasks=("sparse-embedding",),
    ),
    task_option(
        "regularizer_warmup_ratio",
        float,
        "sparse-embedding: share of the run's steps over which both regulariser weights grow from 0 "
        "(quadratically, as sentence-transformers' SpladeRegularizerWeightSchedulerCallback)",
        default=1 / 3,  # the callback's default warmup_ratio
        above=0.0,
        maximum=1.0,
        tasks=("sparse-embedding",),
    ),
    # -- checkpoints, evaluation, logging ---------------------------------------------------------
    Option(
        "save_every",
        int,
        "checkpoint every N steps (0: only at the end and on a stop request)",
        default=500,
        minimum=0,
        maximum=1_000_000,
    ),  # a crash loses minutes, not the run; keep_last bounds the disk
    Option(
        "keep_last", int, "checkpoints kept besides the best one", default=2, minimum=1, maximum=100
    ),  # one to resume from while the next is written
    Option(
        "eval_every", int, "evaluate every N steps (0: only at the end)", default=0, minimum=0, maximum=1_000_000
    ),  # evaluation costs a pass over the held-out data
    Option(
        "eval_on_start",
        bool,
        "also evaluate the starting model before the first step: the curve's first point, and base_<metric> "
        "beside each later evaluation's metric",
        default=False,
        # a job shows what it gained over its start
        by_task={"sentence-embedding": True, "cross-encoder": True, "late-interaction": True, "sparse-embedding": True},
    ),  # one more pass over the eval data
    Option(
        "log_every",
        int,
        "steps between progress reports (a metrics.jsonl line)",
        default=10,
        minimum=1,
        maximum=100_000,
    ),  # a readable curve without a line per step
    # -- where and how it computes ---------------------------------------------------------------
    Option(
        "precision",
        str,
        "bf16 autocast or fp32; auto: bf16 on CUDA, fp32 on CPU",
        default="auto",
        choices=TRAIN_PRECISIONS,
    ),  # bf16 is fast where it is native
    Option(
        "compile",
        bool,
        "torch.compile the training step (the first steps pay for compiling; measure first)",
        default=False,
    ),  # pays only on long runs of some models
    Option(
        "device", str, "cpu, cuda, cuda:N or auto (CUDA when there is one)", default="auto", job=False
    ),  # a job's device is its worker's (BERT_WORKER_DEVICE)
    Option(
        "text_column",
        str,
        "sequence-classification: the text column",
        default="text",
        kinds=("finetune",),
        trainer=False,
        job=False,
    ),  # an uploaded dataset's columns are fixed: text, text_pair, label
    Option(
        "text_pair_column",
        str,
        "sequence-classification: the second text's column, used when the file has it",
        default="text_pair",
        kinds=("finetune",),
        trainer=False,
        job=False,
    ),
    Option(
        "label_column",
        str,
        "sequence-classification: the label column",
        default="label",
        kinds=("finetune",),
        trainer=False,
        job=False,
    ),
    Option(
        "group_column",
        str,
        "hold out whole groups of this column (e.g. one film's reviews)",
        nullable=True,
        kinds=("finetune",),
        trainer=False,
        job=False,
    ),  # unset: rows are held out one by one
)

BY_NAME = {o.name: o for o in OPTIONS}
# TrainConfig's fields: the same in both kinds, and so are their bounds (TrainConfig checks them with no kind).
TRAINER_OPTIONS = tuple(o for o in OPTIONS if o.trainer)
assert all(o.kinds == KINDS and not o.bounds_by_kind for o in TRAINER_OPTIONS)


def options_for(kind: str, *, job: bool | None = None, trainer: bool | None = None) -> list[Option]:
    """The options of `kind`, in table order; `job` / `trainer` filter on those attributes."""
    if kind not in KINDS:
        raise ValueError(f"unknown job kind {kind!r}; expected one of {KINDS}")
    return [
        o
        for o in OPTIONS
        if kind in o.kinds and (job is None or o.job == job) and (trainer is None or o.trainer == trainer)
    ]


def defaults(kind: str, task: str | None = None, *, trainer: bool | None = None) -> dict[str, Any]:
    """{name: default} of `kind` (and fine-tuning `task`)."""
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    return {o.name: o.default_for(kind, task) for o in options_for(kind, trainer=trainer)}


def job_keys(kind: str, *, trainer: bool | None = None) -> tuple[str, ...]:
    """Names a job of `kind` accepts and passes to its run spec unchanged."""
    return tuple(o.name for o in options_for(kind, job=True, trainer=trainer))


def format_default(option: Option, kind: str) -> str:
    """The default as help and docs show it: `2e-05 (question-answering: 5e-05)`, `unset`."""
    text = _show(option.default_for(kind))
    if kind == "finetune" and option.by_task:
        text += " (" + ", ".join(f"{t}: {_show(v)}" for t, v in option.by_task.items()) + ")"
    return text


def check_value(option: Option, value: Any, kind: str | None = None) -> None:
    """A ValueError quoting `value` unless `option` takes it (in `kind`): None where it is nullable, else a
    value of its type (an int is a float too; a bool is neither) within its bounds, or one of its choices;
    for a list option, a non-empty list (or tuple) of such items. For code that builds a run without the
    API's or the CLI's parsing (TrainConfig, the run specs)."""
    if value is None and option.nullable:
        return
    if option.items is not None:
        if not isinstance(value, (list, tuple)) or not value or not all(_takes(option, v, kind) for v in value):
            raise ValueError(f"{option.name} must be a non-empty list of {_wanted(option, kind)}, got {value!r}")
        return
    if not _takes(option, value, kind):
        if option.choices is not None:
            raise ValueError(f"{option.name} must be one of {option.choices}, got {value!r}")
        raise ValueError(f"{option.name} must be {_wanted(option, kind)}, got {value!r}")


def check_task_options(task: str, values: dict[str, Any]) -> None:
    """A ValueError for an option of other fine-tuning tasks that `values` (option name -> value) gives a
    value other than its default: `doc_stride is for task question-answering, not token-classification`."""
    for o in OPTIONS:
        if o.tasks and task not in o.tasks and o.name in values:
            value, default = values[o.name], o.default_for("finetune", task)
            if _plain(value) != _plain(default):
                raise ValueError(f"{o.name} is for task {' or '.join(o.tasks)}, not {task}")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _takes(option: Option, value: Any, kind: str | None) -> bool:
    """One value (a list option's item) is of the option's type, within its bounds, or one of its choices."""
    if option.choices is not None:
        return value in option.choices
    kind_of = option.items or option.type
    return _of_type(kind_of, value) and all(_HOLDS[k](value, b) for k, b in option.bounds(kind).items())


def _wanted(option: Option, kind: str | None) -> str:
    if option.choices is not None:
        return " | ".join(option.choices)
    return " ".join(filter(None, (_TYPE_NAMES[option.items or option.type], bounds_text(option, kind))))


def type_name(option: Option) -> str:
    """`int`, or `list of int` for a list option."""
    return f"list of {option.items.__name__}" if option.items else option.type.__name__


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_HOLDS = {"minimum": operator.ge, "maximum": operator.le, "above": operator.gt, "below": operator.lt}


def _of_type(kind: type, value: Any) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def bounds_text(option: Option, kind: str | None) -> str:
    b = option.bounds(kind)
    parts = [
        f"{sign} {_show(b[key])}"
        for key, sign in (("minimum", ">="), ("above", ">"), ("maximum", "<="), ("below", "<"))
        if key in b
    ]
    parts.append(" | ".join(option.choices) if option.choices else "")
    return ", ".join(p for p in parts if p)


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # short, unless that would change it (1/3 is not 0.333333)
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)
    return str(value)


def _cell(text: str) -> str:
    """Text for a markdown table's cell: a choice's `|` escaped, so it does not end the cell."""
    return text.replace("|", "\\|")


def task_options_markdown(task: str) -> str:
    """One fine-tuning task's table: its own options (`tasks` naming it), then the defaults it changes."""
    rows = ["| option | flag | type | default | bounds | description |", "|---|---|---|---|---|---|"]
    own = [o for o in options_for("finetune") if o.tasks and task in o.tasks]
    changed = [o for o in options_for("finetune") if task in o.by_task and o not in own]
    for o in own + changed:
        help = o.help.removeprefix(f"{task}: ").removeprefix(f"{task}, ")
        rows.append(
            f"| `{o.name}` | `{o.cli_flag}` | {type_name(o)} | {_show(o.default_for('finetune', task))} | "
            f"{_cell(bounds_text(o, 'finetune'))} | {help} |"
        )
    return "\n".join(rows) + "\n"


def options_markdown() -> str:
    """The configuration reference: one markdown table per job kind."""
    out = []
    for kind in KINDS:
        out += [
            f"### {kind}",
            "",
            "| option | flag | type | default | bounds | job | description |",
            "|---|---|---|---|---|---|---|",
        ]
        for o in options_for(kind):
            flag = f"`{o.cli_flag}`" if o.cli else "`--warmup`"
            out.append(
                f"| `{o.name}` | {flag} | {type_name(o)} | {format_default(o, kind)} | "
                f"{_cell(bounds_text(o, kind))} | {'yes' if o.job else 'no'} | {o.help} |"
            )
        out.append("")
    return "\n".join(out)
