"""End to end over real HTTP for the new fine-tuning tasks: upload a token-labelled and a qa dataset to a
uvicorn server, train a token-classification and a question-answering job on a real `celery worker`,
and use the published models on /token-classification and /question-answering of the same server."""

from __future__ import annotations

import pytest

from tests.helpers import (
    QA_CONTEXTS,
    finetune_request,
    job_stack,
    squad_json,
    tagged_conll,
    wait_state,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    datasets = [("ner", "ner.conll", tagged_conll()), ("squad", "squad.json", squad_json())]
    with job_stack(tmp_path_factory.mktemp("e2e-tasks"), "e2e-tasks", datasets, timeout=30) as stack:
        yield stack


def test_token_classification_and_qa_jobs_train_publish_and_serve(stack):
    c = stack.client
    jobs = {}
    for request in (
        finetune_request(
            "ner-tagger",
            dataset="ner",
            task="token-classification",
            max_steps=60,
            lr=3e-3,
            eval_fraction=0.2,
            eval_every=20,
        ),
        finetune_request(
            "squad-qa",
            dataset="squad",
            task="question-answering",
            max_steps=60,
            lr=3e-3,
            eval_fraction=0.2,
            max_query_length=8,
            doc_stride=8,
        ),
    ):
        r = c.post("/jobs", json=request)
        assert r.status_code == 202, r.text
        jobs[request["model_name"]] = r.json()["id"]
    for job_id in jobs.values():
        job = wait_state(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
        assert job["state"] == "succeeded", job
        assert job["step"] == 60 and job["latest_checkpoint"] == "checkpoints/step-60"
    ner = c.get(f"/jobs/{jobs['ner-tagger']}").json()["eval"]
    assert {"precision", "recall", "f1", "accuracy", "loss"} <= ner.keys() and ner["f1"] == 1.0  # 4 sentences x 5
    qa = c.get(f"/jobs/{jobs['squad-qa']}").json()["eval"]
    assert {"exact_match", "f1", "loss", "questions"} <= qa.keys()

    models = {m["name"]: m for m in c.get("/models").json()["models"]}
    assert models["ner-tagger"]["architecture"] == "BertForTokenClassification"
    assert models["squad-qa"]["architecture"] == "BertForQuestionAnswering"
    r = c.post(
        "/token-classification",
        json={"inputs": "the man eats bread in the city", "model": "ner-tagger", "aggregation_strategy": "simple"},
    )
    assert r.status_code == 200, r.text
    assert [(e["entity_group"], e["word"]) for e in r.json()] == [("PER", "man"), ("THING", "bread"), ("LOC", "city")]
    r = c.post(
        "/question-answering",
        json={"question": "what does the man eat ?", "context": QA_CONTEXTS[0], "model": "squad-qa"},
    )
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"score", "start", "end", "answer"}
