"""Sparse-embedding (SPLADE) training (model/training/sparse_embedding.py) against sentence-transformers 6.x.

A tiny random BertForMaskedLM of ours is saved (config, weights, tokenizer and the SparseEncoder files);
sentence-transformers' SparseEncoder loads that directory, so both sides hold the same weights. Dropout is 0, so
the models train (autograd through SpladePooling's training path) and still agree.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SparseEncoder
from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import SpladeRegularizerWeightSchedulerCallback
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator
from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

from model.config import BertConfig
from model.data.pair_batches import retrieval_set
from model.data.pairs import Pair
from model.tokenizer import BertTokenizer
from model.training.losses import embed_columns
from model.training.runs import FinetuneSpec, evaluate_model, run_finetuning
from model.training.sparse_embedding import (
    RETRIEVAL_METRICS,
    SPARSITY_METRICS,
    SparseEmbeddingModel,
    SparseRetrievalEvaluation,
    SpladeOptions,
    splade_loss,
)
from tests.conftest import TINY_VOCAB, tiny_config_dict
from tests.helpers import StopAt
from tests.model.test_retrieval_losses import ANCHORS, NEGATIVES, POSITIVES, our_grads

TOL = dict(atol=1e-5, rtol=1e-5)
OPTIONS = SpladeOptions(query_regularizer_weight=0.3, document_regularizer_weight=0.2, regularizer_warmup_ratio=0.5)


@pytest.fixture(scope="module")
def splade_dir(tmp_path_factory):
    """Our tiny random BertForMaskedLM, saved as a SparseEncoder directory; its MLM bias spread so that about half
    the vocabulary's logits are negative (sparse embeddings, as a trained SPLADE model's)."""
    path = tmp_path_factory.mktemp("tiny-splade")
    torch.manual_seed(0)
    config = BertConfig(**tiny_config_dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = SparseEmbeddingModel(config)
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0.0, 0.05)
    model.save_pretrained(path, BertTokenizer.from_vocab(TINY_VOCAB))
    return path


@pytest.fixture
def reference(splade_dir):
    return SparseEncoder(str(splade_dir), device="cpu")


@pytest.fixture
def ours(splade_dir):
    return SparseEmbeddingModel.from_pretrained(splade_dir)


def features(reference, texts):
    """One column tokenized by the reference: its feature dict, and ours (the tensors alone)."""
    theirs = reference.preprocess(texts)
    return theirs, {k: v for k, v in theirs.items() if isinstance(v, torch.Tensor)}


def test_saved_directory_is_what_sparse_encoder_saves(splade_dir, reference, tmp_path):
    reference.save(str(tmp_path))
    for name in ("modules.json", "sentence_bert_config.json", "1_SpladePooling/config.json"):
        assert json.loads((splade_dir / name).read_text()) == json.loads((tmp_path / name).read_text()), name
    ours, theirs = (json.loads((d / "config_sentence_transformers.json").read_text()) for d in (splade_dir, tmp_path))
    assert {k: v for k, v in ours.items() if k != "__version__"} == {
        k: v for k, v in theirs.items() if k != "__version__"
    }
    assert json.loads((splade_dir / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]


def test_embeddings_equal_sparse_encoder_encode(reference, ours, splade_dir):
    texts = ANCHORS + POSITIVES
    expected = reference.encode(texts, convert_to_tensor=True, convert_to_sparse_tensor=False, batch_size=3)
    tokenizer = BertTokenizer.from_pretrained(splade_dir)
    with torch.no_grad():
        got = ours.embed(tokenizer(texts))
    torch.testing.assert_close(got, expected.to_dense() if expected.is_sparse else expected, **TOL)
    assert int((got != 0).sum(1).min()) > 0 and int((got != 0).sum(1).max()) < got.shape[1]  # sparse, not empty


@pytest.mark.parametrize("step", [0, 3, 5, 20])  # before, during, at the end of and after the warm-up
def test_weights_follow_the_splade_scheduler_callback(reference, step):
    total = 10  # warm-up: int(10 * 0.5) = 5 steps
    loss = SpladeLoss(
        reference,
        SparseMultipleNegativesRankingLoss(reference),
        document_regularizer_weight=OPTIONS.document_regularizer_weight,
        query_regularizer_weight=OPTIONS.query_regularizer_weight,
    )
    callback = SpladeRegularizerWeightSchedulerCallback(loss, warmup_ratio=OPTIONS.regularizer_warmup_ratio)

    class State:
        max_steps, global_step = total, step

    callback.on_train_begin(None, State(), None)
    callback.on_step_begin(None, State(), None)
    assert OPTIONS.weights_at(step, total) == pytest.approx(
        (loss.query_regularizer_weight, loss.document_regularizer_weight)
    )


@pytest.mark.parametrize("negatives", [0, 2])
@pytest.mark.parametrize("step", [2, 10])
def test_loss_and_gradients_equal_splade_loss(reference, ours, negatives, step):
    texts = [ANCHORS, POSITIVES, *NEGATIVES[:negatives]]
    query_weight, document_weight = OPTIONS.weights_at(step, 10)
    loss = SpladeLoss(
        reference,
        SparseMultipleNegativesRankingLoss(reference),
        document_regularizer_weight=document_weight,
        query_regularizer_weight=query_weight,
    )
    reference.train()
    columns = [features(reference, column) for column in texts]
    expected = loss([theirs for theirs, _ in columns], None)
    sum(expected.values()).backward()

    ours.train()
    ours.splade, ours.progress = OPTIONS, lambda: (step, 10)
    width = max(mine["input_ids"].shape[1] for _, mine in columns)
    batch = {  # (B, C, T), as the pair batches give it: each column padded to the widest
        key: torch.stack([F.pad(mine[key], (0, width - mine[key].shape[1])) for _, mine in columns], dim=1)
        for key in ("input_ids", "attention_mask", "token_type_ids")
    }
    out = ours(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.ranking_loss, expected["base_loss"], **TOL)
    torch.testing.assert_close(out.query_regularizer_loss, expected["query_regularizer_loss"], **TOL)
    torch.testing.assert_close(out.document_regularizer_loss, expected["document_regularizer_loss"], **TOL)
    torch.testing.assert_close(out.loss, sum(expected.values()), **TOL)
    theirs = {name.removeprefix("0.model."): p.grad for name, p in reference.named_parameters() if p.grad is not None}
    mine = our_grads(ours)
    assert set(mine) == set(theirs) and len(mine) > 30
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-5, rtol=1e-4, msg=name)


def test_splade_loss_of_embeddings_is_the_sum_of_its_parts(reference, ours):
    _, mine = features(reference, ANCHORS)
    _, docs = features(reference, POSITIVES)
    with torch.no_grad():
        out = splade_loss(embed_columns(ours.embed, [mine, docs]), 0.0, 0.0)
    assert out.loss == out.ranking_loss and out.query_regularizer_loss == 0 == out.document_regularizer_loss


def test_metrics_equal_sparse_information_retrieval_evaluator(reference, ours, splade_dir):
    pairs = [Pair(a, p, tuple(n)) for a, p, *n in zip(ANCHORS, POSITIVES, *NEGATIVES)]
    data = retrieval_set(pairs)
    evaluation = SparseRetrievalEvaluation(
        data, BertTokenizer.from_pretrained(splade_dir), max_seq_len=64, batch_size=4
    )
    got = evaluation.evaluate_model(ours, device=torch.device("cpu"), precision="fp32")
    expected = SparseInformationRetrievalEvaluator(
        data.queries,
        data.corpus,
        data.relevant,
        accuracy_at_k=[1],
        precision_recall_at_k=[1, 10, 100],
        batch_size=4,
        write_csv=False,
    )(reference.eval())
    assert got["queries"] == len(ANCHORS) and got["documents"] == len(data.corpus)
    for key in RETRIEVAL_METRICS + SPARSITY_METRICS:
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6), key  # ST counts in float32


def test_a_run_warms_its_regularisers_up_resumes_exactly_and_bert_evaluate_scores_it(splade_dir, tmp_path):
    data = tmp_path / "pairs.csv"
    data.write_text(
        "anchor,positive,negative\n" + "".join(f"{a},{p},{n}\n" for a, p, n in zip(ANCHORS, POSITIVES, NEGATIVES[0]))
    )

    def spec(out):
        values = dict(task="sparse-embedding", batch_size=2, max_seq_len=16, **OPTIONS.__dict__)
        train = {"max_steps": 6, "log_every": 1, "save_every": 3, "lr": 1e-3, "seed": 5}
        return FinetuneSpec.from_dict(
            dict(
                train_file=str(data),
                eval_file=str(data),
                from_model=str(splade_dir),
                out=str(out),
                **values,
                train=train,
            )
        )

    straight = run_finetuning(spec(tmp_path / "a"))
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "train"]
    # The weights at each step's forward (steps done before it: 0..5 of 6, warm-up int(6 * 0.5) = 3 steps).
    factors = [OPTIONS.weights_at(s, 6)[0] / OPTIONS.query_regularizer_weight for s in range(6)]
    assert factors == pytest.approx([0.0, 1 / 9, 4 / 9, 1.0, 1.0, 1.0])
    assert [r["query_regularizer_loss"] == 0.0 for r in steps] == [True, False, False, False, False, False]
    assert [r["step"] for r in records if r["type"] == "eval"] == [0, 6]  # the base model first
    assert straight.eval_metrics["base_dot_ndcg@10"] is not None and straight.best_checkpoint is not None

    stopped = run_finetuning(spec(tmp_path / "b"), callbacks=[StopAt(2)])
    assert (stopped.status, stopped.step) == ("stopped", 2)
    resumed = run_finetuning(spec(tmp_path / "b"))
    assert (resumed.status, resumed.step) == ("completed", 6)
    a, b = (SparseEmbeddingModel.from_pretrained(r.model_dir).state_dict() for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    metrics = evaluate_model(tmp_path / "a", data, max_seq_len=16, device="cpu")
    assert {k: metrics[k] for k in RETRIEVAL_METRICS + SPARSITY_METRICS} == {
        k: straight.eval_metrics[k] for k in RETRIEVAL_METRICS + SPARSITY_METRICS
    }
