"""The cross-encoder task (model/data/cross_encoder_data.py, model/training/cross_encoder.py): its batches are a pure
function of (seed, epoch, batch), so a resumed run draws the same in-batch negatives and ends with the same
weights; the training output's loss is the loss module's on the same texts; the saved directory scores in
sentence-transformers' CrossEncoder as our model does (sigmoid of the logit); the held-out metrics."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sentence_transformers import CrossEncoder

from model.config import BertConfig
from model.data.cross_encoder_data import CrossEncoderBatches, batch_generator, load_cross_encoder_data
from model.data.pairs import Pair
from model.errors import UserError
from model.modeling import BertForSequenceClassification, BertModel
from model.tokenizer import BertTokenizer
from model.training.cross_encoder import (
    CONFIG_UPDATES,
    CrossEncoderEvaluation,
    CrossEncoderObjective,
    PairScorer,
    evaluate_cross_encoder,
    make_loss,
    reranking_set,
)
from model.training.losses import sample_in_batch_negatives
from model.training.runs import FinetuneSpec, run_finetuning
from tests.conftest import TINY_VOCAB, tiny_config_dict

ANCHORS = ["the cat", "a dog", "the man", "she reads", "the river", "the sky", "a car", "the fire", "a tree"]
POSITIVES = [
    "the cat sat on the mat",
    "a dog ran fast",
    "the man eats bread",
    "she reads a book at night",
    "the river is blue",
    "the sky is blue at night",
    "a red car runs fast",
    "the fire is big",
    "a green tree",
]
NEGATIVES = ["the city", "a movie", "the water", "a house", "the mountain", "bread", "the book", "a day", "food"]


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ce-files")
    write_csv(root / "pairs.csv", ["anchor", "positive", "negative"], zip(ANCHORS, POSITIVES, NEGATIVES))
    write_csv(root / "bare.csv", ["anchor", "positive"], zip(ANCHORS, POSITIVES))
    scored = [(a, p, 1.0) for a, p in zip(ANCHORS, POSITIVES)] + [(a, n, 0.2) for a, n in zip(ANCHORS, NEGATIVES)]
    write_csv(root / "scored.csv", ["sentence1", "sentence2", "score"], scored)
    labelled = [(a, p, 1) for a, p in zip(ANCHORS, POSITIVES)] + [(a, n, 0) for a, n in zip(ANCHORS, NEGATIVES)]
    write_csv(root / "labelled.csv", ["text", "text_pair", "label"], labelled)
    base = root / "base"
    torch.manual_seed(0)
    BertModel(BertConfig(**tiny_config_dict())).save_pretrained(  # an encoder, as MiniLM: the classifier is new
        base, tokenizer=BertTokenizer.from_vocab(TINY_VOCAB)
    )
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return BertTokenizer.from_vocab(TINY_VOCAB)


@pytest.fixture
def model():
    torch.manual_seed(3)
    return BertForSequenceClassification(BertConfig.from_dict(tiny_config_dict(**CONFIG_UPDATES))).eval()


def pairs_rows() -> list[Pair]:
    return [Pair(a, p, (n,)) for a, p, n in zip(ANCHORS, POSITIVES, NEGATIVES)]


def mnrl_batches(tokenizer, **kw) -> CrossEncoderBatches:
    return CrossEncoderBatches(
        pairs_rows(), tokenizer, loss="mnrl", batch_size=4, seed=7, draw_negatives=sample_in_batch_negatives, **kw
    )


# ---------------------------------------------------------------------------- data


def test_a_files_kind_picks_the_default_loss_and_pairs_are_held_out_by_anchor(files):
    pairs = load_cross_encoder_data(files / "pairs.csv", eval_fraction=0.3, seed=1)
    assert (pairs.kind, pairs.loss, pairs.negatives, len(pairs.train), len(pairs.eval)) == ("pairs", "mnrl", 1, 6, 3)
    assert not {r.anchor for r in pairs.train} & {r.anchor for r in pairs.eval}
    bce = load_cross_encoder_data(files / "pairs.csv", loss="bce", eval_fraction=0.3, seed=1)
    assert [(p.first, p.second, p.label) for p in bce.train[:2]] == [
        (pairs.train[0].anchor, pairs.train[0].positive, 1.0),
        (pairs.train[0].anchor, pairs.train[0].negatives[0], 0.0),
    ]
    assert bce.eval == pairs.eval  # held-out pairs stay rows: they are reranked
    scored = load_cross_encoder_data(files / "scored.csv", eval_fraction=0.25)
    labelled = load_cross_encoder_data(files / "labelled.csv", eval_fraction=0.25)
    assert (scored.kind, scored.loss, len(scored.train) + len(scored.eval)) == ("scored-pairs", "bce", 18)
    assert (labelled.kind, labelled.loss, {p.label for p in labelled.train}) == ("labelled", "bce", {0.0, 1.0})


def test_data_that_does_not_fit_the_loss_is_refused(files, tmp_path):
    with pytest.raises(ValueError, match="holds scored-pairs; loss mnrl ranks"):
        load_cross_encoder_data(files / "scored.csv", loss="mnrl")
    with pytest.raises(ValueError, match="has no negatives .* with loss bce every pair would be a positive"):
        load_cross_encoder_data(files / "bare.csv", loss="bce")
    bad = write_csv(tmp_path / "bad.csv", ["text", "text_pair", "label"], [("a", "b", 0), ("c", "d", 3)])
    with pytest.raises(ValueError, match=r"label 3.0 of \('c', 'd'\) is not 0, 1 or a score in 0..1"):
        load_cross_encoder_data(bad)
    single = write_csv(tmp_path / "single.csv", ["text", "label"], [("a", 0), ("c", 1)])
    with pytest.raises(ValueError, match="has no text_pair column: a cross-encoder scores"):
        load_cross_encoder_data(single)


def test_mnrl_batches_are_the_same_from_any_position_and_draw_from_other_rows(tokenizer):
    data = mnrl_batches(tokenizer)
    epoch1 = list(data.iter_batches(1))
    assert [b["input_ids"].shape[:2] for b in epoch1] == [(4, 6), (4, 6), (1, 2)]  # 1 + 4 drawn + 1; last: alone
    again = mnrl_batches(tokenizer)  # a resumed run: a new object, asked from batch 1 on
    for ours, theirs in zip(epoch1[1:], again.iter_batches(1, start_batch=1)):
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    other_epoch = next(data.iter_batches(2))
    assert not torch.equal(other_epoch["input_ids"], epoch1[0]["input_ids"])
    rows = [data.example(1, i) for i in range(4)]
    candidates = data.candidates(rows, batch_generator(7, 1, 0))
    for row, found in zip(rows, candidates):
        assert found[0] == row.positive and found[-1] == row.negatives[0]
        own = {row.positive, *row.negatives}
        others = {t for r in rows if r is not row for t in (r.positive, *r.negatives)}
        assert len(found[1:-1]) == 4 and set(found[1:-1]) <= others - own
    first = epoch1[0]["input_ids"][:, 0]  # candidate 0 of each row: (anchor, positive) as one pair
    assert torch.equal(
        first, tokenizer([r.anchor for r in rows], [r.positive for r in rows])["input_ids"][:, : first.shape[1]]
    )


# ---------------------------------------------------------------------------- the loss


def test_the_training_outputs_mnrl_loss_is_the_loss_modules(tokenizer, model):
    data = mnrl_batches(tokenizer, max_seq_len=32)
    batch = next(data.iter_batches(0, start_batch=1))
    rows = [data.example(0, i) for i in range(4, 8)]
    loss = make_loss("mnrl", PairScorer(model, tokenizer, max_seq_len=32), num_negatives=4, scale=10.0)
    out = CrossEncoderObjective(loss)(model, batch)
    columns = [[r.anchor for r in rows], [r.positive for r in rows], [r.negatives[0] for r in rows]]
    expected = loss(columns, generator=batch_generator(7, 0, 1))  # the module on the texts, the same draw
    assert out.logits.shape == (4, 6)
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=1e-6)


def test_the_training_outputs_bce_loss_is_the_loss_modules(files, tokenizer, model):
    data = load_cross_encoder_data(files / "scored.csv", eval_fraction=0.25)
    batches = CrossEncoderBatches(data.train, tokenizer, loss="bce", batch_size=5, seed=0)
    batch = next(batches.iter_batches(0))
    rows = [batches.example(0, i) for i in range(5)]
    loss = make_loss("bce", PairScorer(model, tokenizer), pos_weight=3.0)
    out = CrossEncoderObjective(loss)(model, batch)
    labels = torch.tensor([r.label for r in rows])
    torch.testing.assert_close(batch["labels"], labels)
    expected = loss([[r.first for r in rows], [r.second for r in rows]], labels)
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- runs


def run(files, out, train_file="pairs.csv", **kw):
    spec = dict(
        train_file=str(files / train_file),
        from_model=str(files / "base"),
        out=str(out),
        task="cross-encoder",
        batch_size=4,
        max_seq_len=32,
        eval_fraction=0.3,
        train={"max_steps": 6, "lr": 1e-3, "save_every": 3, "log_every": 1, **kw.pop("train", {})},
        **kw,
    )
    return run_finetuning(FinetuneSpec.from_dict(spec))


def test_a_resumed_run_trains_on_the_same_batches_and_ends_with_the_same_weights(files, tmp_path):
    whole = run(files, tmp_path / "whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "part")
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-6")  # as if it had died after step 3's checkpoint
    shutil.rmtree(tmp_path / "part" / "model")
    resumed = run(files, tmp_path / "part")
    assert (whole.status, resumed.status, resumed.step) == ("completed", "completed", 6)
    a = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    b = load_file(tmp_path / "part" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole.eval_metrics == resumed.eval_metrics


def test_the_saved_reranker_scores_in_sentence_transformers_as_our_model(files, tmp_path, tokenizer):
    result = run(files, tmp_path / "run", train={"max_steps": 3})
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    assert config["sentence_transformers"] == {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    assert "problem_type" not in config
    ours = BertForSequenceClassification.from_pretrained(result.model_dir)
    pairs = [(a, p) for a, p in zip(ANCHORS, POSITIVES)] + [(a, n) for a, n in zip(ANCHORS, NEGATIVES)]
    expected = PairScorer(ours, tokenizer).scores(pairs)
    reference = CrossEncoder(result.model_dir, device="cpu")
    assert isinstance(reference.activation_fn, torch.nn.Sigmoid)
    np.testing.assert_allclose(reference.predict(pairs), expected, atol=1e-5)
    logits = ours(**tokenizer([a for a, _ in pairs], [b for _, b in pairs])).logits.reshape(-1)
    np.testing.assert_allclose(expected, torch.sigmoid(logits).detach().numpy(), atol=1e-6)


def test_the_best_checkpoint_follows_the_datas_metric(files, tmp_path):
    pairs = run(files, tmp_path / "p", train={"max_steps": 2, "eval_every": 1})
    assert {"rerank_map", "rerank_mrr@10", "rerank_ndcg@10", "queries"} <= pairs.eval_metrics.keys()
    assert not any(k.startswith("rerank_base_") for k in pairs.eval_metrics)  # no first stage: every document
    scored = run(files, tmp_path / "s", "scored.csv", train={"max_steps": 2, "eval_every": 1})
    measured = {"loss", "pearson", "spearman"}  # and the base model's, evaluated before the first step
    assert set(scored.eval_metrics) == {"type", "step", "pairs", *measured, *(f"base_{k}" for k in measured)}
    curve = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in curve if r["type"] == "eval")
    assert first["step"] == 0 and scored.eval_metrics["base_spearman"] == first["spearman"]
    labelled = run(files, tmp_path / "l", "labelled.csv", pos_weight=2.0, train={"max_steps": 2, "eval_every": 1})
    assert set(labelled.eval_metrics) >= {"accuracy", "f1", "precision", "recall", "loss", "pairs"}
    state = json.loads((tmp_path / "l" / "checkpoints" / "step-2" / "state.json").read_text())["trainer"]
    assert state["best_metric"] == "f1" and state["config"]["greater_is_better"] is True
    with pytest.raises(UserError, match="loss mnrl ranks"):
        run(files, tmp_path / "x", "scored.csv", loss="mnrl")


def test_a_first_stage_gives_the_candidates_and_the_base_metrics(files, tmp_path):
    from tests.conftest import MINILM_DIR

    result = run(files, tmp_path / "r", retriever_model=str(MINILM_DIR), train={"max_steps": 1})
    m = result.eval_metrics
    assert {"rerank_base_map", "rerank_base_mrr@10", "rerank_base_ndcg@10"} <= m.keys()
    assert 0.0 <= m["rerank_ndcg@10"] <= 1.0 and m["queries"] == 3


# ---------------------------------------------------------------------------- evaluation


def test_held_out_pairs_are_reranked_among_every_held_out_document(tokenizer, model):
    rows = pairs_rows()[:4]
    queries, corpus, relevant = reranking_set(rows)
    assert len(queries) == 4 and len(corpus) == 8 and all(len(ids) == 1 for ids in relevant.values())
    evaluation = CrossEncoderEvaluation("pairs", rows, tokenizer)
    metrics = evaluate_cross_encoder(model, evaluation)
    assert set(metrics) == {"rerank_map", "rerank_mrr@10", "rerank_ndcg@10", "queries"}
    assert metrics["queries"] == 4 and 0.0 < metrics["rerank_mrr@10"] <= 1.0
