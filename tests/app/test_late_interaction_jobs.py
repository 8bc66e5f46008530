"""POST /jobs with params.task late-interaction: the dataset kind it trains on and its teacher_model (a
cross-encoder the caller may use). No broker: a job that passes validation gets 503, so nothing is queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.modeling import BertForSequenceClassification
from model.tokenizer import BertTokenizer
from tests.app.test_finetune_tasks_api import QUEUED
from tests.app.test_jobs_api import make_client, post_job, upload
from tests.helpers import VOCAB, finetune_request, labelled_csv, make_data_dir, tiny_config

PAIRS = Path(__file__).resolve().parents[2] / "examples" / "data" / "pairs.csv"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    data_dir = make_data_dir(tmp_path_factory.mktemp("colbert-jobs") / "data")
    BertForSequenceClassification(tiny_config(id2label={0: "LABEL_0"})).save_pretrained(
        data_dir / "models" / "ranker", tokenizer=BertTokenizer.from_vocab(VOCAB)
    )
    with make_client(data_dir) as c:
        assert upload(c, "pairs.csv", PAIRS.read_bytes(), name="pairs").status_code == 201
        assert upload(c, "reviews.csv", labelled_csv(), name="reviews").status_code == 201
        yield c


def late(dataset: str, **params) -> dict:
    return finetune_request("cb", dataset=dataset, task="late-interaction", **params)


def test_a_late_interaction_job_on_pairs_is_accepted(client):
    assert post_job(client, late("pairs")) == QUEUED
    assert post_job(client, late("pairs", teacher_model="ranker")) == QUEUED


@pytest.mark.parametrize(
    "dataset, params, message",
    [
        ("reviews", {}, "dataset: 'reviews' is a labelled dataset; task late-interaction needs a pairs one"),
        (
            "pairs",
            {"teacher_model": "tiny"},
            "params.teacher_model: 'tiny' is not a cross-encoder (a sequence classifier with one label), whose "
            "scores a late-interaction model could learn",
        ),
        ("pairs", {"teacher_model": "nope"}, "params.teacher_model: model 'nope' not found in DATA_DIR/models"),
        (
            "reviews",
            {"task": "sentence-embedding", "teacher_model": "ranker"},
            "finetune.params: teacher_model is for task late-interaction, not sentence-embedding",
        ),
    ],
)
def test_bad_late_interaction_jobs(client, dataset, params, message):
    body = {**late(dataset), "params": {**late(dataset)["params"], **params}}
    assert post_job(client, body) == (422, {"error": message, "error_type": "validation"})
