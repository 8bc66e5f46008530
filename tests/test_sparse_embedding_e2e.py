"""End to end over real HTTP for task sparse-embedding (SPLADE): upload a pairs file to a uvicorn server, fine-tune
the tiny BertForPreTraining (it has an MLM head) on a real `celery worker` for a few steps, and find the job's
sparse retrieval metrics and active dimensions before training (base_*) and after, the card's before/after table,
and the published version in sentence-transformers' SparseEncoder layout: `SparseEncoder(<the version>).encode`
gives what our SparseEmbeddingModel embeds. A dataset of the wrong kind, a base model without an MLM head and
options of the task elsewhere are 422s with their exact bodies."""

from __future__ import annotations

import json

import pytest
import torch

from model.modeling import BertModel
from model.tokenizer import BertTokenizer
from model.training.sparse_embedding import RETRIEVAL_METRICS, SPARSITY_METRICS, SparseEmbeddingModel
from tests.helpers import (
    BASE_MODEL,
    VOCAB,
    finetune_request,
    job_stack,
    labelled_csv,
    read_metrics,
    tiny_config,
    wait_state,
)

pytestmark = pytest.mark.slow

ROWS = [  # (anchor, positive, negative) in the tiny vocabulary
    ("the cat sat", "a cat sat on the mat", "the sky is blue"),
    ("the dog eats", "a dog is eating bread", "the river runs fast"),
    ("a red car", "the car is red and fast", "she reads a book"),
    ("the big tree", "a tree is big and green", "he ate food"),
    ("a good movie", "i love this film", "the city at night"),
    ("the blue water", "water in the river is blue", "a small house"),
    ("he reads", "he reads a book at night", "the mountain is big"),
    ("the fire", "a fire in the house", "we love the day"),
]
PAIRS = ("anchor,positive,negative\n" + "".join(f"{a},{p},{n}\n" for a, p, n in ROWS)).encode()
TEXTS = ["the cat sat on the mat", "a red car runs fast", "the blue sky"]
METRICS = RETRIEVAL_METRICS + SPARSITY_METRICS


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    def encoder_without_heads(data_dir):
        torch.manual_seed(1)  # an encoder without heads: nothing to weigh the vocabulary with
        BertModel(tiny_config()).save_pretrained(data_dir / "models" / "encoder", BertTokenizer.from_vocab(VOCAB))

    datasets = [("pairs", "pairs.csv", PAIRS), ("reviews", "reviews.csv", labelled_csv())]
    with job_stack(tmp_path_factory.mktemp("e2e-sparse"), "e2e-sparse", datasets, encoder_without_heads) as stack:
        yield stack


def sparse_job(name: str = "splade", dataset: str = "pairs", **params) -> dict:
    values = dict(task="sparse-embedding", max_steps=4, batch_size=4, save_every=2, eval_fraction=0.25)
    return finetune_request(name, dataset=dataset, **{**values, **params})


def test_a_tiny_mlm_fine_tuned_as_splade_reports_before_and_after_and_loads_as_a_sparse_encoder(stack):
    from sentence_transformers import SparseEncoder

    c, data_dir = stack.client, stack.data_dir
    r = c.post("/jobs", json=sparse_job(query_regularizer_weight=1e-3, document_regularizer_weight=1e-3))
    assert r.status_code == 202, r.text
    job = wait_state(c, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=300)
    assert job["state"] == "succeeded", job
    assert (job["step"], job["latest_checkpoint"]) == (4, "checkpoints/step-4")
    final = job["result"]["eval"]
    assert {*METRICS, *(f"base_{m}" for m in METRICS), "queries", "documents"} <= final.keys()
    assert (final["queries"], final["documents"]) == (2, 4)  # two held-out rows: 2 anchors, 2 positives, 2 negatives
    records = read_metrics(data_dir, job["id"])
    evals = [m for m in records if m["type"] == "eval"]
    assert [m["step"] for m in evals] == [0, 4]  # the base model first
    assert all(final[f"base_{m}"] == evals[0][m] for m in METRICS)
    steps = [m for m in records if m["type"] == "train"]
    parts = ("ranking_loss", "query_regularizer_loss", "document_regularizer_loss")
    assert all(m["loss"] == pytest.approx(sum(m[p] for p in parts), rel=1e-5) for m in steps)
    assert steps[0]["query_regularizer_loss"] == 0.0  # step 0 of the warm-up: weight 0
    assert steps[-1]["query_regularizer_loss"] > 0.0

    published = data_dir / "models" / "splade" / "v1"
    assert job["result"]["model_dir"] == "models/splade/v1"
    card = json.loads((published / "card.json").read_text())
    assert card["before_after"] == [
        {"metric": m, "before": final[f"base_{m}"], "after": final[m]} for m in final if f"base_{m}" in final
    ]
    assert json.loads((published / "config_sentence_transformers.json").read_text())["model_type"] == "SparseEncoder"
    expected = SparseEncoder(str(published), device="cpu").encode(TEXTS, convert_to_tensor=True)
    ours = SparseEmbeddingModel.from_pretrained(published)
    with torch.no_grad():
        got = ours.embed(BertTokenizer.from_pretrained(published)(TEXTS))
    torch.testing.assert_close(got, expected.to_dense(), atol=1e-5, rtol=1e-5)
    base = SparseEmbeddingModel.from_pretrained(data_dir / "models" / BASE_MODEL)
    with torch.no_grad():
        assert not torch.allclose(got, base.embed(BertTokenizer.from_pretrained(published)(TEXTS)), atol=1e-4)

    # ... and the service answers /embed_sparse with it at once, as its pooling says
    assert c.get("/models/splade").json()["pooling"] == ["splade"]
    r = c.post("/embed_sparse", json={"inputs": TEXTS, "model": "splade"})
    assert r.status_code == 200, r.text
    for row, vector in zip(r.json(), expected.to_dense()):
        (indices,) = vector.nonzero(as_tuple=True)
        assert [e["index"] for e in row] == indices.tolist()
        assert [e["value"] for e in row] == pytest.approx(vector[indices].tolist(), abs=1e-5)


BAD = [
    (
        sparse_job(dataset="reviews"),
        "dataset: 'reviews' is a labelled dataset; task sparse-embedding needs a pairs one",
    ),
    (
        {**sparse_job(), "base_model": "encoder"},
        "base_model: 'encoder' has no MLM head; task sparse-embedding weighs the vocabulary by the MLM head's logits "
        "(start from a model pretrained with masked language modelling)",
    ),
    (
        sparse_job(scale=5.0),
        "finetune.params: scale is for task sentence-embedding or cross-encoder or late-interaction, not sparse-embedding",
    ),
    (
        finetune_request("x", dataset="pairs", task="sentence-embedding", query_regularizer_weight=0.1),
        "finetune.params: query_regularizer_weight is for task sparse-embedding, not sentence-embedding",
    ),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:50] for _, m in BAD])
def test_a_wrong_dataset_a_base_without_mlm_head_or_other_tasks_options_are_422s(stack, body, message):
    r = stack.client.post("/jobs", json=body)
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})
