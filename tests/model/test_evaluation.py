"""Evaluation metrics (model/evaluation.py): MLM/NSP against a direct computation, classification
accuracy and macro-F1, regression MSE, and the metrics the trainer reports through evaluate_fn."""

from __future__ import annotations

import math

import pytest
import torch

from model import BertConfig, BertForSequenceClassification
from model.evaluation import evaluate
from model.modeling import SequenceClassifierOutput
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
        super().__init__(BertConfig(**tiny_config_dict(), id2label=dict(enumerate("abc"[:logits.shape[1]]))))
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
