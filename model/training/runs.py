"""Training runs as functions: pretraining, fine-tuning and evaluation of a model directory.

The `bert` command and the Celery worker run the same code; only the callbacks differ (a progress
bar there, job-record updates in the worker):

    result = run_pretraining(PretrainSpec.from_dict(spec), callbacks=[progress])   # -> TrainResult
    result = run_finetuning(FinetuneSpec.from_dict(spec), callbacks=[progress])   # task: classification,
    metrics = evaluate_model("runs/x/model", "eval.csv")                         # tagging (NER), SQuAD QA
                                                                                  # or sentence embeddings

A spec is a plain dataclass (JSON in, via `from_dict`) naming the data, the starting model and the
run directory (`out`). A run directory holds metrics.jsonl, training.svg, checkpoints/step-N/ and,
when the run completes, model/ (a normal model directory). Running a spec again on the same
directory resumes from its latest complete checkpoint (`resume=False` refuses to touch a directory
that has one). User mistakes (missing files, bad options, data that does not fit) raise
`model.errors.UserError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from model import options
from model.compute.device import resolve_device
from model.compute.precision import resolve_precision
from model.config import BertConfig
from model.errors import UserError
from model.modeling import (
    MODEL_CLASSES,
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    load_model,
)
from model.tokenizer import BertTokenizer
from model.training import checkpoint as ckpt
from model.training import distributed
from model.training.callbacks import Callback
from model.training.evaluation import evaluate
from model.training.trainer import EvaluationSet, TrainConfig, Trainer, TrainResult, seed_everything
from model.weights import HEAD_NAMES, heads_in_dir

log = logging.getLogger(__name__)

# Model shapes for training from scratch (Turc et al. 2019 "Well-Read Students Learn Better": BERT-Tiny
# and BERT-Small; BERT-Base from the paper). vocab_size comes from the tokenizer.
MODEL_PRESETS: dict[str, Mapping[str, Any]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


# ---------------------------------------------------------------------------- specifications

# Spec fields that are options take their defaults from model/options.py (one column per kind).
_PRE, _FT = options.defaults("pretrain", trainer=False), options.defaults("finetune", trainer=False)


@dataclass
class PretrainSpec:
    corpus: str  # text corpus (pairs A<TAB>B, google, text, jsonl) or a token store directory (model/data/store.py)
    out: str  # run directory
    from_model: str | None = None  # warm start: any model directory (encoder weights kept, heads added)
    config: str | None = None  # from scratch: "tiny" | "small" | "base" | path to a config.json
    vocab: str | None = None  # tokenizer directory (needed with `config`; default: the from_model's)
    corpus_format: str | None = None  # None = detect from the file
    text_field: str = "text"  # JSONL field holding the text
    eval_corpus: str | None = None  # held-out corpus; None = hold out `eval_fraction` of the documents
    eval_fraction: float = _PRE["eval_fraction"]  # share of documents held out when there is no eval_corpus
    eval_max_documents: int = 1000  # cap on held-out documents, so evaluation stays quick
    nsp: bool = _PRE["nsp"]  # next-sentence prediction (BertForPreTraining); False = MLM only (BertForMaskedLM)
    batch_size: int = _PRE["batch_size"]
    max_seq_len: int = _PRE["max_seq_len"]
    masked_lm_prob: float = _PRE["masked_lm_prob"]
    whole_word_mask: bool = _PRE["whole_word_mask"]
    freeze_encoder: bool = _PRE["freeze_encoder"]  # train only the heads (and pooler); the encoder stays as loaded
    cache_dir: str | None = None  # token cache; None = beside the corpus if writable, else out/cache
    resume: bool = True  # continue from out/checkpoints when it has a complete checkpoint
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**options.defaults("pretrain", trainer=True)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PretrainSpec:
        return _spec_from_dict(cls, data)


TASKS = options.TASKS


@dataclass
class FinetuneSpec:
    # sequence-classification: CSV, TSV or JSONL with text[, text_pair], label columns;
    # token-classification: CoNLL columns or JSONL {tokens, tags}; question-answering: SQuAD JSON;
    # cross-encoder: pairs, scored pairs or labelled pairs (model/data/cross_encoder_data.py).
    # Any of them optionally .gz/.bz2.
    train_file: str
    from_model: str  # model directory to start from (with its tokenizer)
    out: str  # run directory
    task: str = _FT["task"]  # or "token-classification" (NER) or "question-answering" (SQuAD)
    eval_file: str | None = None  # None = hold out eval_fraction of train_file
    eval_fraction: float = _FT["eval_fraction"]
    group_column: str | None = _FT["group_column"]  # hold out whole groups (e.g. one film's reviews) when splitting
    text_column: str = _FT["text_column"]
    text_pair_column: str | None = _FT["text_pair_column"]  # used when the file has it
    label_column: str = _FT["label_column"]
    regression: bool = _FT["regression"]  # float labels, MSE loss, one output
    batch_size: int = _FT["batch_size"]
    max_seq_len: int = _FT["max_seq_len"]
    doc_stride: int | None = _FT["doc_stride"]  # QA: context tokens windows share; None = 128, less in short windows
    max_query_length: int = _FT["max_query_length"]  # QA: question tokens kept
    max_answer_len: int = _FT["max_answer_len"]  # QA evaluation: longest answer in tokens
    # sentence-embedding (model/training/sentence_embedding.py) and cross-encoder (model/training/cross_encoder.py)
    loss: str | None = _FT["loss"]  # None: mnrl on pairs; cosent (sentence-embedding) or bce (cross-encoder) otherwise
    scale: float = _FT["scale"]  # the similarity scale; cross-encoder mnrl: sigmoid(logit) * scale into the softmax
    directions: tuple[str, ...] = _FT["directions"]
    partition_mode: str = _FT["partition_mode"]
    cached: bool = _FT["cached"]
    mini_batch_size: int = _FT["mini_batch_size"]
    matryoshka_dims: tuple[int, ...] | None = _FT["matryoshka_dims"]
    num_negatives: int = _FT["num_negatives"]  # cross-encoder mnrl: in-batch negatives per anchor
    pos_weight: float | None = _FT["pos_weight"]  # cross-encoder bce: a positive's weight
    retriever_model: str | None = _FT["retriever_model"]  # cross-encoder on pairs: the first stage's model directory
    teacher_model: str | None = _FT["teacher_model"]  # late-interaction: a cross-encoder's directory (distillation)
    # sparse-embedding (model/training/sparse_embedding.py): SpladeLoss's weights and their warm-up
    query_regularizer_weight: float = _FT["query_regularizer_weight"]
    document_regularizer_weight: float = _FT["document_regularizer_weight"]
    regularizer_warmup_ratio: float = _FT["regularizer_warmup_ratio"]
    resume: bool = True
    # The default task's; from_dict and task_train_config give another task its own (model/options.py).
    train: TrainConfig = field(default_factory=lambda: task_train_config(TASKS[0]))

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; expected one of {', '.join(TASKS)}")
        spec_options = options.options_for("finetune", trainer=False)
        for option in spec_options:  # a JSON list is the tuple a spec holds
            if isinstance(getattr(self, option.name), list):
                setattr(self, option.name, tuple(getattr(self, option.name)))
        options.check_task_options(self.task, {o.name: getattr(self, o.name) for o in spec_options})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneSpec:
        task = data.get("task", TASKS[0])
        return _spec_from_dict(cls, {**task_spec_defaults(task), **data}, task_train_config(task))


def task_spec_defaults(task: str) -> dict[str, Any]:
    """The spec fields whose default for `task` is its own (model/options.py), not the default task's: what a
    FinetuneSpec of `task` is built with unless given (sentence-embedding's batch of 64)."""
    return {o.name: o.by_task[task] for o in options.options_for("finetune", trainer=False) if task in o.by_task}


def task_train_config(task: str) -> TrainConfig:
    """FinetuneSpec's default TrainConfig for `task` (model/options.py's defaults for it): tagging and QA
    keep the checkpoint with the best F1."""
    config = TrainConfig(**options.defaults("finetune", task, trainer=True))
    if task in ("token-classification", "question-answering"):
        config = dataclasses.replace(config, best_metric="f1", greater_is_better=True)
    if task == "sentence-embedding":  # scored pairs: spearman_cosine (_embedding_data)
        config = dataclasses.replace(config, best_metric="cosine_ndcg@10", greater_is_better=True)
    if task == "cross-encoder":  # a pairs file's; scored and labelled pairs take spearman and f1 (the run sets them)
        config = dataclasses.replace(config, best_metric="rerank_ndcg@10", greater_is_better=True)
    if task == "late-interaction":
        config = dataclasses.replace(config, best_metric="MaxSim_ndcg@10", greater_is_better=True)
    if task == "sparse-embedding":
        config = dataclasses.replace(config, best_metric="dot_ndcg@10", greater_is_better=True)
    return config


def _spec_from_dict(cls, data: dict[str, Any], default_train: TrainConfig | None = None):
    """A spec from JSON: unknown keys are errors; `train` overrides the spec's default TrainConfig."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    base = {k: v for k, v in data.items() if k != "train"}
    default_train = default_train or default_train_config(cls)
    return cls(**base, train=merge_train_config(default_train, data.get("train") or {}))


def default_train_config(spec_class) -> TrainConfig:
    return spec_class.__dataclass_fields__["train"].default_factory()


def merge_train_config(default: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """`default` with `overrides`; giving max_steps (or epochs) alone clears the other one; giving
    best_metric alone sets greater_is_better by its name (False for a loss)."""
    values = {**default.to_dict(), **overrides}
    if "max_steps" in overrides and "epochs" not in overrides:
        values["epochs"] = None
    if "epochs" in overrides and "max_steps" not in overrides:
        values["max_steps"] = None
    if "warmup_ratio" in overrides and "warmup_steps" not in overrides:
        values["warmup_steps"] = None
    if "best_metric" in overrides and "greater_is_better" not in overrides:
        values["greater_is_better"] = not str(overrides["best_metric"]).endswith("loss")  # losses fall, scores rise
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {unknown}")
    return TrainConfig(**values)


# ---------------------------------------------------------------------------- runs


def run_pretraining(spec: PretrainSpec, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Pretrain (MLM + NSP, or MLM only) from scratch, from a warm start, or resume; see PretrainSpec."""
    out = Path(spec.out)
    resume_from = _resume_point(out, spec.resume)
    with _user_errors():
        _prepare(callbacks, "loading the model")
        tokenizer, model = _pretraining_model(spec, resume_from)
        with _main_rank_first(spec.train):
            train_data, eval_data = _pretraining_data(spec, tokenizer, callbacks)
            train_data.num_batches(0)  # plans the first epoch now, so a corpus too small is a user error
        trainer = _trainer(spec.train, out, model, tokenizer, train_data, eval_data, callbacks)
    return trainer.fit(resume=resume_from or False)


def run_finetuning(spec: FinetuneSpec, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Fine-tune a model directory for spec.task: a sequence classifier (or regressor), a token
    classifier (NER) or an extractive QA model; see FinetuneSpec."""
    out = Path(spec.out)
    resume_from = _resume_point(out, spec.resume)
    with _user_errors():
        _prepare(callbacks, "reading the training data")
        model_class, data, config_updates = _FINETUNE_DATA[spec.task](spec)
        seed_everything(spec.train.seed)
        # A resumed run builds its model from the checkpoint as a fresh one from the start model (the trainer
        # then restores every tensor and random state of the checkpoint).
        source = resume_from or spec.from_model
        tokenizer = _tokenizer_of(source)
        _prepare(callbacks, "loading the model")
        model = model_class.from_pretrained(source, init_missing_heads=True, **config_updates)
        if spec.task != "late-interaction":  # a ColBERT's rows are its query_length and document_length long
            _check_seq_len(spec.max_seq_len, model.config)
        train_data, eval_data = _FINETUNE_BATCHES[spec.task](spec, data, tokenizer)
        loss_fn = _cross_encoder_loss(spec, data, model, tokenizer) if spec.task == "cross-encoder" else None
        trainer = _trainer(spec.train, out, model, tokenizer, train_data, eval_data, callbacks, loss_fn)
        if spec.task == "sparse-embedding":  # the regularisers' warm-up follows the run (a resumed one too)
            model.progress = lambda: (trainer.step, trainer.total_steps)
    return trainer.fit(resume=resume_from or False)


def _prepare(callbacks: Sequence[Callback], phase: str, done: int | None = None, total: int | None = None) -> None:
    """Tell the callbacks what the run does before it trains (Callback.on_prepare)."""
    for cb in callbacks:
        cb.on_prepare(phase, done, total)


def _trainer(
    config: TrainConfig, out: Path, model, tokenizer, train_data, eval_data, callbacks, loss_fn=None
) -> Trainer:
    """The trainer both run functions use: the run directory, evaluation by model/training/evaluation.py (a
    task's own evaluation set scores the model itself), the model's own loss or the task's loss_fn, callbacks."""
    return Trainer(
        model,
        train_data,
        config,
        run_dir=out,
        eval_data=eval_data,
        evaluate_fn=evaluate,
        tokenizer=tokenizer,
        callbacks=callbacks,
        loss_fn=loss_fn,
    )


def _classification_data(spec: FinetuneSpec):
    from model.data.finetune import load_classification_data

    data = load_classification_data(
        spec.train_file,
        spec.eval_file,
        text_column=spec.text_column,
        text_pair_column=spec.text_pair_column,
        label_column=spec.label_column,
        regression=spec.regression,
        eval_fraction=spec.eval_fraction,
        group_column=spec.group_column,
        seed=spec.train.seed,
    )
    return BertForSequenceClassification, data, data.config_updates()


def _classification_batches(spec: FinetuneSpec, data, tokenizer):
    from model.data.finetune import ClassificationBatches

    kw = dict(batch_size=spec.batch_size, max_seq_len=spec.max_seq_len, regression=data.regression)
    train = ClassificationBatches(data.train, tokenizer, seed=spec.train.seed, **kw)
    return train, ClassificationBatches(data.eval, tokenizer, shuffle=False, **kw) if data.eval else None


def _tagging_data(spec: FinetuneSpec):
    from model.data.token_classification import load_token_classification_data

    data = load_token_classification_data(
        spec.train_file, spec.eval_file, eval_fraction=spec.eval_fraction, seed=spec.train.seed
    )
    return BertForTokenClassification, data, data.config_updates()


def _tagging_batches(spec: FinetuneSpec, data, tokenizer):
    from model.data.token_classification import TokenClassificationBatches

    kw: dict[str, Any] = dict(batch_size=spec.batch_size, max_seq_len=spec.max_seq_len)
    train = TokenClassificationBatches(data.train, tokenizer, data.label2id, seed=spec.train.seed, **kw)
    evals = TokenClassificationBatches(data.eval, tokenizer, data.label2id, shuffle=False, **kw) if data.eval else None
    return train, evals


def _qa_data(spec: FinetuneSpec):
    from model.data.question_answering import load_qa_data

    data = load_qa_data(spec.train_file, spec.eval_file, eval_fraction=spec.eval_fraction, seed=spec.train.seed)
    return BertForQuestionAnswering, data, {}


def _qa_batches(spec: FinetuneSpec, data, tokenizer):
    from model.data.question_answering import QABatches

    kw = dict(
        batch_size=spec.batch_size,
        max_seq_len=spec.max_seq_len,
        doc_stride=spec.doc_stride,
        max_query_length=spec.max_query_length,
        max_answer_len=spec.max_answer_len,
        allow_impossible=data.has_impossible,
    )
    train = QABatches(data.train, tokenizer, seed=spec.train.seed, **kw)
    return train, QABatches(data.eval, tokenizer, shuffle=False, **kw) if data.eval else None


def _embedding_data(spec: FinetuneSpec):
    from model.data.pair_batches import load_embedding_data
    from model.training.sentence_embedding import (
        BEST_METRIC,
        EmbeddingLoss,
        SentenceEmbeddingModel,
        check_embedding_options,
        loss_for,
    )

    data = load_embedding_data(spec.train_file, spec.eval_file, spec.eval_fraction, spec.train.seed)
    names = ("scale", "directions", "partition_mode", "cached", "mini_batch_size", "matryoshka_dims")
    values = {"loss": loss_for(spec.loss, data.kind, spec.train_file), **{n: getattr(spec, n) for n in names}}
    check_embedding_options(values, options.defaults("finetune", spec.task))
    loss = EmbeddingLoss(**values)
    if spec.train.best_metric == BEST_METRIC["pairs"]:  # the task's default follows the data
        spec.train = dataclasses.replace(spec.train, best_metric=BEST_METRIC[data.kind])
    return SentenceEmbeddingModel, data, {"loss": loss}


def _embedding_batches(spec: FinetuneSpec, data, tokenizer):
    from model.data.pair_batches import PairBatches, ScoredPairBatches
    from model.training.sentence_embedding import evaluation_for

    kw: dict[str, Any] = dict(
        batch_size=spec.batch_size, max_seq_len=_embedding_length(spec.from_model, tokenizer, spec.max_seq_len)
    )
    batches = ScoredPairBatches if data.kind == "scored-pairs" else PairBatches
    train = batches(data.train, tokenizer, seed=spec.train.seed, **kw)
    return train, evaluation_for(data.eval, tokenizer, **kw) if data.eval else None


def _embedding_length(model_dir: str | Path, tokenizer: BertTokenizer, max_seq_len: int) -> int:
    """The tokens a text keeps: max_seq_len, but never past the model's own window (its sentence-transformers
    max_seq_length), as SentenceTransformer would cut it."""
    from model.sentence_modules import read_sentence_modules

    modules = read_sentence_modules(model_dir)
    modules.check_tokenizer(tokenizer.lowercase)
    return min(max_seq_len, modules.max_seq_length or max_seq_len)


def _cross_encoder_data(spec: FinetuneSpec):
    from model.data.cross_encoder_data import load_cross_encoder_data
    from model.training.cross_encoder import BEST_METRIC, CONFIG_UPDATES

    data = load_cross_encoder_data(
        spec.train_file, spec.eval_file, loss=spec.loss, eval_fraction=spec.eval_fraction, seed=spec.train.seed
    )
    if spec.train.best_metric == BEST_METRIC["pairs"]:  # the task's default, which follows the data
        spec.train = dataclasses.replace(spec.train, best_metric=BEST_METRIC[data.kind], greater_is_better=True)
    return BertForSequenceClassification, data, CONFIG_UPDATES


def _cross_encoder_batches(spec: FinetuneSpec, data, tokenizer):
    from model.data.cross_encoder_data import CrossEncoderBatches
    from model.training.cross_encoder import CrossEncoderEvaluation, directory_encoder, first_stage_candidates
    from model.training.losses import sample_in_batch_negatives

    train = CrossEncoderBatches(
        data.train,
        tokenizer,
        loss=data.loss,
        batch_size=spec.batch_size,
        max_seq_len=spec.max_seq_len,
        seed=spec.train.seed,
        num_negatives=spec.num_negatives,
        draw_negatives=sample_in_batch_negatives,
    )
    if not data.eval:
        return train, None
    candidates = None
    if data.kind == "pairs" and spec.retriever_model:  # the first stage is fixed: its candidates are found once
        encode = directory_encoder(_model_dir_of(Path(spec.retriever_model)), resolve_device(spec.train.device))
        candidates = first_stage_candidates(encode, data.eval)
    kw: dict[str, Any] = dict(max_seq_len=spec.max_seq_len, batch_size=spec.batch_size, pos_weight=spec.pos_weight)
    return train, CrossEncoderEvaluation(data.kind, data.eval, tokenizer, candidates=candidates, **kw)


def _cross_encoder_loss(spec: FinetuneSpec, data, model, tokenizer):
    """The trainer's loss_fn of a cross-encoder run (model/training/cross_encoder.py)."""
    from model.training.cross_encoder import CrossEncoderObjective, PairScorer, make_loss

    scorer = PairScorer(model, tokenizer, max_seq_len=spec.max_seq_len)  # the loss's score_pairs, for texts
    loss = make_loss(data.loss, scorer, num_negatives=spec.num_negatives, scale=spec.scale, pos_weight=spec.pos_weight)
    return CrossEncoderObjective(loss)


def _colbert_data(spec: FinetuneSpec):
    from model.data.pair_batches import load_embedding_data
    from model.training.colbert import ColBERTModel

    data = load_embedding_data(spec.train_file, spec.eval_file, spec.eval_fraction, spec.train.seed)
    if data.kind != "pairs":
        raise UserError(f"{spec.train_file}: a late-interaction model trains on pairs (anchor, positive[, negatives])")
    return ColBERTModel, data, {"temperature": 1.0 / spec.scale, "distill": spec.teacher_model is not None}


def _colbert_batches(spec: FinetuneSpec, data, tokenizer):
    from model.data.pair_batches import retrieval_set
    from model.data.retrieval_data import RetrievalSet
    from model.late_interaction import read_late_interaction
    from model.training.colbert import ColBERTBatches, ColBERTModel, ColBERTRetrievalEvaluation, teacher_scores

    late = read_late_interaction(spec.from_model) or ColBERTModel.from_pretrained(spec.from_model).late
    teacher = None
    if spec.teacher_model:  # each row's documents scored once by the cross-encoder
        teacher = teacher_scores(
            _model_dir_of(Path(spec.teacher_model)), data.train, tokenizer, resolve_device(spec.train.device)
        )
    train = ColBERTBatches(
        data.train, tokenizer, late, batch_size=spec.batch_size, seed=spec.train.seed, scores=teacher
    )
    if not data.eval:
        return train, None
    held_out = data.eval if isinstance(data.eval, RetrievalSet) else retrieval_set(data.eval)
    return train, ColBERTRetrievalEvaluation(held_out, tokenizer, batch_size=spec.batch_size)


def _sparse_data(spec: FinetuneSpec):
    from model.data.pair_batches import PAIRS, load_embedding_data
    from model.training.sparse_embedding import SparseEmbeddingModel, SpladeOptions

    data = load_embedding_data(spec.train_file, spec.eval_file, spec.eval_fraction, spec.train.seed)
    if data.kind != PAIRS:
        raise ValueError(
            f"{spec.train_file}: task sparse-embedding trains on pairs (columns anchor, positive and optionally "
            f"negatives), not {data.kind}"
        )
    names = ("query_regularizer_weight", "document_regularizer_weight", "regularizer_warmup_ratio")
    return SparseEmbeddingModel, data, {"splade": SpladeOptions(**{n: getattr(spec, n) for n in names})}


def _sparse_batches(spec: FinetuneSpec, data, tokenizer):
    """The sentence-embedding task's batches (no duplicate texts in a batch), and sparse retrieval evaluation."""
    from model.data.pair_batches import PairBatches
    from model.training.sparse_embedding import evaluation_for

    kw: dict[str, Any] = dict(batch_size=spec.batch_size, max_seq_len=spec.max_seq_len)
    train = PairBatches(data.train, tokenizer, seed=spec.train.seed, **kw)
    return train, evaluation_for(data.eval, tokenizer, **kw) if data.eval else None


def _sparse_evaluation(model_dir: Path, data_path, tokenizer, max_seq_len: int, batch_size: int):
    """A SparseEncoder directory's model and its evaluation on pairs or a retrieval set (`bert evaluate`)."""
    from model.data.pair_batches import SCORED_PAIRS, read_eval_file
    from model.training.sparse_embedding import SparseEmbeddingModel, evaluation_for

    kind, rows = read_eval_file(data_path)
    if kind == SCORED_PAIRS:
        raise UserError(f"{data_path}: a sparse embedding model is evaluated on pairs or a retrieval set, not {kind}")
    evaluation = evaluation_for(rows, tokenizer, max_seq_len=max_seq_len, batch_size=batch_size)  # type: ignore[arg-type]
    return SparseEmbeddingModel.from_pretrained(model_dir), evaluation


# task -> (model class, data, what the model class is built with) and task -> (train batches, eval data or None)
_FINETUNE_DATA = {
    "sequence-classification": _classification_data,
    "token-classification": _tagging_data,
    "question-answering": _qa_data,
    "sentence-embedding": _embedding_data,
    "cross-encoder": _cross_encoder_data,
    "late-interaction": _colbert_data,
    "sparse-embedding": _sparse_data,
}
_FINETUNE_BATCHES = {
    "sequence-classification": _classification_batches,
    "token-classification": _tagging_batches,
    "question-answering": _qa_batches,
    "sentence-embedding": _embedding_batches,
    "cross-encoder": _cross_encoder_batches,
    "late-interaction": _colbert_batches,
    "sparse-embedding": _sparse_batches,
}


def evaluate_model(
    model_dir: str | Path,
    data_path: str | Path,
    *,
    corpus_format: str | None = None,
    text_column: str = "text",
    text_pair_column: str | None = "text_pair",
    label_column: str = "label",
    batch_size: int = 32,
    max_seq_len: int = 128,
    seed: int = 0,
    max_batches: int | None = None,
    device: str = "auto",
    precision: str = "auto",
    doc_stride: int | None = None,
    max_query_length: int = 64,
    max_answer_len: int = 30,
) -> dict:
    """Metrics of a model directory (or a run directory's model/) on data for its task: a corpus or token
    store (MLM models), a labelled table (sequence classifiers), tagged sentences (token classifiers;
    entity precision, recall, f1, word accuracy), SQuAD JSON (QA models; exact_match, f1), or, for an encoder
    without a head, its sentence embeddings on a retrieval set or pairs (retrieval metrics) or scored pairs
    (pearson_cosine, spearman_cosine)."""
    from model.data.batches import ResumableBatches
    from model.data.corpus import TokenizedCorpus, load_corpus
    from model.data.finetune import ClassificationBatches, load_classification_data
    from model.data.pretraining import PretrainingData
    from model.data.question_answering import QABatches, read_squad
    from model.data.store import TokenStore, open_store
    from model.data.token_classification import TokenClassificationBatches, read_tagged
    from model.training.sparse_embedding import is_sparse_encoder

    model_dir = _model_dir_of(Path(model_dir))
    data: ResumableBatches | EvaluationSet
    with _user_errors():
        model, tokenizer = load_model(model_dir), _tokenizer_of(model_dir)
        _check_seq_len(max_seq_len, model.config)
        id2label = model.config.id2label
        if isinstance(model, BertForMaskedLM) and is_sparse_encoder(model_dir):  # SPLADE: sparse retrieval
            model, data = _sparse_evaluation(model_dir, data_path, tokenizer, max_seq_len, batch_size)
        elif isinstance(model, BertForSequenceClassification):
            assert id2label is not None  # a classifier's config names its labels (from_dict: LABEL_i of num_labels)
            labels = [id2label[i] for i in sorted(id2label)]
            regression = model.num_labels == 1
            table = load_classification_data(
                data_path,
                data_path,
                text_column=text_column,
                text_pair_column=text_pair_column,
                label_column=label_column,
                regression=regression,
                labels=None if regression else labels,
            )
            data = ClassificationBatches(
                table.eval,
                tokenizer,
                batch_size=batch_size,
                max_seq_len=max_seq_len,
                shuffle=False,
                regression=regression,
            )
        elif isinstance(model, BertForTokenClassification):
            assert id2label is not None
            label2id = {id2label[i]: i for i in sorted(id2label)}
            data = TokenClassificationBatches(
                read_tagged(data_path),
                tokenizer,
                label2id,
                batch_size=batch_size,
                max_seq_len=max_seq_len,
                shuffle=False,
            )
        elif isinstance(model, BertForQuestionAnswering):
            data = QABatches(
                read_squad(data_path),
                tokenizer,
                batch_size=batch_size,
                max_seq_len=max_seq_len,
                doc_stride=doc_stride,
                max_query_length=max_query_length,
                max_answer_len=max_answer_len,
                shuffle=False,
            )
        elif isinstance(model, (BertForPreTraining, BertForMaskedLM)):
            corpus: TokenizedCorpus | TokenStore
            if Path(data_path).is_dir():
                corpus = open_store(data_path, tokenizer)
            else:
                corpus = load_corpus(
                    data_path, tokenizer, format=corpus_format, cache_dir=_cache_dir(None, Path(data_path), None)
                )
            data = PretrainingData(
                corpus,
                tokenizer,
                batch_size=batch_size,
                max_seq_len=max_seq_len,
                seed=seed,
                nsp=isinstance(model, BertForPreTraining),
            )
        elif type(model) is BertModel:  # an encoder: its sentence embeddings, as sentence-transformers pools them
            from model.data.pair_batches import read_eval_file
            from model.training.sentence_embedding import SentenceEmbeddingModel, evaluation_for

            model = SentenceEmbeddingModel.from_pretrained(model_dir)
            length = _embedding_length(model_dir, tokenizer, max_seq_len)
            data = evaluation_for(read_eval_file(data_path)[1], tokenizer, max_seq_len=length, batch_size=batch_size)
        else:
            raise UserError(f"{model_dir} has no MLM, classifier or QA head: nothing to evaluate")
        dev = resolve_device(device)
        metrics = evaluate(
            model.to(dev), data, device=dev, precision=resolve_precision(precision, dev), max_batches=max_batches
        )
    return {"model": str(model_dir), "data": str(data_path), **metrics}


# ---------------------------------------------------------------------------- their parts


@contextlib.contextmanager
def _user_errors():
    """Turn the ValueError/FileNotFoundError of loading files and options into the one-line UserError."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None


def _main_rank_first(train: TrainConfig):
    """Under torchrun, rank 0 loads first (it may build the token cache), the others then read what it built."""
    return distributed.main_first(resolve_device(train.device))


def _resume_point(out: Path, resume: bool) -> Path | None:
    latest = ckpt.latest_checkpoint(out)
    if latest is not None and not resume:
        raise UserError(
            f"{out} already has checkpoints (latest: {latest.name}); resume it, or choose another output directory"
        )
    return latest


def _model_dir_of(path: Path) -> Path:
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        return path / "model"  # a run directory
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a model directory")
    return path


def _tokenizer_of(path: str | Path | None) -> BertTokenizer:
    path = Path(path) if path else None
    if path is None or not path.is_dir():
        raise UserError(f"tokenizer directory {path} does not exist")
    if not ((path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file()):
        raise UserError(f"{path} has no vocab.txt or tokenizer.json")
    return BertTokenizer.from_pretrained(path)


def _model_from_checkpoint(path: Path):
    """A model of the checkpoint's class and config (weights are loaded by the trainer) and its tokenizer."""
    config = BertConfig.from_json_file(path / "config.json")
    cls = MODEL_CLASSES[(config.architectures or ["BertForPreTraining"])[0]]
    return BertTokenizer.from_pretrained(path), cls(config)


def _pretraining_model(spec: PretrainSpec, resume_from: Path | None):
    seed_everything(spec.train.seed)  # model init (fresh weights or new heads) is part of the seeded run
    cls = BertForPreTraining if spec.nsp else BertForMaskedLM
    if resume_from is not None:
        tokenizer, model = _model_from_checkpoint(resume_from)
    elif spec.from_model:
        src = _model_dir_of(Path(spec.from_model))
        tokenizer = _tokenizer_of(spec.vocab or src)
        model = cls.from_pretrained(src, init_missing_heads=True)
        new = sorted(model.heads - heads_in_dir(src))
        if new:
            log.info("warm start from %s: new %s", src, ", ".join(HEAD_NAMES[h] for h in new))
    elif spec.config:
        if not spec.vocab:
            raise UserError("--config needs --vocab DIR (a tokenizer directory; make one with `bert vocab`)")
        tokenizer = _tokenizer_of(spec.vocab)
        model = cls(_scratch_config(spec.config, tokenizer))
    else:
        raise UserError(
            "say where the model comes from: --from MODEL_DIR (warm start) or --config tiny|small|base|FILE"
        )
    if tokenizer.vocab_size != model.config.vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    _check_seq_len(spec.max_seq_len, model.config)
    if spec.freeze_encoder:
        freeze_encoder(model)
    return tokenizer, model


def freeze_encoder(model) -> None:
    """Heads-only training: embeddings and encoder layers get no gradient (the pooler and heads do).

    The MLM decoder's weight is the word-embedding matrix, so it stays frozen too; its bias trains.
    """
    for module in (model.bert.embeddings, model.bert.encoder):
        module.requires_grad_(False)


def _scratch_config(name: str, tokenizer: BertTokenizer) -> BertConfig:
    vocab: dict[str, Any] = {"vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_token_id}
    if name in MODEL_PRESETS:
        return BertConfig(**MODEL_PRESETS[name], **vocab)
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--config {name!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a JSON file")
    return BertConfig.from_dict({**BertConfig.from_json_file(path).to_dict(), **vocab})


def _check_seq_len(max_seq_len: int, config: BertConfig) -> None:
    if max_seq_len > config.max_position_embeddings:
        raise UserError(
            f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )


def _cache_dir(explicit: str | None, corpus: Path, out: Path | None) -> Path | None:
    if explicit:
        return Path(explicit)
    if os.access(corpus.parent, os.W_OK) or out is None:
        return None  # beside the corpus, shared by every run on it
    return out / "cache"


def _pretraining_data(spec: PretrainSpec, tokenizer: BertTokenizer, callbacks: Sequence[Callback] = ()):
    from model.data.pretraining import PretrainingData

    corpus, eval_corpus = _open_corpus(spec.corpus, spec, tokenizer, callbacks), None
    if spec.eval_corpus:
        eval_corpus = _open_corpus(spec.eval_corpus, spec, tokenizer, callbacks)
    elif spec.eval_fraction > 0:
        corpus, eval_corpus = holdout_documents(
            corpus, spec.eval_fraction, spec.eval_max_documents, min_documents=2 if spec.nsp else 1
        )
    kw: dict[str, Any] = dict(
        batch_size=spec.batch_size,
        max_seq_len=spec.max_seq_len,
        seed=spec.train.seed,
        nsp=spec.nsp,
        masked_lm_prob=spec.masked_lm_prob,
        whole_word_mask=spec.whole_word_mask,
    )
    train = PretrainingData(corpus, tokenizer, **kw)
    return train, PretrainingData(eval_corpus, tokenizer, **kw) if eval_corpus is not None else None


def _open_corpus(path: str, spec: PretrainSpec, tokenizer: BertTokenizer, callbacks: Sequence[Callback] = ()):
    """A token store directory (model/data/store.py), else a text corpus tokenised through its cache (the
    callbacks hear how far while the cache is built)."""
    from model.data.corpus import load_corpus
    from model.data.store import open_store

    if Path(path).is_dir():
        if spec.corpus_format:
            raise UserError(
                f"--format {spec.corpus_format} is for text corpora, but {path} is a directory (read as a token store)"
            )
        return open_store(path, tokenizer)
    return load_corpus(
        path,
        tokenizer,
        format=spec.corpus_format,
        text_field=spec.text_field,
        cache_dir=_cache_dir(spec.cache_dir, Path(path), Path(spec.out)),
        on_tokenise=lambda done, total: _prepare(callbacks, "tokenising the corpus", done, total),
    )


def holdout_documents(corpus, fraction: float, max_documents: int, min_documents: int = 2):
    """(train, eval) views of a TokenizedCorpus or TokenStore: the last documents are held out (array slices).

    A store's held-out documents are its last ones too, in as many shards as they take (a TokenStore
    each side). Returns (corpus, None) when the corpus is too small to spare `min_documents` on each side.
    """
    n = corpus.num_documents
    k = min(max(min_documents, round(n * fraction)), max_documents)
    if n - k < min_documents or k < 1:
        return corpus, None
    if hasattr(corpus, "shards"):
        return _split_store(corpus, n - k)
    return _split_tail(corpus, k)


def _split_store(store, d: int):
    """A TokenStore cut before its document `d` (global index): the shard holding it is cut in two."""
    j = int(np.searchsorted(store.document_bases, d, side="right")) - 1
    head, tail = _split_tail(store.shards[j], int(store.document_bases[j + 1]) - d)
    before = [*store.shards[:j], head] if head.num_documents else store.shards[:j]
    return store.with_shards(before), store.with_shards([tail, *store.shards[j + 1 :]])


def _split_tail(corpus, k: int):
    """A TokenizedCorpus cut before its last `k` documents, as two views of the same arrays."""
    from model.data.corpus import TokenizedCorpus

    d = corpus.num_documents - k
    s = int(corpus.document_offsets[d])  # first held-out sentence
    t = int(corpus.sentence_offsets[s])  # its first token
    train = TokenizedCorpus(
        corpus.path,
        corpus.format,
        corpus.tokens[:t],
        corpus.sentence_offsets[: s + 1],
        corpus.document_offsets[: d + 1],
    )
    held = TokenizedCorpus(
        corpus.path, corpus.format, corpus.tokens[t:], corpus.sentence_offsets[s:] - t, corpus.document_offsets[d:] - s
    )
    return train, held
