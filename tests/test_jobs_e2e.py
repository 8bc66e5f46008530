"""End to end over real HTTP: a uvicorn server, a real `celery worker` subprocess and Redis.

Upload datasets, submit jobs, poll them to the end, then use the published models on the inference
routes of the same (already running) server; and cancel, queued and running.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from model.modeling import BertForSequenceClassification
from model.training.checkpoint import is_complete
from tests.helpers import (
    REDIS_URL,
    corpus_txt,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    pretrain_request,
    start_server,
    start_worker,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    flush_redis()
    root = tmp_path_factory.mktemp("e2e")
    data_dir = make_data_dir(root / "data")
    server, url = start_server(data_dir, REDIS_URL, root)
    # Progress after every step: the cancel test reads the exact step the cancel met.
    worker = start_worker(data_dir, REDIS_URL, "e2e", root, BERT_JOB_PROGRESS_INTERVAL_S="0")
    client = httpx.Client(base_url=url, timeout=30)
    try:
        for name, kind, filename, body in (
            ("reviews", "labelled", "reviews.csv", labelled_csv()),
            ("wiki", "corpus", "wiki.txt", corpus_txt()),
        ):
            r = client.post("/datasets", files={"file": (filename, body)}, data={"name": name, "kind": kind})
            assert r.status_code == 201, r.text
        yield SimpleNamespace(client=client, data_dir=data_dir, worker=worker)
    finally:
        client.close()
        worker.stop()
        server.stop()
        flush_redis()


def test_datasets_are_listed(stack):
    r = stack.client.get("/datasets")
    assert r.status_code == 200
    by_name = {d["name"]: d for d in r.json()["datasets"]}
    assert by_name["reviews"]["kind"] == "labelled" and by_name["reviews"]["labels"] == ["negative", "positive"]
    assert by_name["reviews"]["rows"] == 40
    assert by_name["wiki"]["kind"] == "corpus" and by_name["wiki"]["documents"] == 30


def test_finetune_then_classify_and_pretrain_then_fill_mask(stack):
    c = stack.client
    assert "reviews-clf" not in {m["name"] for m in c.get("/models").json()["models"]}
    scratch = {
        "kind": "pretrain",
        "model_name": "wiki-scratch",
        "dataset": "wiki",
        "params": {
            "max_steps": 30,
            "batch_size": 8,
            "max_seq_len": 32,
            "save_every": 10,
            "log_every": 1,
            "nsp": False,
            "vocab_size": 80,
            "config": {
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 37,
                "max_position_embeddings": 64,
            },
        },
    }
    created = {}
    for request in (
        finetune_request("reviews-clf", eval_fraction=0.2, eval_every=10),
        pretrain_request("wiki-mlm"),
        scratch,
    ):
        r = c.post("/jobs", json=request)
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["state"] in ("queued", "running") and body["status_url"] == f"/jobs/{body['id']}"
        assert r.headers["location"] == body["status_url"]
        created[request["model_name"]] = body["id"]

    for job_id in created.values():
        job = wait_state(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=90)
        assert job["state"] == "succeeded", job
        assert (job["step"], job["total_steps"], job["attempts"]) == (30, 30, 1)
        assert job["latest_checkpoint"] == "checkpoints/step-30" and job["error"] is None
        assert job["loss"] is not None and job["tokens_per_s"] > 0 and job["eta_s"] is None
        curve = c.get(f"/jobs/{job_id}/metrics").json()["records"]
        assert [r["step"] for r in curve if r["type"] == "train"] == list(range(1, 31))
    assert c.get(f"/jobs/{created['reviews-clf']}").json()["eval"]["examples"] == 8

    # Published while the server ran: listed, and served at once.
    models = {m["name"]: m for m in c.get("/models").json()["models"]}
    assert models["reviews-clf"]["labels"] == ["negative", "positive"]
    assert "mlm" in models["wiki-mlm"]["heads"]
    r = c.post("/classify", json={"inputs": ["i love this film", "i hate this film"], "model": "reviews-clf"})
    assert r.status_code == 200, r.text
    assert all(set(x["scores"]) == {"negative", "positive"} for x in r.json())
    assert models["wiki-scratch"]["architecture"] == "BertForMaskedLM"  # nsp off; its own vocabulary
    # Each with its card, measured before it was published: held-out scores for what has an MLM head.
    clf_card = models["reviews-clf"]["card"]
    assert clf_card["source"] == {"kind": "job", "job_id": created["reviews-clf"]}
    assert clf_card["job_eval"] == c.get(f"/jobs/{created['reviews-clf']}").json()["eval"]
    assert clf_card["evaluation"]["skipped"] == "BertForSequenceClassification has no masked-LM or next-sentence head"
    for name, nsp in (("wiki-mlm", True), ("wiki-scratch", False)):
        evaluation = models[name]["card"]["evaluation"]
        assert (evaluation["set"], evaluation["sequences"]) == ("wiki-heldout-v1", 128)
        assert 0 <= evaluation["mlm_top1"] <= evaluation["mlm_top5"] <= 1
        assert (evaluation["nsp_accuracy"] is not None) is nsp
    for name in ("wiki-mlm", "wiki-scratch"):
        r = c.post("/fill-mask", json={"inputs": "the cat [MASK] on the mat .", "model": name, "top_k": 3})
        assert r.status_code == 200, r.text
        assert len(r.json()) == 3

    listed = c.get("/jobs", params={"state": "succeeded"}).json()["jobs"]
    assert set(created.values()) <= {j["id"] for j in listed}
    assert c.get("/jobs", params={"state": "running"}).json()["jobs"] == []


def test_cancel_queued_and_running(stack):
    c = stack.client
    running = c.post("/jobs", json=finetune_request("long-one", max_steps=20000, save_every=50)).json()["id"]
    queued = c.post("/jobs", json=finetune_request("never-runs")).json()["id"]

    # The worker trains one job at a time: the second waits in the queue and is cancelled at once.
    r = c.post(f"/jobs/{queued}/cancel")
    assert r.status_code == 202 and r.json()["state"] == "cancelled"

    wait_for(lambda: c.get(f"/jobs/{running}").json()["step"] >= 5, 60, "the long job to train")
    r = c.post(f"/jobs/{running}/cancel")
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    asked_at = r.json()["step"]  # progress is written every step, under the lock the cancel takes

    job = wait_state(c, running, {"cancelled", "failed", "succeeded"}, timeout=30)
    assert job["state"] == "cancelled", job
    assert asked_at <= job["step"] <= asked_at + 1  # the loop stops at its next step boundary
    assert job["latest_checkpoint"] == f"checkpoints/step-{job['step']}"
    checkpoint = stack.data_dir / "jobs" / running / job["latest_checkpoint"]
    assert is_complete(checkpoint)
    model = BertForSequenceClassification.from_pretrained(checkpoint)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert not (stack.data_dir / "models" / "long-one").exists()

    # The queued job's message is still delivered; the worker sees the state and does nothing.
    wait_for(lambda: "already cancelled" in stack.worker.log(), 30, "the cancelled job's delivery")
    assert c.get(f"/jobs/{queued}").json()["attempts"] == 0
    r = c.post(f"/jobs/{running}/cancel")  # finished: nothing to cancel, and nothing changes
    assert (r.status_code, r.json()) == (
        409,
        {
            "error": f"job '{running}' has already finished (cancelled): there is nothing to cancel",
            "error_type": "conflict",
        },
    )
    after = c.get(f"/jobs/{running}").json()
    assert (after["state"], after["events"], after["finished_at"]) == (job["state"], job["events"], job["finished_at"])
