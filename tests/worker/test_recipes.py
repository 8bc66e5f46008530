"""worker/recipes.py: a fine-tuning job record becomes the FinetuneSpec of its task."""

from __future__ import annotations

import pytest

from model.errors import UserError
from tests.helpers import make_data_dir, squad_json, write_dataset
from worker.recipes import finetune_spec


def record(**params):
    base = dict(max_steps=30, batch_size=8, max_seq_len=32, eval_fraction=0.1, lr=1e-3)
    return {
        "kind": "finetune",
        "model_name": "m",
        "base_model": "tiny",
        "dataset": "squad",
        "params": {**base, **params},
    }


def test_task_and_qa_window_options_reach_the_spec(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    write_dataset(data_dir, "squad", squad_json(), "squad.json")
    spec = finetune_spec(
        record(task="question-answering", doc_stride=8, max_query_length=16), data_dir, tmp_path / "job", "cpu"
    )
    assert (spec.task, spec.doc_stride, spec.max_query_length) == ("question-answering", 8, 16)
    assert (spec.train.best_metric, spec.train.greater_is_better, spec.train.max_steps) == ("f1", True, 30)
    assert spec.train_file == str(data_dir / "datasets" / "squad" / "data.json")


def test_a_record_from_before_tasks_is_sequence_classification(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    write_dataset(data_dir, "squad", squad_json(), "squad.json")
    spec = finetune_spec(record(), data_dir, tmp_path / "job", "cpu")
    assert (spec.task, spec.train.best_metric, spec.train.greater_is_better) == (
        "sequence-classification",
        "loss",
        False,
    )
    spec = finetune_spec(
        record(task="token-classification", doc_stride=None, max_query_length=64), data_dir, tmp_path / "job", "cpu"
    )
    assert (spec.task, spec.doc_stride, spec.train.best_metric) == ("token-classification", None, "f1")


def test_a_cross_encoder_jobs_retriever_is_its_models_directory(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    write_dataset(data_dir, "squad", squad_json(), "squad.json")  # the spec names the file; the run reads it
    job = record(task="cross-encoder", loss="bce", num_negatives=2, scale=5.0, pos_weight=3.0, retriever_model="tiny")
    spec = finetune_spec(job, data_dir, tmp_path / "job", "cpu")
    assert (spec.loss, spec.num_negatives, spec.scale, spec.pos_weight) == ("bce", 2, 5.0, 3.0)
    assert spec.retriever_model == str(data_dir / "models" / "tiny")
    assert (spec.train.best_metric, spec.train.greater_is_better, spec.train.epochs) == ("rerank_ndcg@10", True, None)
    with pytest.raises(UserError) as e:
        finetune_spec(record(task="cross-encoder", retriever_model="gone"), data_dir, tmp_path / "job", "cpu")
    assert str(e.value) == (
        f"retriever_model: model 'gone' is no longer in {data_dir / 'models'}; the reranking evaluation needs it "
        "as its first stage (restart the job once it is back)"
    )


def test_an_eval_dataset_is_the_specs_eval_file(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    write_dataset(data_dir, "squad", squad_json(), "squad.json")
    write_dataset(data_dir, "squad-dev", squad_json(), "dev.json")
    job = {**record(task="question-answering"), "eval_dataset": "squad-dev"}
    spec = finetune_spec(job, data_dir, tmp_path / "job", "cpu")
    assert spec.eval_file == str(data_dir / "datasets" / "squad-dev" / "data.json")
    assert finetune_spec(record(), data_dir, tmp_path / "job", "cpu").eval_file is None
