"""Evaluation metrics (model/training/evaluation.py): MLM/NSP against a direct computation, classification
accuracy and macro-F1, regression MSE, and the metrics the trainer reports through evaluate_fn."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import BertConfig
from model.modeling import BertForSequenceClassification, SequenceClassifierOutput
from model.training.evaluation import evaluate
from model.training.trainer import EvaluationStopped
from tests.conftest import tiny_config_dict
from tests.model.conftest import FixedBatches, pretraining_data, tiny_model


def test_mlm_and_nsp_metrics_match_a_direct_computation(corpus, tiny_tokenizer):
    model = tiny_model().eval()
    data = pretraining_data(corpus, tiny_tokenizer)
    metrics = evaluate(model, data)
    logits, labels, nsp_logits, nsp = [], [], [], []
    with torch.no_grad():
        for batch in data.iter_batches(0):
            out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])  # (B, T, V)
            picked = batch["labels"] != -100
            logits.append(out.prediction_logits[picked])
            labels.append(batch["labels"][picked])
            nsp_logits.append(out.seq_relationship_logits)
            nsp.append(batch["next_sentence_label"])
    logits, labels, nsp_logits, nsp = map(torch.cat, (logits, labels, nsp_logits, nsp))
    mlm_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert metrics["masked_tokens"] == len(labels)
    assert metrics["mlm_accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
    assert metrics["mlm_loss"] == pytest.approx(mlm_loss, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(mlm_loss), rel=1e-5)
    assert metrics["nsp_accuracy"] == pytest.approx((nsp_logits.argmax(-1) == nsp).float().mean().item())


class FixedLogits(BertForSequenceClassification):
    """A classifier whose predictions the test chooses."""

    def __init__(self, logits):
        super().__init__(BertConfig(**tiny_config_dict(), id2label=dict(enumerate("abc"[: logits.shape[1]]))))
        self.logits = logits

    def forward(self, input_ids, labels=None, **kw):
        return SequenceClassifierOutput(self.logits[: len(input_ids)])


def test_classification_accuracy_and_macro_f1():
    preds, labels = [0, 0, 1, 2, 2, 2], [0, 1, 1, 2, 2, 0]
    model = FixedLogits(torch.nn.functional.one_hot(torch.tensor(preds), 3).float() * 5)
    data = FixedBatches([{"input_ids": torch.zeros(6, 3, dtype=torch.long), "labels": torch.tensor(labels)}])
    m = evaluate(model, data)
    # per class F1: a 2/(2+1+1) = 0.5, b 2/(2+0+1) = 2/3, c 4/(4+1+0) = 0.8
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["macro_f1"] == pytest.approx((0.5 + 2 / 3 + 0.8) / 3)
    assert m["examples"] == 6


def test_macro_f1_over_many_labels_matches_a_per_label_computation():
    # 5,000 labels, most neither present nor predicted; counts summed over two batches of 32.
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 300, (64,), generator=gen)
    preds = torch.where(torch.rand(64, generator=gen) < 0.5, labels, torch.randint(0, 5000, (64,), generator=gen))
    model = FixedLogits(torch.nn.functional.one_hot(preds, 5000).float() * 5)
    chunks = iter(model.logits.split(32))
    model.forward = lambda input_ids, **kw: SequenceClassifierOutput(next(chunks))
    batches = [{"input_ids": torch.zeros(32, 2, dtype=torch.long), "labels": part} for part in labels.split(32)]
    m = evaluate(model, FixedBatches(batches))
    f1s = []
    for c in set(labels.tolist()) | set(preds.tolist()):
        tp = int(((preds == c) & (labels == c)).sum())
        fp, fn = int(((preds == c) & (labels != c)).sum()), int(((preds != c) & (labels == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn))
    assert m["macro_f1"] == pytest.approx(sum(f1s) / len(f1s))
    assert m["accuracy"] == pytest.approx((preds == labels).float().mean().item()) and m["examples"] == 64


def test_should_stop_is_asked_before_each_batch_and_stops_the_evaluation(corpus, tiny_tokenizer):
    asked = []

    def should_stop():
        asked.append(len(asked))
        return len(asked) == 2  # after the first of three batches

    with pytest.raises(EvaluationStopped, match="stopped after 1 batches"):
        evaluate(tiny_model(), pretraining_data(corpus, tiny_tokenizer), should_stop=should_stop)
    assert asked == [0, 1]
    assert evaluate(tiny_model(), pretraining_data(corpus, tiny_tokenizer), should_stop=lambda: False)["masked_tokens"]


def test_regression_reports_mse():
    model = FixedLogits(torch.tensor([[1.0], [2.0], [4.0]]))
    data = FixedBatches([{"input_ids": torch.zeros(3, 2, dtype=torch.long), "labels": torch.tensor([1.0, 3.0, 2.0])}])
    m = evaluate(model, data)
    assert m["mse"] == pytest.approx((0 + 1 + 4) / 3) and m["loss"] == m["mse"]


def test_max_batches_caps_the_evaluation_and_the_training_mode_is_restored(corpus, tiny_tokenizer):
    model = tiny_model().train()
    data = pretraining_data(corpus, tiny_tokenizer)  # three batches: 3, 3 and 1 pairs
    first = next(iter(data.iter_batches(0)))
    metrics = evaluate(model, data, max_batches=1)
    assert metrics["masked_tokens"] == int((first["labels"] != -100).sum())
    assert model.training
    with pytest.raises(ValueError, match="evaluation data has no batches"):
        evaluate(model, FixedBatches([]))
