"""End to end over real HTTP for the cross-encoder task: upload a small pairs file to a uvicorn server,
fine-tune a reranker from the bundled MiniLM on a real `celery worker`, read its reranking metrics (and the
base model's) off the job, and rerank on /rerank of the same server exactly as sentence-transformers'
CrossEncoder scores the published directory; wrong kinds and bad options are 422s with exact bodies."""

from __future__ import annotations

import numpy as np
import pytest

from app.launcher.demo_data import ensure_minilm
from datadir import DataDir
from tests.helpers import (
    BASE_MODEL,
    finetune_request,
    job_stack,
    squad_json,
    wait_state,
)

pytestmark = pytest.mark.slow

FAQ = [
    ("how do i reset my password", "open settings and choose reset password", "the shop opens at nine"),
    ("where is my order", "track your order from the orders page", "passwords need eight characters"),
    ("can i pay by card", "we take visa and mastercard", "orders ship within two days"),
    ("how long does shipping take", "orders ship within two days", "we take visa and mastercard"),
    ("how do i close my account", "write to support to close your account", "track your order from the orders page"),
    ("when does the shop open", "the shop opens at nine", "write to support to close your account"),
    ("is there a student discount", "students get ten percent off", "open settings and choose reset password"),
    ("can i return a gift", "gifts can be returned within a month", "students get ten percent off"),
]
PAIRS = ("anchor,positive,negative\n" + "".join(f"{a},{p},{n}\n" for a, p, n in FAQ)).encode()
SCORED = b"sentence1,sentence2,score\nhow do i pay,we take visa,0.9\nhow do i pay,the shop opens at nine,0.1\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    datasets = [("faq", "faq.csv", PAIRS), ("sts", "sts.csv", SCORED), ("squad", "q.json", squad_json())]
    root = tmp_path_factory.mktemp("e2e-ce")
    with job_stack(
        root, "e2e-ce", datasets, lambda data_dir: ensure_minilm(DataDir(data_dir).model("minilm"))
    ) as stack:
        yield stack


def reranker_request(name: str, dataset: str = "faq", **params) -> dict:
    values = dict(task="cross-encoder", max_steps=4, batch_size=4, max_seq_len=64, lr=2e-5, eval_fraction=0.25)
    return {**finetune_request(name, dataset=dataset, **{**values, **params}), "base_model": "minilm"}


def test_a_reranker_fine_tuned_from_minilm_serves_on_rerank_as_sentence_transformers_scores_it(stack):
    from sentence_transformers import CrossEncoder

    c = stack.client
    r = c.post("/jobs", json=reranker_request("faq-reranker"))
    assert r.status_code == 202, r.text
    job = wait_state(c, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=300)
    assert job["state"] == "succeeded", job
    assert job["params"]["retriever_model"] == BASE_MODEL  # the service's default model: the first stage
    metrics = job["eval"]
    ranking = {"rerank_map", "rerank_mrr@10", "rerank_ndcg@10"}
    assert ranking | {f"rerank_base_{k.removeprefix('rerank_')}" for k in ranking} | {"queries"} <= metrics.keys()
    assert {f"base_{k}" for k in ranking} <= metrics.keys()  # the base model's, before the first step
    assert metrics["queries"] == 2 and metrics["step"] == 4
    info = c.get("/models/faq-reranker").json()
    assert info["architecture"] == "BertForSequenceClassification"
    assert {row["metric"] for row in info["card"]["before_after"]} >= ranking  # the card: before and after

    query, texts = "how can i pay", ["we take visa and mastercard", "the shop opens at nine", "orders ship fast"]
    r = c.post("/rerank", json={"model": "faq-reranker", "query": query, "texts": texts})
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert [rank["score"] for rank in ranks] == sorted((rank["score"] for rank in ranks), reverse=True)
    served = {rank["index"]: rank["score"] for rank in ranks}
    assert len(set(served.values())) == len(texts)  # scores of a trained reranker, not a constant
    reference = CrossEncoder(str(stack.data_dir / job["result"]["model_dir"]), device="cpu")
    expected = reference.predict([(query, t) for t in texts])
    np.testing.assert_allclose([served[i] for i in range(len(texts))], expected, atol=1e-5)


BAD = [
    (
        reranker_request("x", dataset="squad"),
        "dataset: 'squad' is a qa dataset; task cross-encoder needs a pairs, scored-pairs or labelled one",
    ),
    (
        reranker_request("x", dataset="sts", loss="mnrl"),
        "params.loss: mnrl ranks each anchor's positive above its negatives, so it trains on a pairs dataset; "
        "'sts' is scored-pairs: use bce",
    ),
    (
        reranker_request("x", retriever_model="ghost"),
        "params.retriever_model: model 'ghost' not found in DATA_DIR/models",
    ),
    (
        reranker_request("x", num_negatives=-1),
        "finetune.params.num_negatives: Input should be greater than or equal to 0",
    ),
    (
        finetune_request("x", dataset="faq", loss="bce"),
        "finetune.params: loss is for task sentence-embedding or cross-encoder, not sequence-classification",
    ),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:50] for _, m in BAD])
def test_wrong_kinds_and_bad_options_are_422(stack, body, message):
    r = stack.client.post("/jobs", json=body)
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})
