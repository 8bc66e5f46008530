"""End to end over real HTTP for task sentence-embedding: upload a small pairs file and a retrieval set to a uvicorn
server, fine-tune the bundled all-MiniLM-L6-v2 on a real `celery worker` for a few steps, and find the job's
retrieval metrics before training (base_*) and after, the model's card with them, and the new version of the model
serving at once: /embeddings answers what `SentenceTransformer(<the published version>).encode` gives. A dataset
of the wrong kind and bad options are 422s with their exact bodies."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from app.launcher.demo_data import find_asset
from model.model_dir import import_model
from tests.helpers import (
    ROOT,
    job_stack,
    labelled_csv,
    read_metrics,
    wait_state,
)

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples" / "data"
TEXTS = ["how do i reset my password", "Orders arrive within three to five working days.", "A man is eating food."]
METRICS = ["cosine_ndcg@10", "cosine_mrr@10", "cosine_recall@1", "cosine_recall@10", "cosine_recall@100"]
METRICS.append("cosine_map@100")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    datasets = [
        ("faq", "pairs.csv", (EXAMPLES / "pairs.csv").read_bytes()),
        ("faq-eval", "retrieval.jsonl", (EXAMPLES / "retrieval.jsonl").read_bytes()),
        ("reviews", "reviews.csv", labelled_csv()),
    ]
    root = tmp_path_factory.mktemp("e2e-embedding")
    with job_stack(
        root, "e2e-embedding", datasets, lambda d: import_model(find_asset("minilm"), d / "models" / "minilm")
    ) as stack:
        yield stack


def embedding_job(**fields) -> dict:
    params = {"task": "sentence-embedding", "max_steps": 4, "batch_size": 8, "max_seq_len": 32, "lr": 1e-4}
    params.update(save_every=2, log_every=1, **fields.pop("params", {}))
    return {"kind": "finetune", "model_name": "minilm", "base_model": "minilm", "dataset": "faq", **fields,
            "params": params}  # fmt: skip


def test_minilm_fine_tuned_on_pairs_reports_before_and_after_and_serves_as_sentence_transformers(stack):
    c, data_dir = stack.client, stack.data_dir
    before = np.array(c.post("/embeddings", json={"inputs": TEXTS, "model": "minilm"}).json())
    r = c.post("/jobs", json=embedding_job(eval_dataset="faq-eval"))
    assert r.status_code == 202, r.text
    job = wait_state(c, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=300)
    assert job["state"] == "succeeded", job
    assert (job["step"], job["latest_checkpoint"], job["eval_dataset"]) == (4, "checkpoints/step-4", "faq-eval")
    final = job["result"]["eval"]
    assert {*METRICS, *(f"base_{m}" for m in METRICS), "queries", "documents"} <= final.keys()
    assert (final["queries"], final["documents"]) == (3, 4)  # examples/data/retrieval.jsonl
    evals = [m for m in read_metrics(data_dir, job["id"]) if m["type"] == "eval"]
    assert [m["step"] for m in evals] == [0, 4]  # the base model first: the curve's first point
    assert all(final[f"base_{m}"] == evals[0][m] for m in METRICS) and final == job["eval"]

    # The new version serves at once, pooled as its sentence-transformers modules say.
    assert job["result"]["model_dir"] == "models/minilm/v2"
    info = c.get("/models/minilm").json()
    assert (info["version"], info["architecture"], info["pooling"], info["normalize"]) == (
        2,
        "BertModel",
        ["mean"],
        True,
    )
    assert info["card"]["before_after"] == [
        {"metric": m, "before": final[f"base_{m}"], "after": final[m]} for m in final if f"base_{m}" in final
    ]
    served = np.array(c.post("/embeddings", json={"inputs": TEXTS, "model": "minilm"}).json())
    expected = SentenceTransformer(str(data_dir / "models" / "minilm" / "v2"), device="cpu").encode(TEXTS)
    assert served.shape == expected.shape == (3, 384) and np.allclose(served, expected, rtol=0, atol=1e-5)
    assert not np.allclose(served, before, rtol=0, atol=1e-4)  # trained: not the base model's embeddings
    checkpoint = data_dir / "jobs" / job["id"] / "checkpoints" / "step-2"  # a checkpoint loads the same way
    assert SentenceTransformer(str(checkpoint), device="cpu").encode(TEXTS).shape == (3, 384)


BAD = [
    (
        embedding_job(dataset="reviews"),
        "dataset: 'reviews' is a labelled dataset; task sentence-embedding needs a pairs or scored-pairs one",
    ),
    (
        embedding_job(dataset="faq-eval"),
        "dataset: 'faq-eval' is a retrieval dataset; task sentence-embedding needs a pairs or scored-pairs one (a "
        "retrieval dataset is for evaluation only)",
    ),
    (
        embedding_job(params={"loss": "cosent"}),
        "params.loss: loss cosent trains on scored-pairs (sentence1, sentence2, score), but dataset 'faq' is pairs "
        "(anchor, positive, negatives): give loss mnrl, or leave it unset",
    ),
    (
        embedding_job(params={"matryoshka_dims": [512, 256]}),
        "params: matryoshka_dims 512 exceeds the model's 384-dimensional embeddings",
    ),
    (
        embedding_job(params={"matryoshka_dims": [128, 256]}),
        "finetune.params: matryoshka_dims must descend without repeats (largest first), got [128, 256]",
    ),
    (
        embedding_job(eval_dataset="reviews"),
        "eval_dataset: 'reviews' is a labelled dataset; task sentence-embedding on pairs dataset 'faq' evaluates on "
        "a pairs or retrieval one",
    ),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:50] for _, m in BAD])
def test_a_wrong_dataset_or_bad_options_are_422s(stack, body, message):
    r = stack.client.post("/jobs", json=body)
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})
