"""POST /jobs with params.task cross-encoder: the dataset kinds it trains on (pairs, scored pairs, labelled
pairs), its options and what they must agree on with the dataset and the base model, as 422s with exact
bodies. No broker: a job that passes validation gets 503, so nothing is queued (see test_jobs_api.py)."""

from __future__ import annotations

import pytest

from datadir import JobRecords
from model.modeling import BertForSequenceClassification
from model.sizing import estimate_training
from model.tokenizer import BertTokenizer
from tests.app.test_finetune_tasks_api import QUEUED
from tests.app.test_jobs_api import make_client, post_job, upload
from tests.helpers import VOCAB, finetune_request, finetune_spec, make_data_dir, squad_json, tiny_config

PAIRS = b"anchor,positive,negative\nthe cat,the cat sat,a dog\nthe man,he eats bread,the sky\n"
BARE_PAIRS = b"anchor,positive\nthe cat,the cat sat\nthe man,he eats bread\n"
SCORED = b"sentence1,sentence2,score\nthe cat,the cat sat,0.9\nthe man,the sky,0.1\n"
PAIR_LABELS = b"text,text_pair,label\nthe cat,the cat sat,1\nthe man,the sky,0\n"
CLASSES = b"text,text_pair,label\nthe cat,the cat sat,good\nthe man,the sky,bad\n"
SINGLE = b"text,label\nthe cat sat,1\nthe sky,0\n"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    data_dir = make_data_dir(tmp_path_factory.mktemp("ce-api") / "data")
    classifier = BertForSequenceClassification(tiny_config(id2label={0: "a", 1: "b"}))
    classifier.save_pretrained(data_dir / "models" / "clf", tokenizer=BertTokenizer.from_vocab(VOCAB))
    with make_client(data_dir) as client:
        for name, filename, body, kind in (
            ("pairs", "pairs.csv", PAIRS, "pairs"),
            ("bare", "bare.csv", BARE_PAIRS, "pairs"),
            ("sts", "sts.csv", SCORED, "scored-pairs"),
            ("pair-labels", "pl.csv", PAIR_LABELS, "labelled"),
            ("classes", "classes.csv", CLASSES, "labelled"),
            ("single", "single.csv", SINGLE, "labelled"),
            ("squad", "squad.json", squad_json(), "qa"),
        ):
            r = upload(client, filename, body, name=name)
            assert (r.status_code, r.json()["kind"]) == (201, kind), r.json()
        yield client


def ce(dataset: str, **params) -> dict:
    return finetune_request("rr", dataset=dataset, task="cross-encoder", **params)


@pytest.mark.parametrize(
    "request_",
    [
        ce("pairs"),  # mnrl, the first stage the service's default model
        ce("pairs", loss="bce", pos_weight=2.0, retriever_model="tiny"),
        ce("bare", num_negatives=0, scale=20.0),
        ce("sts"),
        ce("pair-labels", loss="bce"),
    ],
    ids=["pairs", "pairs-bce", "bare-pairs", "scored", "labelled"],
)
def test_cross_encoder_jobs_on_its_three_kinds_pass_validation(env, request_):
    assert post_job(env, request_) == QUEUED


