"""POST /jobs for task sentence-embedding: the dataset kinds it trains on (pairs, scored pairs) and evaluates on
(a retrieval set beside pairs), a loss that suits the data, options that go together and fit the base model,
each refusal a 422 with its exact body; an accepted job is sized by its columns and GradCache's mini-batch.
No broker: a job that passes validation gets 503, so nothing is queued (see test_jobs_api.py)."""

from __future__ import annotations

import shutil

import pytest

from model.config import BertConfig
from model.modeling import BertModel
from model.sizing import estimate_training
from tests.app.test_finetune_tasks_api import QUEUED
from tests.app.test_jobs_api import accept_without_a_broker, make_client, post_job, upload
from tests.helpers import ROOT, finetune_request, labelled_csv, make_data_dir, tiny_config

EXAMPLES = ROOT / "examples" / "data"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    data_dir = make_data_dir(tmp_path_factory.mktemp("embedding-api") / "data")
    with make_client(data_dir) as client:
        for name, file in (("faq", "pairs.csv"), ("sts", "stsb.csv"), ("faq-eval", "retrieval.jsonl")):
            r = upload(client, file, (EXAMPLES / file).read_bytes(), name=name)
            assert r.status_code == 201, r.json()
        assert upload(client, "reviews.csv", labelled_csv(), name="reviews").status_code == 201
        yield client, data_dir


def job(dataset="faq", **params):
    return finetune_request("embedder", dataset=dataset, task="sentence-embedding", **params)


def test_pairs_and_scored_pairs_jobs_pass_validation(env):
    client, _ = env
    for request in (
        job(),
        job(loss="mnrl", cached=True, mini_batch_size=4, matryoshka_dims=[32, 16, 8]),
        job(directions=["query_to_doc", "doc_to_query"], partition_mode="per_direction", scale=30.0),
        job("sts"),
        job("sts", loss="cosent", matryoshka_dims=[16]),
        {**job(), "eval_dataset": "faq-eval"},
        {**job("sts"), "eval_dataset": "sts"},
    ):
        assert post_job(client, request) == QUEUED, request


BAD = [
    (
        job("reviews"),
        "dataset: 'reviews' is a labelled dataset; task sentence-embedding needs a pairs or scored-pairs one",
    ),
    (
        job("faq-eval"),
        "dataset: 'faq-eval' is a retrieval dataset; task sentence-embedding needs a pairs or scored-pairs one (a "
        "retrieval dataset is for evaluation only)",
    ),
    (
        job(loss="cosent"),
        "params.loss: loss cosent trains on scored-pairs (sentence1, sentence2, score), but dataset 'faq' is pairs "
        "(anchor, positive, negatives): give loss mnrl, or leave it unset",
    ),
    (
        job("sts", loss="mnrl"),
        "params.loss: loss mnrl trains on pairs (anchor, positive, negatives), but dataset 'sts' is scored-pairs "
        "(sentence1, sentence2, score): give loss cosent, or leave it unset",
    ),
    (job("sts", cached=True), "params: cached is for loss mnrl (in-batch negatives), not cosent"),
    (job(loss="cosent", cached=True), "finetune.params: cached is for loss mnrl (in-batch negatives), not cosent"),
    (job(mini_batch_size=8), "finetune.params: mini_batch_size is for cached: true (GradCache's mini-batches)"),
    (job(cached=True, devices=2), "finetune.params: cached (GradCache) trains in one process, not on devices 2"),
    (
        job(matryoshka_dims=[16, 32]),
        "finetune.params: matryoshka_dims must descend without repeats (largest first), got [16, 32]",
    ),
    (job(matryoshka_dims=[64, 16]), "params: matryoshka_dims 64 exceeds the model's 32-dimensional embeddings"),
    (
        job(matryoshka_dims=[]),
        "finetune.params.matryoshka_dims: List should have at least 1 item after validation, not 0",
    ),
    (job(matryoshka_dims=[0]), "finetune.params.matryoshka_dims.0: Input should be greater than or equal to 1"),
    (
        job(directions=["query_to_doc", "sideways"]),
        "finetune.params.directions.1: Input should be 'query_to_doc', 'query_to_query', 'doc_to_query' or "
        "'doc_to_doc'",
    ),
    (
        job(directions=["query_to_doc", "query_to_query"], partition_mode="per_direction"),
        "finetune.params: partition_mode='per_direction' cannot take 'query_to_query' or 'doc_to_doc' (got "
        "('query_to_doc', 'query_to_query')); use partition_mode='joint'",
    ),
    (job(scale=0), "finetune.params.scale: Input should be greater than 0"),
    (
        {**job(), "eval_dataset": "sts"},
        "eval_dataset: 'sts' is a scored-pairs dataset; task sentence-embedding on pairs dataset 'faq' evaluates on "
        "a pairs or retrieval one",
    ),
    (
        {**job("sts"), "eval_dataset": "faq-eval"},
        "eval_dataset: 'faq-eval' is a retrieval dataset; task sentence-embedding on scored-pairs dataset 'sts' "
        "evaluates on a scored-pairs one",
    ),
    (
        finetune_request("x", dataset="reviews", cached=True),
        "finetune.params: cached is for task sentence-embedding, not sequence-classification",
    ),
]


@pytest.mark.parametrize("request_body, message", BAD, ids=[m[:60] for _, m in BAD])
def test_bad_sentence_embedding_jobs(env, request_body, message):
    client, _ = env
    assert post_job(client, request_body) == (422, {"error": message, "error_type": "validation"})


def test_an_accepted_job_is_sized_by_its_columns_and_gradcaches_mini_batch(env, monkeypatch):
    client, data_dir = env
    accept_without_a_broker(monkeypatch)
    config = BertConfig.from_dict(tiny_config().to_dict())
    sizes = {}
    for name, params in (("plain", {}), ("cached", {"cached": True, "mini_batch_size": 4})):
        request = {**job(max_seq_len=32, **params), "model_name": name}
        del request["params"]["batch_size"]  # the task's own default: 64
        status, body = post_job(client, request)
        assert status == 202, body
        sizes[name] = client.get(body["status_url"]).json()["estimate"]
        shutil.rmtree(data_dir / "jobs" / body["id"])
    assert sizes["plain"]["parameters"] == sum(p.numel() for p in BertModel(config).parameters())
    # pairs.csv: anchor, positive and one hard negative; the task's batch of 64 (the request left it unset)
    plain = estimate_training(config, "BertModel", batch_size=64, seq_len=32, columns=3)
    cached = estimate_training(config, "BertModel", batch_size=64, seq_len=32, columns=3, mini_batch_size=4)
    assert (sizes["plain"]["memory_bytes"], sizes["cached"]["memory_bytes"]) == (
        plain.memory_bytes,
        cached.memory_bytes,
    )
    assert cached.activation_bytes < plain.activation_bytes / 10
