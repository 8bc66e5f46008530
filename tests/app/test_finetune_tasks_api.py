"""POST /datasets for token-labelled (CoNLL, JSONL) and qa (SQuAD) data, and POST /jobs with params.task:
meta.json counts, the reader's errors as 422s naming line or question id, the dataset kind each task
needs, QA window options and base models that do not fit. No broker: a job that passes validation gets
503, so nothing is queued (see test_jobs_api.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from model.modeling import BertForTokenClassification
from tests.app.test_jobs_api import make_client, post_job, tree, upload
from tests.helpers import (
    BASE_MODEL,
    TAGGED,
    finetune_request,
    labelled_csv,
    make_data_dir,
    squad_json,
    tagged_conll,
    tiny_config,
)

QUEUED = (
    503,
    {
        "error": "the job queue (broker) cannot be reached, nothing was queued; retry later (the service "
        "log has the details)",
        "error_type": "unavailable",
    },
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    outer = tmp_path_factory.mktemp("tasks-api")
    data_dir = make_data_dir(outer / "data")
    with make_client(data_dir) as client:
        for name, filename, body in (
            ("ner", "ner.conll", tagged_conll()),
            ("squad", "squad.json", squad_json(True)),
            ("reviews", "reviews.csv", labelled_csv()),
        ):
            r = upload(client, filename, body, name=name)
            assert r.status_code == 201, r.json()
        yield client, outer, data_dir


def test_token_labelled_and_qa_datasets_are_described(env):
    client, _, _ = env
    ner = client.get("/datasets/ner").json()
    assert {k: ner[k] for k in ("kind", "format", "file", "sentences", "tokens", "labels", "entity_counts")} == {
        "kind": "token-labelled",
        "format": "conll",
        "file": "data.conll",
        "sentences": 20,
        "tokens": 135,
        "labels": ["B-LOC", "B-PER", "B-THING", "I-THING", "O"],
        "entity_counts": {"LOC": 15, "PER": 20, "THING": 15},
    }
    squad = client.get("/datasets/squad").json()
    assert {k: squad[k] for k in ("kind", "format", "questions", "impossible", "contexts")} == {
        "kind": "qa",
        "format": "squad",
        "questions": 8,
        "impossible": 2,
        "contexts": 2,
    }


def test_jsonl_with_tokens_and_tags_is_token_labelled(env):
    client, _, _ = env
    body = "".join(json.dumps({"tokens": t, "tags": g}) + "\n" for t, g in TAGGED).encode()
    r = upload(client, "tagged.jsonl", body)
    assert r.status_code == 201
    assert (r.json()["kind"], r.json()["format"], r.json()["sentences"]) == ("token-labelled", "jsonl", 4)
    r = upload(
        client, "tagged.txt", tagged_conll(1), name="tagged-txt", kind="token-labelled"
    )  # .txt: CoNLL when asked
    assert (r.status_code, r.json()["kind"], r.json()["sentences"]) == (201, "token-labelled", 4)


def squad_with(edit) -> bytes:
    doc = json.loads(squad_json())
    edit(doc["data"][0]["paragraphs"][0])
    return json.dumps(doc).encode()


TOKEN_ERRORS = "file: not a usable token-labelled file (CoNLL columns, or JSONL with tokens and tags; IOB2 tags): "
BAD_UPLOADS = [
    (
        ("a.conll", b"EU B-ORG\nrejects X-Y\n"),
        {},
        TOKEN_ERRORS + "the file, line 2: tag 'X-Y' is not O, B-<type> or I-<type>",
    ),
    (
        ("a.conll", b"EU O\nrejects I-ORG\n"),
        {},
        TOKEN_ERRORS + "the file, line 2: tag 'I-ORG' follows 'O', not B-ORG or "
        "I-ORG (IOB2: an entity opens with B-; convert IOB1 files first)",
    ),
    (
        ("a.jsonl", b'{"tokens": ["a", "b"], "tags": ["O"]}\n'),
        {},
        TOKEN_ERRORS + "the file, line 1: 2 tokens but 1 tags",
    ),
    (
        ("a.json", squad_with(lambda p: p["qas"][0]["answers"][0].update(answer_start=4))),
        {},
        "file: not a usable SQuAD file: the file: question 'q0': answers[0] 'bread' is not at answer_start 4 of the "
        "context (found 'man e')",
    ),
    (
        ("a.json", squad_with(lambda p: p["qas"][1].update(id="q0"))),
        {},
        "file: not a usable SQuAD file: the file: question id 'q0' appears more than once",
    ),
    (
        ("a.json", b"[1, 2]"),
        {},
        "file: not a usable SQuAD file: the file: not SQuAD JSON: expected an object with a 'data' list of articles",
    ),
    (
        ("a.json", squad_json()),
        {"kind": "labelled"},
        "kind: a labelled dataset cannot be a .json file (corpus: .txt, "
        ".jsonl; labelled: .csv, .tsv, .jsonl; token-labelled: .txt, .tsv, .jsonl, .conll, .iob, .iob2, .bio; qa: .json; "
        "pairs: .csv, .tsv, .jsonl; scored-pairs: .csv, .tsv, .jsonl; retrieval: .jsonl, .tar, .tar.gz, .tgz, .zip)",
    ),
]


@pytest.mark.parametrize("file, fields, message", BAD_UPLOADS, ids=[m[-40:] for *_, m in BAD_UPLOADS])
def test_bad_uploads_name_line_or_question(env, file, fields, message):
    client, outer, _ = env
    before = tree(outer)
    r = upload(client, *file, **fields)
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})
    assert tree(outer) == before


def test_jobs_for_each_task_pass_validation_with_its_estimate(env):
    client, _, _ = env
    for task, dataset in (
        ("token-classification", "ner"),
        ("question-answering", "squad"),
        ("sequence-classification", "reviews"),
    ):
        qa = {"max_query_length": 16} if task == "question-answering" else {}
        assert (
            post_job(client, finetune_request(f"m-{task}", dataset=dataset, task=task, max_seq_len=32, **qa)) == QUEUED
        )
    assert (
        post_job(
            client,
            finetune_request(
                "m-qa", dataset="squad", task="question-answering", max_seq_len=32, doc_stride=4, max_query_length=16
            ),
        )
        == QUEUED
    )


BAD_JOBS = [
    (
        dict(dataset="ner"),
        "dataset: 'ner' is a token-labelled dataset; task sequence-classification needs a labelled one",
    ),
    (
        dict(dataset="reviews", task="token-classification"),
        "dataset: 'reviews' is a labelled dataset; task token-classification needs a token-labelled one",
    ),
    (
        dict(dataset="ner", task="question-answering", max_seq_len=32, max_query_length=16),
        "dataset: 'ner' is a token-labelled dataset; task question-answering needs a qa one",
    ),
    (
        dict(dataset="squad", task="ner"),
        "finetune.params.task: Input should be 'sequence-classification', "
        "'token-classification', 'question-answering', 'sentence-embedding', 'cross-encoder', 'late-interaction' or "
        "'sparse-embedding'",
    ),
    (
        dict(dataset="squad", task="question-answering", max_seq_len=32, doc_stride=16, max_query_length=16),
        "finetune.params: doc_stride (16) must be less than the 13 context tokens a window of max_seq_len 32 holds "
        "beside a question of max_query_length 16",
    ),
    (
        dict(dataset="squad", task="question-answering", max_seq_len=32, max_query_length=30),
        "finetune.params: max_seq_len (32) leaves no room for the context beside a question of max_query_length (30) "
        "and 3 special tokens",
    ),
    (
        dict(dataset="ner", task="token-classification", doc_stride=8),
        "finetune.params: doc_stride is for task question-answering, not token-classification",
    ),
]


@pytest.mark.parametrize("params, message", BAD_JOBS, ids=[m[:50] for _, m in BAD_JOBS])
def test_bad_task_jobs(env, params, message):
    client, _, _ = env
    dataset = params.pop("dataset")
    assert post_job(client, finetune_request("x", dataset=dataset, **params)) == (
        422,
        {"error": message, "error_type": "validation"},
    )


def test_a_token_classifier_base_must_have_the_datasets_tag_count(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    tagger = BertForTokenClassification(tiny_config(id2label={0: "O", 1: "B-PER"}))
    tagger.save_pretrained(data_dir / "models" / "tagger", tokenizer=None)
    for f in ("vocab.txt", "tokenizer_config.json", "tokenizer.json"):
        if (data_dir / "models" / BASE_MODEL / f).exists():
            shutil.copy(data_dir / "models" / BASE_MODEL / f, data_dir / "models" / "tagger" / f)
    with make_client(data_dir) as client:
        assert upload(client, "ner.conll", tagged_conll(), name="ner").status_code == 201
        body = {**finetune_request("x", dataset="ner", task="token-classification"), "base_model": "tagger"}
        assert post_job(client, body) == (
            422,
            {
                "error": "base_model: 'tagger' is a classifier with 2 labels; dataset 'ner' has 5",
                "error_type": "validation",
            },
        )


def test_accepted_jobs_are_sized_as_their_tasks_model(env, monkeypatch):
    from model.modeling import BertForQuestionAnswering
    from tests.app.test_jobs_api import accept_without_a_broker

    client, _, data_dir = env
    accept_without_a_broker(monkeypatch)
    tags = ["B-LOC", "B-PER", "B-THING", "I-THING", "O"]
    for task, dataset, model, qa in (
        ("token-classification", "ner", BertForTokenClassification(tiny_config().with_labels(tags)), {}),
        ("question-answering", "squad", BertForQuestionAnswering(tiny_config()), {"max_query_length": 16}),
    ):
        status, body = post_job(client, finetune_request(f"sized-{task}", dataset=dataset, task=task, **qa))
        assert status == 202, body
        job = client.get(body["status_url"]).json()
        # The job keeps what the request set; the run's defaults apply to the rest.
        assert (job["params"]["task"], job["params"].get("max_query_length")) == (task, qa.get("max_query_length"))
        assert job["estimate"]["parameters"] == sum(p.numel() for p in model.parameters())
    for record in client.get("/jobs").json()["jobs"]:
        shutil.rmtree(data_dir / "jobs" / record["id"])


def test_an_eval_dataset_is_of_the_training_datasets_kind_and_in_use_while_its_job_waits(env, monkeypatch):
    from tests.app.test_jobs_api import accept_without_a_broker

    client, _, data_dir = env
    assert upload(client, "ner-dev.conll", tagged_conll(1), name="ner-dev").status_code == 201
    request = {**finetune_request("tagger-dev", dataset="ner", task="token-classification"), "eval_dataset": "reviews"}
    assert post_job(client, request) == (
        422,
        {
            "error": "eval_dataset: 'reviews' is a labelled dataset; task token-classification on token-labelled "
            "dataset 'ner' evaluates on a token-labelled one",
            "error_type": "validation",
        },
    )
    assert post_job(client, {**request, "eval_dataset": "nothing"}) == (
        422,
        {"error": "eval_dataset: 'nothing' not found (upload it with POST /datasets)", "error_type": "validation"},
    )
    accept_without_a_broker(monkeypatch)
    status, body = post_job(client, {**request, "eval_dataset": "ner-dev"})
    assert status == 202, body
    assert client.get(body["status_url"]).json()["eval_dataset"] == "ner-dev"
    r = client.delete("/datasets/ner-dev")
    assert (r.status_code, r.json()["error"]) == (
        409,
        f"dataset 'ner-dev' is in use by job {body['id']} (queued); delete it once the job has finished (or cancel "
        "the job)",
    )
    shutil.rmtree(data_dir / "jobs" / body["id"])
    assert client.delete("/datasets/ner-dev").status_code == 200
