"""Evaluation metrics of a BERT model, chosen by its class; the trainer's `evaluate_fn` for BERT runs.

    metrics = evaluate(model, data, device="cpu", precision="fp32", max_batches=None, should_stop=None)

Pretraining models (BertForPreTraining, BertForMaskedLM) report MLM loss, accuracy and perplexity
over the predicted tokens, and NSP loss and accuracy when the data has NSP labels; `loss` is the sum
of the two mean losses, as in training. Classifiers report loss, accuracy and macro-F1 (a class
neither present nor predicted is left out, as scikit-learn does); regressors (one label) report MSE.
Counts are summed over batches first, so every metric is over the whole evaluation set; a
classifier's per-label counts are three bincounts a batch, so a head with many labels costs little.
`should_stop` is asked before each batch (the trainer passes its callbacks' stop requests: a cancel,
a time limit): when it says yes, EvaluationStopped is raised and no metrics come back.

Token classifiers and QA models are scored over sentences and questions, which can span several
rows (a long sentence's parts, a long context's windows). For them the evaluation data scores the
model's outputs itself: `evaluate` runs the rows in order and hands each row's outputs to
`data.score(outputs)` (TokenClassificationBatches: predicted tag ids -> precision, recall, f1 of
entities and word accuracy; QABatches: start and end logits -> exact_match and f1, model/scores.py),
then adds `loss` (the batches' losses averaged, each weighted by its rows) and the row count.

Data that is not batches of rows but a whole evaluation set (model.training.trainer.EvaluationSet: a
retrieval set, similarity-scored pairs) computes its metrics itself: `evaluate` hands it the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from model.compute.precision import autocast
from model.modeling import (
    IGNORE_INDEX,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from model.training.trainer import EvaluationSet, EvaluationStopped

if TYPE_CHECKING:
    from model.training.trainer import BatchSource


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data: BatchSource | EvaluationSet,
    *,
    device: str | torch.device | None = None,
    precision: str = "fp32",
    max_batches: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Metrics of `model` on epoch 0 of `data`, chosen by the model: classification or (masked) LM; or, for
    data that evaluates a model itself (an EvaluationSet), what its `evaluate_model` says."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        if isinstance(data, EvaluationSet):
            return data.evaluate_model(
                model, device=device, precision=precision, max_batches=max_batches, should_stop=should_stop
            )
        batches = _forward(model, data, device, precision, max_batches, should_stop)
        if isinstance(model, (BertForTokenClassification, BertForQuestionAnswering)):
            return _scored_by_data(model, data, batches)
        is_classifier = isinstance(model, BertForSequenceClassification)
        totals: dict[str, Any] = {}
        for batch, out in batches:
            _accumulate(totals, _classification_counts(model, out, batch) if is_classifier else _lm_counts(out, batch))
        if not totals:
            raise ValueError("evaluation data has no batches")
        return _classification_metrics(totals) if is_classifier else _lm_metrics(totals)
    finally:
        model.train(was_training)


def _forward(model, data, device, precision: str, max_batches: int | None, should_stop):
    """(batch on `device`, the model's output) for the first `max_batches` batches of epoch 0."""
    for i, batch in enumerate(data.iter_batches(0, 0)):
        if max_batches is not None and i >= max_batches:
            return
        if should_stop is not None and should_stop():
            raise EvaluationStopped(f"the evaluation was stopped after {i} batches")
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(device, precision):
            out = model(**batch)
        yield batch, out


def _accumulate(totals: dict[str, Any], counts: dict[str, Any]) -> None:
    for key, value in counts.items():
        if isinstance(value, torch.Tensor):  # per-label counts
            value = value.to("cpu", torch.float64)
            totals[key] = totals[key] + value if key in totals else value
        else:
            totals[key] = totals.get(key, 0.0) + float(value)


# ---------------------------------------------------------------------------- scored by the data


def _scored_by_data(model, data, batches) -> dict[str, float]:
    """Loss and row outputs over the rows in order, the task metrics from `data.score(outputs)`."""
    if getattr(data, "shuffle", False) or not hasattr(data, "score"):
        raise ValueError(
            f"{type(model).__name__} is evaluated on unshuffled data that scores its outputs "
            f"(TokenClassificationBatches, QABatches with shuffle=False), not {type(data).__name__}"
        )
    outputs, loss_sum, rows = [], 0.0, 0
    for batch, out in batches:
        n = batch["input_ids"].shape[0]
        loss_sum, rows = loss_sum + out.loss.item() * n, rows + n
        outputs += _row_outputs(out, batch["attention_mask"])
    if not rows:
        raise ValueError("evaluation data has no batches")
    return {"loss": loss_sum / rows, **data.score(outputs), "rows": rows}


def _row_outputs(out, attention_mask: torch.Tensor) -> list:
    """Per row, without padding: predicted label ids (token classification) or (start, end) logits (QA)."""
    lengths = attention_mask.sum(-1).tolist()
    if hasattr(out, "start_logits"):
        start, end = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        return [(start[i, :n], end[i, :n]) for i, n in enumerate(lengths)]
    predicted = out.logits.argmax(-1).cpu().tolist()  # (B, T)
    return [row[:n] for row, n in zip(predicted, lengths)]


# ---------------------------------------------------------------------------- (masked) LM


def _lm_counts(out, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    labels = batch["labels"]
    target = labels[labels != IGNORE_INDEX]  # logits are (N, V) in this row-major order
    counts: dict[str, float] = {"mlm_n": target.numel()}
    if target.numel():
        counts["mlm_loss_sum"] = F.cross_entropy(logits.float(), target, reduction="sum").item()
        counts["mlm_correct"] = (logits.argmax(-1) == target).sum().item()
    nsp = batch.get("next_sentence_label")
    if nsp is not None and getattr(out, "seq_relationship_logits", None) is not None:
        nsp_logits = out.seq_relationship_logits.float()
        counts["nsp_n"] = nsp.numel()
        counts["nsp_loss_sum"] = F.cross_entropy(nsp_logits, nsp.reshape(-1), reduction="sum").item()
        counts["nsp_correct"] = (nsp_logits.argmax(-1) == nsp.reshape(-1)).sum().item()
    return counts


def _lm_metrics(t: dict[str, float]) -> dict[str, float]:
    m: dict[str, float] = {"masked_tokens": int(t["mlm_n"])}
    if t["mlm_n"]:
        m["mlm_loss"] = t["mlm_loss_sum"] / t["mlm_n"]
        m["mlm_accuracy"] = t["mlm_correct"] / t["mlm_n"]
        m["perplexity"] = math.exp(min(m["mlm_loss"], 700.0))
    if t.get("nsp_n"):
        m["nsp_loss"] = t["nsp_loss_sum"] / t["nsp_n"]
        m["nsp_accuracy"] = t["nsp_correct"] / t["nsp_n"]
    m["loss"] = m.get("mlm_loss", 0.0) + m.get("nsp_loss", 0.0)  # as in training: sum of the two means
    return m


# ---------------------------------------------------------------------------- classification


def _classification_counts(model, out, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    logits, labels = out.logits.float(), batch["labels"]
    if model.num_labels == 1:
        return {"n": labels.numel(), "se": ((logits.squeeze(-1) - labels.float()) ** 2).sum().item()}
    preds, labels = logits.argmax(-1), labels.reshape(-1)
    n = logits.shape[-1]
    return {
        "n": labels.numel(),
        "correct": (preds == labels).sum().item(),
        "loss_sum": F.cross_entropy(logits, labels, reduction="sum").item(),
        "true_positives": torch.bincount(labels[preds == labels], minlength=n),  # (n,) per label
        "predicted": torch.bincount(preds, minlength=n),
        "actual": torch.bincount(labels, minlength=n),
    }


def _classification_metrics(t: dict[str, Any]) -> dict[str, float]:
    if "se" in t:
        mse = t["se"] / t["n"]
        return {"loss": mse, "mse": mse, "examples": int(t["n"])}
    tp = t["true_positives"]
    fp, fn = t["predicted"] - tp, t["actual"] - tp
    scored = (tp + fp + fn) > 0  # a class neither present nor predicted is left out, as scikit-learn does
    f1s = 2 * tp[scored] / (2 * tp[scored] + fp[scored] + fn[scored])
    return {
        "loss": t["loss_sum"] / t["n"],
        "accuracy": t["correct"] / t["n"],
        "macro_f1": f1s.mean().item() if len(f1s) else 0.0,
        "examples": int(t["n"]),
    }
