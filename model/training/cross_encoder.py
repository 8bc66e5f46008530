"""Cross-encoders (rerankers): a one-label BertForSequenceClassification trained with sentence-transformers
6's CrossEncoder losses, evaluated as a reranker, and saved so that sentence-transformers scores it as the
service does: sigmoid(logit), what /rerank answers.

    loss_fn = CrossEncoderObjective(loss)                     # the trainer's loss_fn; loss: one of
    out = loss_fn(model, batch)                               # model/training/losses.py's cross-encoder losses
    evaluation = CrossEncoderEvaluation(data.kind, data.eval, tokenizer, candidates=first_stage)
    metrics = evaluate_cross_encoder(model, evaluation, device="cpu")

A CrossEncoderEvaluation is the trainer's eval data: an EvaluationSet (model/training/trainer.py), which
model.training.evaluation.evaluate hands the model; with eval_on_start (the task's default) the first
evaluation is the base model's, and every later one carries base_<metric> beside <metric>.

The batches are model/data/cross_encoder_data.py's: (B, T) pairs with labels (bce) or (B, C, T)
candidates, the positive first (mnrl), whose (B * C, T) forward gives the (B, C) logits the loss ranks.
The output's `loss` is the loss module's `loss_from_logits`, so it equals the module called on the same
texts.

Evaluation, by the held-out rows' kind (keys as sentence-transformers' CrossEncoder evaluators name them):

    pairs          rerank_map, rerank_mrr@10, rerank_ndcg@10 (retrieval_eval.rerank): every held-out anchor
                   a query, its positives relevant, each query's candidates the first stage's top 100 of
                   every held-out positive and negative (an embedding model's, `first_stage_candidates`),
                   with rerank_base_* the first stage's own; without a first stage every document is a
                   candidate and there are no rerank_base_* keys. queries: how many.
    scored-pairs   pearson, spearman of sigmoid(logit) and the score; loss (binary cross-entropy); pairs
    labelled       accuracy, f1, precision, recall of sigmoid(logit) >= 0.5 against label >= 0.5; loss; pairs

A correlation of constant scores is None (undefined), so it never becomes a best checkpoint.

Saved model: `CONFIG_UPDATES` make the config what sentence-transformers' CrossEncoder writes for one label
(id2label {0: LABEL_0}, no problem_type) plus the activation it reads from config.json,
`sentence_transformers.activation_fn` = torch.nn.Sigmoid (CrossEncoder.get_default_activation_fn, versions
4 to 6), so `CrossEncoder(dir).predict(pairs)` gives sigmoid(logit) whatever its default.

References: sentence-transformers 6.x, cross_encoder/model.py (activation), cross_encoder/evaluation/
(CrossEncoderRerankingEvaluator, CrossEncoderCorrelationEvaluator, CrossEncoderClassificationEvaluator).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from model.compute.precision import autocast
from model.data.pairs import Pair
from model.modeling import BertForSequenceClassification, BertModel, SequenceClassifierOutput
from model.sentence_modules import read_sentence_modules
from model.tokenizer import BertTokenizer
from model.training.losses import BinaryCrossEntropyLoss, CrossEncoderMultipleNegativesRankingLoss
from model.training.retrieval_eval import Encode, pearson, rerank, retrieve, spearman
from model.training.trainer import EvaluationStopped

SIGMOID = "torch.nn.modules.activation.Sigmoid"  # sentence-transformers' name for torch.nn.Sigmoid
CONFIG_UPDATES: dict[str, Any] = {
    "id2label": {0: "LABEL_0"},
    "label2id": {"LABEL_0": 0},
    "problem_type": None,
    "sentence_transformers": {"activation_fn": SIGMOID},
}
BEST_METRIC = {"pairs": "rerank_ndcg@10", "scored-pairs": "spearman", "labelled": "f1"}
FIRST_STAGE_TOP_K = 100  # candidates per query, as sentence-transformers' reranking evaluations take them
AT_K = 10

CrossEncoderLoss = BinaryCrossEntropyLoss | CrossEncoderMultipleNegativesRankingLoss


# ---------------------------------------------------------------------------- scoring pairs


class PairScorer:
    """(firsts, seconds) -> the logits (N,) of a one-label sequence classifier on those pairs, each
    tokenised as one sequence pair: the `score_pairs` of the cross-encoder losses. `scores(pairs)` is
    sigmoid of them without gradients, `batch_size` pairs a forward: what /rerank answers."""

    def __init__(self, model, tokenizer, *, max_seq_len: int = 128, batch_size: int = 64, precision: str = "fp32"):
        self.model, self.tokenizer, self.max_seq_len = model, tokenizer, max_seq_len
        self.batch_size, self.precision = batch_size, precision
        self.should_stop: Callable[[], bool] | None = None  # asked before each forward of `scores`

    def __call__(self, firsts: Sequence[str], seconds: Sequence[str]) -> torch.Tensor:
        batch = self.tokenizer(list(firsts), list(seconds), max_length=self.max_seq_len, truncation=True)
        device = next(self.model.parameters()).device
        with autocast(device, self.precision):
            logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits
        return logits.float().reshape(-1)

    @torch.no_grad()
    def scores(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        parts = []
        for start in range(0, len(pairs), self.batch_size):
            if self.should_stop is not None and self.should_stop():
                raise EvaluationStopped(f"the evaluation was stopped after {start} pairs")
            chunk = pairs[start : start + self.batch_size]
            parts.append(torch.sigmoid(self([a for a, _ in chunk], [b for _, b in chunk])).cpu().numpy())
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


# ---------------------------------------------------------------------------- training


class CrossEncoderObjective:
    """The trainer's loss_fn for a cross-encoder: `forward` on the batch's pairs, then `loss`'s
    loss_from_logits (bce: of each pair against its label; mnrl: of each row's candidates, positive first)."""

    def __init__(self, loss: CrossEncoderLoss):
        self.loss = loss

    def __call__(self, forward: Callable[..., Any], batch: dict[str, torch.Tensor]) -> SequenceClassifierOutput:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        if isinstance(self.loss, BinaryCrossEntropyLoss):
            logits = forward(**inputs).logits.float()  # (B, 1), in fp32 under bf16 autocast too
            return SequenceClassifierOutput(logits, self.loss.loss_from_logits(logits, batch["labels"]))
        B, C, T = inputs["input_ids"].shape
        logits = forward(**{k: v.reshape(B * C, T) for k, v in inputs.items()}).logits  # (B, C, T) -> (B * C, T)
        logits = logits.float().view(B, C)  # (B * C, 1) -> (B, C): column 0 the positive; sigmoid * scale in fp32
        return SequenceClassifierOutput(logits, self.loss.loss_from_logits(logits))


def make_loss(
    name: str, score_pairs, *, num_negatives: int = 4, scale: float = 10.0, pos_weight: float | None = None
) -> CrossEncoderLoss:
    """bce: BinaryCrossEntropyLoss(pos_weight); mnrl: CrossEncoderMultipleNegativesRankingLoss(num_negatives,
    scale) with its sigmoid activation."""
    if name == "bce":
        return BinaryCrossEntropyLoss(score_pairs, pos_weight=pos_weight)
    if name == "mnrl":
        return CrossEncoderMultipleNegativesRankingLoss(score_pairs, num_negatives=num_negatives, scale=scale)
    raise ValueError(f"loss must be bce or mnrl, got {name!r}")


# ---------------------------------------------------------------------------- evaluation


@dataclass
class CrossEncoderEvaluation:
    """Held-out rows to evaluate a cross-encoder on (the trainer's eval_data); see the module docstring.
    `candidates`: pairs only, each query id's first-stage candidates (`first_stage_candidates`), or None."""

    kind: str  # pairs, scored-pairs or labelled
    rows: list  # Pair rows (pairs) or LabelledPairs
    tokenizer: BertTokenizer
    max_seq_len: int = 128
    batch_size: int = 64
    candidates: dict[str, list[str]] | None = None
    pos_weight: float | None = None  # the bce loss reported for scored and labelled pairs weighs positives so

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("no held-out rows to evaluate a cross-encoder on")

    def evaluate_model(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        precision: str,
        max_batches: int | None,
        should_stop: Callable[[], bool] | None,
    ) -> dict[str, Any]:
        """The trainer's EvaluationSet hook (model.training.evaluation.evaluate hands it the model)."""
        assert isinstance(model, BertForSequenceClassification)
        return evaluate_cross_encoder(
            model, self, device=device, precision=precision, max_batches=max_batches, should_stop=should_stop
        )


def reranking_set(rows: Sequence[Pair]) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(queries, corpus, relevant) of held-out pairs rows: each distinct anchor a query, each distinct
    positive or negative a document (ids numbered in the order first seen), an anchor's positives relevant."""
    queries: dict[str, str] = {}
    corpus: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    query_ids: dict[str, str] = {}
    doc_ids: dict[str, str] = {}
    for row in rows:
        q = query_ids.setdefault(row.anchor, f"q{len(query_ids):08d}")
        queries[q] = row.anchor
        for text in (row.positive, *row.negatives):
            corpus[doc_ids.setdefault(text, f"d{len(doc_ids):08d}")] = text
        relevant.setdefault(q, set()).add(doc_ids[row.positive])
    return queries, corpus, relevant


def first_stage_candidates(encode: Encode, rows: Sequence[Pair], top_k: int = FIRST_STAGE_TOP_K) -> dict:
    """Each held-out query's `top_k` documents by an embedding model's cosine (retrieval_eval.retrieve)."""
    queries, corpus, _ = reranking_set(rows)
    return retrieve(encode, queries, corpus, top_k=top_k)


@torch.no_grad()
def evaluate_cross_encoder(
    model: BertForSequenceClassification,
    data: CrossEncoderEvaluation,
    *,
    device: str | torch.device | None = None,
    precision: str = "fp32",
    max_batches: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The metrics of `model` on `data` (scored and labelled pairs: its first `max_batches` * batch_size rows
    when given; pairs: every query); raises EvaluationStopped when `should_stop` says so between two forwards."""
    if device is not None:
        model.to(device)
    scorer = PairScorer(
        model, data.tokenizer, max_seq_len=data.max_seq_len, batch_size=data.batch_size, precision=precision
    )
    scorer.should_stop = should_stop
    was_training = model.training
    model.eval()
    try:
        if data.kind == "pairs":
            return _reranking(scorer, data.rows, data.candidates)
        rows = data.rows if max_batches is None else data.rows[: max_batches * data.batch_size]
        pairs = [(r.first, r.second) for r in rows]
        scores, labels = scorer.scores(pairs), np.array([r.label for r in rows], dtype=np.float64)
        metrics = _correlations(scores, labels) if data.kind == "scored-pairs" else _classification(scores, labels)
        return {"loss": _bce(scores, labels, data.pos_weight), **metrics, "pairs": len(rows)}
    finally:
        model.train(was_training)


def _reranking(scorer: PairScorer, rows: Sequence[Pair], candidates: Mapping[str, list[str]] | None) -> dict:
    queries, corpus, relevant = reranking_set(rows)

    def score(pairs: list[tuple[str, str]]) -> list[float]:
        return scorer.scores(pairs).tolist()

    if candidates is not None:
        metrics = rerank(score, queries, corpus, relevant, candidates, at_k=AT_K, batch_size=scorer.batch_size)
        return {**metrics, "queries": len(queries)}
    every = {q: list(corpus) for q in queries}  # no first stage: every held-out document is a candidate
    metrics = rerank(
        score, queries, corpus, relevant, every, top_k=len(corpus), at_k=AT_K, batch_size=scorer.batch_size
    )
    return {**{k: v for k, v in metrics.items() if not k.startswith("rerank_base_")}, "queries": len(queries)}


def _correlations(scores: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
    return {"pearson": _defined(pearson(labels, scores)), "spearman": _defined(spearman(labels, scores))}


def _defined(value: float) -> float | None:
    return None if math.isnan(value) else value


def _classification(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy, F1, precision and recall of the positive class at the threshold 0.5."""
    predicted, actual = scores >= 0.5, labels >= 0.5
    tp = float((predicted & actual).sum())
    precision = tp / predicted.sum() if predicted.any() else 0.0
    recall = tp / actual.sum() if actual.any() else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"accuracy": float((predicted == actual).mean()), "f1": f1, "precision": precision, "recall": recall}


def _bce(scores: np.ndarray, labels: np.ndarray, pos_weight: float | None) -> float:
    """Mean binary cross-entropy of probabilities `scores` against `labels` (BCEWithLogitsLoss's, from the
    sigmoid's output: logits are log(p / (1 - p)))."""
    p = torch.as_tensor(scores, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    weight = None if pos_weight is None else torch.tensor(pos_weight, dtype=torch.float64)
    return float(F.binary_cross_entropy_with_logits(torch.logit(p), torch.as_tensor(labels), pos_weight=weight))


# ---------------------------------------------------------------------------- the first stage


def directory_encoder(model_dir: str | Path, device: str | torch.device = "cpu", batch_size: int = 64) -> Encode:
    """texts -> embeddings of a model directory's encoder, pooled (and normalised) as its sentence-transformers
    modules say (model/sentence_modules.py; mean and unit length without them): a first stage for reranking."""
    modules = read_sentence_modules(model_dir)
    tokenizer = BertTokenizer.from_pretrained(model_dir)
    modules.check_tokenizer(tokenizer.lowercase)
    encoder = BertModel.from_pretrained(model_dir, device=device)
    length = min(
        modules.max_seq_length or encoder.config.max_position_embeddings, encoder.config.max_position_embeddings
    )

    @torch.no_grad()
    def encode(texts: list[str]) -> torch.Tensor:
        out = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], max_length=length, truncation=True)
            hidden = encoder(**{k: v.to(device) for k, v in batch.items()}).last_hidden_state
            out.append(modules.embed(hidden, batch["attention_mask"].to(device)).float().cpu())
        return torch.cat(out)

    return encode