BAD_JOBS = [
    (ce("pairs", loss="cosent"), "params.loss: a cross-encoder trains with bce or mnrl, not cosent"),
    (
        ce("squad"),
        "dataset: 'squad' is a qa dataset; task cross-encoder needs a pairs, scored-pairs or labelled one",
    ),
    (
        ce("sts", loss="mnrl"),
        "params.loss: mnrl ranks each anchor's positive above its negatives, so it trains on a pairs dataset; "
        "'sts' is scored-pairs: use bce",
    ),
    (
        ce("bare", loss="bce"),
        "params.loss: bce on pairs labels each positive 1 and each hard negative 0, and dataset 'bare' has no "
        "negatives: use mnrl (its negatives come from the batch), or upload pairs with negatives",
    ),
    (ce("single"), "dataset: 'single' has no text_pair column: a cross-encoder scores (text, text_pair) pairs"),
    (
        ce("classes"),
        "dataset: 'classes' has labels 'bad', 'good': a cross-encoder's labels are 0 or 1, or scores in 0..1",
    ),
    (
        {**ce("pairs"), "base_model": "clf"},
        "base_model: 'clf' is a classifier with 2 labels; a cross-encoder has one (start from an encoder, such as "
        "an embedding model, or from a reranker)",
    ),
    (ce("pairs", retriever_model="ghost"), "params.retriever_model: model 'ghost' not found in DATA_DIR/models"),
    (
        ce("sts", retriever_model="tiny"),
        "params.retriever_model: the first stage of the reranking evaluation of pairs; dataset 'sts' is scored-pairs",
    ),
    (
        ce("pairs", loss="hinge"),
        "finetune.params.loss: Input should be 'mnrl', 'cosent' or 'bce'",
    ),
    (ce("pairs", num_negatives=-1), "finetune.params.num_negatives: Input should be greater than or equal to 0"),
    (ce("pairs", scale=0), "finetune.params.scale: Input should be greater than 0"),
    (ce("pairs", pos_weight=0), "finetune.params.pos_weight: Input should be greater than 0"),
    (
        finetune_request("x", dataset="pair-labels", num_negatives=8),
        "finetune.params: num_negatives is for task cross-encoder, not sequence-classification",
    ),
    (
        finetune_request("x", dataset="pair-labels", loss="bce"),
        "finetune.params: loss is for task sentence-embedding or cross-encoder, not sequence-classification",
    ),
    (
        ce("pair-labels", regression=True),
        "finetune.params: regression is for task sequence-classification, not cross-encoder",
    ),
]


@pytest.mark.parametrize("body, message", BAD_JOBS, ids=[m[:60] for _, m in BAD_JOBS])
def test_bad_cross_encoder_jobs(env, body, message):
    assert post_job(env, body) == (422, {"error": message, "error_type": "validation"})


def test_an_mnrl_job_is_sized_by_the_pairs_of_each_anchor(tmp_path):
    """batch_size 8 anchors with 4 drawn and 1 given negative are 48 pairs a step: a memory limit between the
    estimates of 8 and of 48 pairs takes the bce job and refuses the mnrl one, unless it draws no negatives
    (8 anchors, 2 pairs each)."""
    sizes = [
        estimate_training(tiny_config(), "BertForSequenceClassification", batch_size=b, seq_len=64, num_labels=1)
        for b in (16, 48)
    ]
    limit = (sizes[0].memory_gb + sizes[1].memory_gb) / 2
    with make_client(make_data_dir(tmp_path / "data"), job_max_memory_gb=limit) as client:
        assert upload(client, "pairs.csv", PAIRS, name="pairs").status_code == 201
        assert upload(client, "pl.csv", PAIR_LABELS, name="pl").status_code == 201
        assert post_job(client, ce("pl", batch_size=8, max_seq_len=64)) == QUEUED
        assert post_job(client, ce("pairs", batch_size=8, max_seq_len=64, num_negatives=0)) == QUEUED
        status, body = post_job(client, ce("pairs", batch_size=8, max_seq_len=64))
        assert status == 422 and body["error"].startswith(
            f"params: the job is too large: an estimated {sizes[1].memory_gb:,.1f} GB of peak training memory"
        )


def test_a_model_a_waiting_job_reranks_with_is_not_deleted(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    BertForSequenceClassification(tiny_config()).save_pretrained(data_dir / "models" / "enc")
    job = JobRecords(data_dir).create(finetune_spec("rr", "pairs", task="cross-encoder", retriever_model="enc"))
    with make_client(data_dir) as client:
        r = client.delete("/models/enc")
        assert (r.status_code, r.json()) == (
            409,
            {
                "error": f"model 'enc' is in use by job {job['id']} (queued); delete it once the job has finished "
                "(or cancel the job)",
                "error_type": "conflict",
            },
        )
        JobRecords(data_dir).update(job["id"], lambda rec: rec.update(state="cancelled"))
        assert client.delete("/models/enc").status_code == 200
