"""What a fine-tuning job's task asks of its base model and dataset, checked at POST /jobs before anything is
queued (app/jobs/job_service.py): the model class each task trains, a sentence-embedding job's loss and options,
a cross-encoder's loss, labels and base, a classifier base's label count, and what a sparse-embedding job's base
needs. Each failure is a 422 (ServiceError "validation") naming the field.
"""

from __future__ import annotations

from app.errors import ServiceError
from app.schemas.jobs import FinetuneJobRequest
from datadir.datasets import LABELLED_KINDS, num_labels
from model.options import defaults
from model.sentence_modules import read_sentence_modules

# The model class a fine-tuning task trains (model/training/runs.py), for sizing and base-model checks.
FINETUNE_ARCHITECTURES = {
    "sequence-classification": "BertForSequenceClassification",
    "token-classification": "BertForTokenClassification",
    "question-answering": "BertForQuestionAnswering",
    "sentence-embedding": "BertModel",  # pooled by its sentence-transformers modules: no head
    "cross-encoder": "BertForSequenceClassification",  # one label
    "late-interaction": "BertModel",  # and a ColBERT projection (model/training/colbert.py)
    "sparse-embedding": "BertForMaskedLM",  # SPLADE: the MLM head's logits, pooled
}
SPARSE_NEEDS_MLM = (
    "task sparse-embedding weighs the vocabulary by the MLM head's logits (start from a model pretrained with "
    "masked language modelling)"
)


def check_labels(base, dataset: dict) -> None:
    """A base that is already a (sequence or token) classifier keeps its `classifier` weights when
    fine-tuned for either classification task, so the label (tag) count must match."""
    if not {"classifier", "token_classifier"} & set(base.heads) or dataset["kind"] not in LABELLED_KINDS:
        return
    have, want = base.config.num_labels, num_labels(dataset)
    if have != want:
        raise ServiceError(
            "validation",
            f"base_model: '{base.name}' is a classifier with {have} labels; dataset '{dataset['name']}' has {want}",
        )


def cross_encoder_loss(p, dataset: dict) -> str:
    """The loss a cross-encoder job trains with: the one asked, else mnrl for pairs and bce for the others."""
    return p.loss or ("mnrl" if dataset["kind"] == "pairs" else "bce")


def check_cross_encoder(p, base, dataset: dict) -> None:
    """What a cross-encoder job's loss, dataset and base model must agree on (model/data/cross_encoder_data.py)."""
    name, kind, loss = dataset["name"], dataset["kind"], cross_encoder_loss(p, dataset)
    if loss not in ("bce", "mnrl"):
        raise ServiceError("validation", f"params.loss: a cross-encoder trains with bce or mnrl, not {loss}")
    if loss == "mnrl" and kind != "pairs":
        raise ServiceError(
            "validation",
            f"params.loss: mnrl ranks each anchor's positive above its negatives, so it trains on a pairs dataset; "
            f"'{name}' is {kind}: use bce",
        )
    if loss == "bce" and kind == "pairs" and not dataset.get("negatives"):
        raise ServiceError(
            "validation",
            f"params.loss: bce on pairs labels each positive 1 and each hard negative 0, and dataset '{name}' has "
            "no negatives: use mnrl (its negatives come from the batch), or upload pairs with negatives",
        )
    if kind == "labelled":
        _check_pair_labels(dataset)
    if "classifier" in base.heads and base.config.num_labels != 1:
        raise ServiceError(
            "validation",
            f"base_model: '{base.name}' is a classifier with {base.config.num_labels} labels; a cross-encoder has one "
            "(start from an encoder, such as an embedding model, or from a reranker)",
        )


def _check_pair_labels(dataset: dict) -> None:
    """A labelled dataset a cross-encoder trains on: text pairs, labels 0 or 1 or scores in 0..1."""
    if not dataset.get("is_pair"):
        raise ServiceError(
            "validation",
            f"dataset: '{dataset['name']}' has no text_pair column: a cross-encoder scores (text, text_pair) pairs",
        )
    bad = [label for label in dataset.get("labels") or () if not _in_unit_range(label)]
    if bad:
        raise ServiceError(
            "validation",
            f"dataset: '{dataset['name']}' has labels {', '.join(map(repr, bad[:5]))}: a cross-encoder's labels are "
            "0 or 1, or scores in 0..1",
        )


def _in_unit_range(label: str) -> bool:
    try:
        return 0.0 <= float(label) <= 1.0
    except ValueError:
        return False


def check_embedding_job(req: FinetuneJobRequest, base, dataset: dict) -> None:
    """A sentence-embedding job's loss suits its dataset, its options go together, its Matryoshka sizes fit the
    base model's embeddings (model/training/sentence_embedding.py's checks, as the run makes them)."""
    from model.training.sentence_embedding import check_embedding_options, loss_for

    p = req.params
    try:
        loss = loss_for(p.loss, dataset["kind"], f"dataset '{dataset['name']}'")
    except ValueError as e:
        raise ServiceError("validation", f"params.loss: {e}") from None
    try:
        dimension = read_sentence_modules(base.path).pooling.dimension(base.config.hidden_size)
    except ValueError as e:
        raise ServiceError("validation", f"base_model: '{req.base_model}' cannot embed sentences: {e}") from None
    names = ("scale", "directions", "partition_mode", "cached", "mini_batch_size", "matryoshka_dims")
    try:
        check_embedding_options(
            {"loss": loss, **{n: getattr(p, n) for n in names}}, defaults("finetune", p.task), dimension
        )
    except ValueError as e:
        raise ServiceError("validation", f"params: {e}") from None
