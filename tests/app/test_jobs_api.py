"""/jobs and /datasets without a worker: validation (exact status and body), keys, uploads, and that
nothing is ever written outside DATA_DIR. The broker is unreachable here on purpose: a request
that passes validation gets 503, so no test can queue anything by accident.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
from fastapi.testclient import TestClient

from app.jobs import dataset_checks
from app.jobs.job_service import JobService
from app.jobs.uploads import _Upload
from app.main import create_app
from app.settings import Settings
from datadir import JobRecords, now_iso
from datadir.jobs import SUBMIT_LOCK
from model.modeling import BertForSequenceClassification
from tests.helpers import (
    BASE_MODEL,
    corpus_txt,
    finetune_request,
    labelled_csv,
    make_data_dir,
    pretrain_request,
    tiny_config,
)

NO_BROKER = "redis://127.0.0.1:1/0"
NAME_RULE = (
    "must be a plain name: 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit (and not with 'tmp')"
)


def make_client(data_dir, raise_server_exceptions: bool = True, **settings) -> TestClient:
    """raise_server_exceptions=False: answer a bug with the app's 500, as a server does, instead of
    raising it in the test."""
    # fp32: auto would measure a model it loads in the background and write its card (test_precision_auto.py)
    settings = {"broker_url": NO_BROKER, "precision": "fp32", **settings.pop("service", {}), **settings}
    app = create_app(Settings(data_dir=data_dir, default_model=BASE_MODEL, device="cpu", load="lazy", **settings))
    return TestClient(app, raise_server_exceptions=raise_server_exceptions)


def tree(root) -> set[str]:
    """Every file below root but the submissions' lock (created empty by the first submission, and kept)."""
    files = {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}
    return {f for f in files if os.path.basename(f) != SUBMIT_LOCK}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    outer = tmp_path_factory.mktemp("api")
    data_dir = make_data_dir(outer / "data")
    with make_client(data_dir, max_dataset_bytes=20_000) as client:
        for name, filename, body in (("reviews", "reviews.csv", labelled_csv()), ("wiki", "wiki.txt", corpus_txt())):
            assert client.post("/datasets", files={"file": (filename, body)}, data={"name": name}).status_code == 201
        yield client, outer, data_dir


def post_job(client, body) -> tuple[int, dict]:
    r = client.post("/jobs", content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


BAD_JOBS = [
    (
        {"kind": "distill", "model_name": "x", "dataset": "reviews"},
        "body: Input tag 'distill' found using 'kind' does not match any of the expected tags: 'pretrain', 'finetune', 'mine-negatives'",
    ),
    ({"model_name": "x", "dataset": "reviews"}, "body: Unable to extract tag using discriminator 'kind'"),
    (finetune_request("x", dataset="nope"), "dataset: 'nope' not found (upload it with POST /datasets)"),
    (
        finetune_request("x", dataset="wiki"),
        "dataset: 'wiki' is a corpus dataset; task sequence-classification needs a labelled one",
    ),
    (pretrain_request("x", dataset="reviews"), "dataset: 'reviews' is a labelled dataset; this job needs a corpus one"),
    ({**finetune_request("x"), "base_model": "ghost"}, "base_model: model 'ghost' not found in DATA_DIR/models"),
    ({k: v for k, v in finetune_request("x").items() if k != "base_model"}, "finetune.base_model: Field required"),
    # Path tricks: every name is a single plain path component, checked before any disk access.
    (finetune_request("../x"), f"finetune.model_name: {NAME_RULE}"),
    (finetune_request("/etc/passwd"), f"finetune.model_name: {NAME_RULE}"),
    (finetune_request("a/b"), f"finetune.model_name: {NAME_RULE}"),
    (finetune_request(".hidden"), f"finetune.model_name: {NAME_RULE}"),
    (finetune_request("tmp-x"), f"finetune.model_name: {NAME_RULE}"),
    (finetune_request("nl\n"), f"finetune.model_name: {NAME_RULE}"),  # re.match's $ let a final newline in
    (finetune_request("x" * 300), "finetune.model_name: String should have at most 64 characters"),
    ({**finetune_request("x"), "base_model": "../models/tiny"}, f"finetune.base_model: {NAME_RULE}"),
    (finetune_request("x", dataset="../../etc/passwd"), f"finetune.dataset: {NAME_RULE}"),
    (pretrain_request("x", dataset="/abs/wiki"), f"pretrain.dataset: {NAME_RULE}"),
    # Parameters: bounds, types, unknown names, consistency.
    (
        finetune_request("x", max_steps=10**9),
        "finetune.params.max_steps: Input should be less than or equal to 1000000",
    ),
    (finetune_request("x", max_steps=0), "finetune.params.max_steps: Input should be greater than or equal to 1"),
    (
        finetune_request("x", batch_size=100_000),
        "finetune.params.batch_size: Input should be less than or equal to 4096",
    ),
    (finetune_request("x", lr=-1), "finetune.params.lr: Input should be greater than 0"),
    (finetune_request("x", lr=5), "finetune.params.lr: Input should be less than or equal to 1"),
    (finetune_request("x", lr="0.1"), "finetune.params.lr: Input should be a valid number"),
    (finetune_request("x", seed=-3), "finetune.params.seed: Input should be greater than or equal to 0"),
    (finetune_request("x", momentum=0.9), "finetune.params.momentum: Extra inputs are not permitted"),
    (
        finetune_request("x", max_step=3),
        "finetune.params.max_step: Extra inputs are not permitted (did you mean 'max_steps'?)",
    ),
    (
        {**pretrain_request("x"), "modle_name": "y"},
        "pretrain.modle_name: Extra inputs are not permitted (did you mean 'model_name'?)",
    ),
    (finetune_request("x", epochs=0.0), "finetune.params.epochs: Input should be greater than 0"),
    (
        finetune_request("x", task="token-classification", regression=True),
        "finetune.params: regression is for task sequence-classification, not token-classification",
    ),
    (finetune_request("x", precision="fp8"), "finetune.params.precision: Input should be 'auto', 'fp32' or 'bf16'"),
    (
        finetune_request("x", warmup_steps=100, max_steps=10),
        "finetune.params: warmup_steps (100) must not exceed max_steps (10)",
    ),
    (
        pretrain_request("x", eval_fraction=0.0, eval_every=5),
        "pretrain.params: eval_every needs eval_fraction > 0 (there is nothing to evaluate on)",
    ),
    # a fine-tuning job chooses its best checkpoint on the held-out rows: none is refused here, not in the worker
    (finetune_request("x", eval_fraction=0), "finetune.params.eval_fraction: Input should be greater than 0"),
    (
        finetune_request("x", max_seq_len=128),
        "params.max_seq_len: 128 is more than base model 'tiny' has positions for (64)",
    ),
    (
        pretrain_request("x", config={"hidden_size": 64}),
        "params.config: only for pretraining from scratch; with base_model the model's own size and vocabulary are used",
    ),
    (
        {
            "kind": "pretrain",
            "model_name": "x",
            "dataset": "wiki",
            "params": {"config": {"hidden_size": 30, "num_attention_heads": 4}},
        },
        "pretrain.params.config: hidden_size (30) must be a multiple of num_attention_heads (4)",
    ),
    (
        {"kind": "pretrain", "model_name": "x", "dataset": "wiki", "params": {"config": {"num_hidden_layers": 1000}}},
        "pretrain.params.config.num_hidden_layers: Input should be less than or equal to 48",
    ),
    (
        {"kind": "pretrain", "model_name": "x", "dataset": "wiki", "params": {"max_seq_len": 1024}},
        "params.max_seq_len: 1024 is more than params.config has positions for (512)",
    ),
    # Sized before queued (model/sizing.py): issue 12's from-scratch job of ~10 B parameters.
    (
        {
            "kind": "pretrain",
            "model_name": "x",
            "dataset": "wiki",
            "params": {
                "batch_size": 4096,
                "max_seq_len": 4096,
                "vocab_size": 200_000,
                "config": {
                    "hidden_size": 4096,
                    "num_hidden_layers": 48,
                    "num_attention_heads": 64,
                    "intermediate_size": 16384,
                    "max_position_embeddings": 4096,
                },
            },
        },
        (
            "params: the job is too large: 10.5 B parameters (10,536,004,930) is more than the limit of 500.0 M "
            "(BERT_JOB_MAX_PARAMS); an estimated 2,665,878.2 GB of peak training memory (fp32: weights, gradients and "
            "AdamW state 157.0 GB, activations 2,665,721.0 GB, runtime 0.2 GB) is more than the limit of 16 GB "
            "(BERT_JOB_MAX_MEMORY_GB); "
            "a smaller batch_size or max_seq_len uses less (grad_accum_steps keeps the effective batch)"
        ),
    ),
    # A model within the parameter limit whose batch is not within the memory limit (BERT-base shape).
    (
        {
            "kind": "pretrain",
            "model_name": "x",
            "dataset": "wiki",
            "params": {
                "batch_size": 256,
                "max_seq_len": 512,
                "vocab_size": 30522,
                "config": {
                    "hidden_size": 768,
                    "num_hidden_layers": 12,
                    "num_attention_heads": 12,
                    "intermediate_size": 3072,
                },
            },
        },
        (
            "params: the job is too large: an estimated 224.2 GB of peak training memory (fp32: weights, gradients and "
            "AdamW state 1.6 GB, activations 222.3 GB, runtime 0.2 GB) is more than the limit of 16 GB "
            "(BERT_JOB_MAX_MEMORY_GB); "
            "a smaller batch_size or max_seq_len uses less (grad_accum_steps keeps the effective batch)"
        ),
    ),
    (
        finetune_request("x", max_runtime="2x"),
        "finetune.params.max_runtime: '2x' is not a duration: give seconds (an integer) or e.g. '90m', '12h', '1d12h'",
    ),
    (
        finetune_request("x", max_runtime=0),
        "finetune.params.max_runtime: must be between 1 second and 366 days, got 0 s",
    ),
    (
        finetune_request("x", max_runtime="4d"),
        "params.max_runtime: 345600 s is more than this service allows (259200 s, BERT_JOB_MAX_RUNTIME)",
    ),
]


@pytest.mark.parametrize("body, message", BAD_JOBS, ids=[m[:50] for _, m in BAD_JOBS])
def test_bad_jobs_are_422_and_write_nothing(env, body, message):
    client, outer, _ = env
    before = tree(outer)
    assert post_job(client, body) == (422, {"error": message, "error_type": "validation"})
    assert tree(outer) == before


def test_nan_is_not_a_number(env):
    client, _, _ = env
    r = client.post(
        "/jobs",
        content=b'{"kind": "finetune", "model_name": "x", "base_model": "tiny", '
        b'"dataset": "reviews", "params": {"lr": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_a_valid_job_without_a_broker_is_503_and_leaves_no_record(env):
    client, _, data_dir = env
    status, body = post_job(client, finetune_request("fine"))
    assert status == 503 and body["error_type"] == "unavailable"
    assert body["error"] == (
        "the job queue (broker) cannot be reached, nothing was queued; retry later (the service log has the details)"
    )  # not the client library's words
    assert not any(p.name[:1].isdigit() for p in (data_dir / "jobs").iterdir())
    assert client.get("/jobs").json() == {"jobs": []}


def test_a_bug_while_publishing_is_a_logged_500_and_leaves_no_record(env, monkeypatch, caplog):
    _, _, data_dir = env

    def buggy_publish(self, record):
        raise TypeError("send_job() got an unexpected keyword argument 'retry'")

    monkeypatch.setattr(JobService, "publish", buggy_publish)
    with make_client(data_dir, raise_server_exceptions=False) as client:
        assert post_job(client, finetune_request("buggy")) == (
            500,
            {"error": "internal server error", "error_type": "internal"},
        )
        assert client.get("/jobs").json() == {"jobs": []}
    assert not any(p.name[:1].isdigit() for p in (data_dir / "jobs").iterdir())
    assert "unhandled error on POST /jobs" in caplog.text and "TypeError: send_job()" in caplog.text


def accept_without_a_broker(monkeypatch) -> None:
    """Publishing succeeds without sending anything: the job is accepted (202) and stays queued."""
    monkeypatch.setattr(JobService, "publish", lambda self, record: None)


def test_an_accepted_job_carries_its_size_and_runtime_limit(env, monkeypatch):
    client, _, data_dir = env
    accept_without_a_broker(monkeypatch)
    status, body = post_job(client, finetune_request("sized", max_runtime="1h30m"))
    assert status == 202, body
    job = client.get(body["status_url"]).json()
    assert job["params"]["max_runtime"] == 5400 and job["runtime_s"] is None
    # The tiny base model (tests/helpers.py) as a 2-label classifier: every part counted, all trainable.
    classifier = BertForSequenceClassification(tiny_config().with_labels(["negative", "positive"]))
    assert (
        job["estimate"]["parameters"] == job["estimate"]["trainable"] == sum(p.numel() for p in classifier.parameters())
    )
    assert job["estimate"]["precision"] in ("fp32", "bf16") and job["estimate"]["memory_bytes"] > 0
    status, body = post_job(client, finetune_request("default-runtime"))
    assert client.get(body["status_url"]).json()["params"]["max_runtime"] == 259200  # BERT_JOB_MAX_RUNTIME
    for record in client.get("/jobs").json()["jobs"]:
        shutil.rmtree(data_dir / "jobs" / record["id"])


def test_the_size_limits_are_settings(tmp_path, monkeypatch):
    data_dir = make_data_dir(tmp_path / "data")
    accept_without_a_broker(monkeypatch)
    with make_client(data_dir, job_max_params=19_000) as client:
        assert upload(client, "reviews.csv", labelled_csv()).status_code == 201
        assert post_job(client, finetune_request("x")) == (
            422,
            {
                "error": "params: the job is too large: 19.3 K parameters (19,308) is more than the limit of 19.0 K "
                "(BERT_JOB_MAX_PARAMS)",
                "error_type": "validation",
            },
        )
    with make_client(data_dir, job_max_memory_gb=0.001, job_max_runtime=60) as client:
        status, body = post_job(client, finetune_request("x"))
        assert status == 422 and body["error"].startswith("params: the job is too large: an estimated 0.3 GB")
        assert body["error"].endswith(
            "is more than the limit of 0.001 GB (BERT_JOB_MAX_MEMORY_GB); a smaller "
            "batch_size or max_seq_len uses less (grad_accum_steps keeps the effective batch)"
        )
        assert post_job(client, finetune_request("x", max_runtime="2m"))[1]["error"] == (
            "params.max_runtime: 120 s is more than this service allows (60 s, BERT_JOB_MAX_RUNTIME)"
        )


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_cancelling_a_finished_job_is_409_and_changes_nothing(env, monkeypatch, state):
    client, _, data_dir = env
    accept_without_a_broker(monkeypatch)
    job_id = post_job(client, finetune_request(f"done-{state}"))[1]["id"]
    store = JobRecords(data_dir)
    store.update(job_id, lambda r: r.update(state=state, finished_at=now_iso()))
    before = store.read(job_id)
    r = client.post(f"/jobs/{job_id}/cancel")
    assert (r.status_code, r.json()) == (
        409,
        {
            "error": f"job '{job_id}' has already finished ({state}): there is nothing to cancel",
            "error_type": "conflict",
        },
    )
    assert store.read(job_id) == before and not store.cancel_requested(job_id)
    shutil.rmtree(data_dir / "jobs" / job_id)


def test_cancelling_a_queued_job_twice(env, monkeypatch):
    """The first cancel ends a queued job (202); the second finds it finished (409)."""
    client, _, data_dir = env
    accept_without_a_broker(monkeypatch)
    job_id = post_job(client, finetune_request("twice"))[1]["id"]
    r = client.post(f"/jobs/{job_id}/cancel")
    assert (r.status_code, r.json()["state"], r.json()["cancel_requested"]) == (202, "cancelled", True)
    assert client.post(f"/jobs/{job_id}/cancel").status_code == 409
    shutil.rmtree(data_dir / "jobs" / job_id)


def test_a_dotted_model_name_is_served_and_can_be_a_job_base_model(tmp_path):
    """One name rule for models, datasets and jobs: an imported `tiny.v2` is both served and trainable."""
    data_dir = make_data_dir(tmp_path / "data")
    shutil.copytree(data_dir / "models" / BASE_MODEL, data_dir / "models" / "tiny.v2")
    with make_client(data_dir) as client:
        assert client.get("/models/tiny.v2").json()["name"] == "tiny.v2"
        assert upload(client, "reviews.v2.csv", labelled_csv()).json()["name"] == "reviews.v2"
        status, body = post_job(client, {**finetune_request("clf.v2", dataset="reviews.v2"), "base_model": "tiny.v2"})
    assert status == 503 and body["error"].startswith("the job queue (broker) cannot be reached")  # validated


def test_job_lookups(env):
    client, _, _ = env
    assert client.get("/jobs/20240101T000000-0000abcd").json() == {
        "error": "job '20240101T000000-0000abcd' not found",
        "error_type": "not_found",
    }
    assert client.post("/jobs/20240101T000000-0000abcd/cancel").status_code == 404
    assert client.get("/jobs/20240101T000000-0000abcd/metrics").status_code == 404
    for bad in ("not-a-job", "x" * 100, "20240101T000000-0000abcd.json"):
        assert client.get(f"/jobs/{bad}").status_code == 422
    assert client.get("/jobs", params={"state": "bogus"}).json() == {
        "error": "query.state: Input should be 'queued', 'running', 'succeeded', 'failed' or 'cancelled'",
        "error_type": "validation",
    }


@pytest.mark.parametrize(
    "kinds, task, message",
    [
        (
            ("pairs", "scored-pairs", "labelled"),
            "cross-encoder",
            "dataset: 'wiki' is a corpus dataset; task cross-encoder needs a pairs, scored-pairs or labelled one",
        ),
        (
            ("pairs", "scored-pairs"),
            "sentence-embedding",
            "dataset: 'wiki' is a corpus dataset; task sentence-embedding needs a pairs or scored-pairs one",
        ),
    ],
)
def test_a_task_that_takes_several_kinds_names_them_all(env, kinds, task, message):
    """KINDS_OF_TASK maps a task to a tuple of kinds; the refusal names every one (the tasks need not be
    TASKS yet: the check reads the kinds it is given)."""
    from app.errors import ServiceError
    from datadir.datasets import KINDS_OF_TASK

    _, _, data_dir = env
    assert KINDS_OF_TASK[task] == kinds
    service = JobService(Settings(data_dir=data_dir, broker_url=NO_BROKER), data_dir)
    with pytest.raises(ServiceError) as e:
        service._dataset("wiki", kinds, task)
    assert e.value.message == message
    assert service._dataset("reviews", KINDS_OF_TASK["cross-encoder"], "cross-encoder")["kind"] == "labelled"


# ---------------------------------------------------------------------------- datasets


def upload(client, filename, body, **fields):
    return client.post("/datasets", files={"file": (filename, body)}, data=fields)


def test_datasets_are_described(env):
    client, _, _ = env
    listed = {d["name"]: d for d in client.get("/datasets").json()["datasets"]}
    assert listed["reviews"]["label_counts"] == {"negative": 20, "positive": 20}
    assert listed["wiki"]["format"] == "google" and listed["wiki"]["sentences"] == 120
    assert client.get("/datasets/wiki").json() == listed["wiki"]
    assert client.get("/datasets/ghost").json() == {"error": "dataset 'ghost' not found", "error_type": "not_found"}


BAD_UPLOADS = [
    (
        ("evil.exe", b"x"),
        {},
        422,
        "file 'evil.exe': expected a .txt, .csv, .tsv, .jsonl, .conll, .iob, .iob2, .bio, .json, .tar, .tar.gz, .tgz, "
        ".zip file",
    ),
    (("a.csv", labelled_csv()), {"name": "../x"}, 422, f"name: '../x' {NAME_RULE}"),
    (("a.csv", labelled_csv()), {"name": "/tmp/x"}, 422, f"name: '/tmp/x' {NAME_RULE}"),
    # nested past json's recursion limit: a 422 naming it, not a 500
    (
        ("deep.json", b'{"data": ' + b"[" * 9000 + b"]" * 9000 + b"}"),
        {},
        422,
        "file: not a usable SQuAD file: the file: not JSON for this reader: nested too deeply",
    ),
    (
        ("deep.jsonl", b'{"text": ' + b"[" * 9000 + b"]" * 9000 + b"}\n"),
        {},
        422,
        "file: not a usable corpus: the file, line 1: not valid JSON for this reader (nested too deeply)",
    ),
    (
        ("deep.jsonl", b'{"text": "a", "label": ' + b"[" * 9000 + b"]" * 9000 + b"}\n"),
        {"kind": "labelled"},
        422,
        "file: not a usable labelled table (columns text, label and optionally text_pair): the file, line 1: not valid "
        "JSON for this reader (nested too deeply)",
    ),
    (
        ("deep.jsonl", b'{"tokens": ' + b"[" * 9000 + b"]" * 9000 + b"}\n"),
        {"kind": "token-labelled"},
        422,
        "file: not a usable token-labelled file (CoNLL columns, or JSONL with tokens and tags; IOB2 tags): the file, "
        "line 1: not valid JSON for this reader (nested too deeply)",
    ),
    (
        ("a.csv", labelled_csv()),
        {"name": "reviews"},
        409,
        "name: dataset 'reviews' already exists (datasets are never replaced; "
        "upload under another name, or delete it first)",
    ),
    (
        ("a.csv", labelled_csv()),
        {"name": "a", "kind": "images"},
        422,
        "kind: 'images' is not one of corpus, labelled, token-labelled, qa, pairs, scored-pairs, retrieval",
    ),
    (
        ("a.txt", corpus_txt()),
        {"name": "a", "kind": "labelled"},
        422,
        "kind: a labelled dataset cannot be a .txt file (corpus: .txt, .jsonl; labelled: .csv, .tsv, .jsonl; "
        "token-labelled: .txt, .tsv, .jsonl, .conll, .iob, .iob2, .bio; qa: .json; pairs: .csv, .tsv, .jsonl; "
        "scored-pairs: .csv, .tsv, .jsonl; retrieval: .jsonl, .tar, .tar.gz, .tgz, .zip)",
    ),
    (
        ("a.csv", b"text,lab\nhello,1\n"),
        {},
        422,
        "file: not a usable labelled table (columns text, label and "
        "optionally text_pair): the file: missing column(s) ['label']; found ['lab', 'text']",
    ),
    (("a.csv", b"text,label\nhello,1\nbye,1\n"), {}, 422, "file: a classifier needs at least 2 labels, found ['1']"),
    (
        ("a.csv", b'text,label\n"hello,1\nbye,2\n'),
        {},
        422,
        "file: not a usable labelled table (columns text, label and optionally text_pair): the file, line 2: a quoted "
        'field opens here and is never closed (the file ends inside it); close the field with a " (a " inside a '
        'quoted field is written "")',
    ),
    (
        ("a.jsonl", b'{"text": "ok"}\nnot json\n'),
        {"kind": "corpus"},
        422,
        "file: not a usable corpus: the file, line 2: not valid JSON (Expecting value)",
    ),
    (("a.txt", b"\n\n  \n"), {}, 422, "file: the corpus has no text"),
    (("big.txt", b"word " * 5000), {}, 413, "dataset is larger than the limit of 20000 bytes (BERT_MAX_DATASET_BYTES)"),
]


@pytest.mark.parametrize("file, fields, status, message", BAD_UPLOADS, ids=[m[:40] for *_, m in BAD_UPLOADS])
def test_bad_uploads_are_refused_and_leave_nothing(env, file, fields, status, message):
    client, outer, data_dir = env
    before = tree(outer)
    r = upload(client, *file, **fields)
    assert (r.status_code, r.json()) == (
        status,
        {"error": message, "error_type": {422: "validation", 409: "conflict", 413: "too_large"}[status]},
    )
    assert tree(outer) == before  # the streamed temp directory is gone too


def test_a_name_with_a_final_newline_is_refused(env):
    """The name from a file name whose header holds a bare LF (python-multipart ends a header line at LF, so
    the filename keeps it): re.match's `$` matched before that newline and a dataset 'ab\\n' was stored."""
    client, outer, _ = env
    before = tree(outer)
    body = (
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="ab\n.csv"\r\n\r\n'
        + labelled_csv()
        + b"\r\n--b--\r\n"
    )
    r = client.post("/datasets", content=body, headers={"content-type": "multipart/form-data; boundary=b"})
    assert (r.status_code, r.json()) == (422, {"error": f"name: 'ab\\n' {NAME_RULE}", "error_type": "validation"})
    assert tree(outer) == before


def staging_dirs(data_dir) -> list[str]:
    return [p.name for p in (data_dir / "datasets").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "code, reason", [(errno.ENOSPC, "No space left on device"), (errno.EDQUOT, "Disk quota exceeded")]
)
def test_a_full_disk_is_507_and_removes_the_partial_upload(env, monkeypatch, code, reason):
    """Fault injection: the upload's file write fails as it does on a full disk (or quota)."""
    client, outer, data_dir = env

    def write(self, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(_Upload, "write", write)
    before = tree(outer)
    name = f"full-{code}"
    r = upload(client, "full.csv", labelled_csv(), name=name)
    assert (r.status_code, r.json()) == (
        507,
        {
            "error": f"not enough disk space in the data directory to store the dataset ({reason}); "
            "the upload was removed",
            "error_type": "insufficient_storage",
        },
    )
    assert tree(outer) == before and staging_dirs(data_dir) == []
    monkeypatch.undo()  # space again: the name was never taken
    assert upload(client, "full.csv", labelled_csv(), name=name).status_code == 201


def many_labels_csv(labels: int, rows_of_first: int = 1) -> bytes:
    rows = [f"text {i},label-{i}" for i in range(labels)] + [f"more text {k},label-0" for k in range(rows_of_first)]
    return ("text,label\n" + "\n".join(rows) + "\n").encode()


def test_label_counts_are_bounded_at_upload_and_at_job_submission(tmp_path, monkeypatch):
    data_dir = make_data_dir(tmp_path / "data")
    accept_without_a_broker(monkeypatch)
    with make_client(data_dir, max_labels=5) as client:
        r = upload(client, "six.csv", many_labels_csv(6))
        assert (r.status_code, r.json()) == (
            422,
            {
                "error": "file: 6 distinct labels, more than the 5 this service allows (BERT_MAX_LABELS)",
                "error_type": "validation",
            },
        )
        tags = "".join(f"w{i} B-T{i}\n\n" for i in range(6)).encode()  # 6 tags in CoNLL columns
        r = upload(client, "tags.conll", tags)
        assert r.json()["error"] == "file: 6 distinct labels, more than the 5 this service allows (BERT_MAX_LABELS)"
        r = upload(client, "long.csv", f"text,label\na,{'x' * 201}\nb,y\n".encode())
        assert r.json()["error"] == f"file: the label '{'x' * 40}'... is 201 characters long; a label has at most 200"
        assert not list((data_dir / "datasets").iterdir())
    with make_client(data_dir, max_labels=6) as client:  # a dataset taken in under a higher limit
        assert upload(client, "six.csv", many_labels_csv(6)).status_code == 201
    with make_client(data_dir, max_labels=5) as client:
        assert post_job(client, finetune_request("x", dataset="six")) == (
            422,
            {
                "error": "dataset: 'six' has 6 labels, more than the 5 this service trains (BERT_MAX_LABELS)",
                "error_type": "validation",
            },
        )


def test_a_dataset_description_lists_at_most_100_labels(tmp_path):
    with make_client(make_data_dir(tmp_path / "data")) as client:
        meta = upload(client, "many.csv", many_labels_csv(150, rows_of_first=3)).json()
        assert meta["num_labels"] == 150 and meta["rows"] == 153
        assert len(meta["labels"]) == len(meta["label_counts"]) == 100
        assert meta["label_counts"]["label-0"] == 4 and set(meta["labels"]) == set(meta["label_counts"])
        assert client.get("/datasets").json()["datasets"] == [meta]
        reviews = upload(client, "reviews.csv", labelled_csv()).json()
        assert (reviews["num_labels"], reviews["labels"]) == (2, ["negative", "positive"])


def test_a_txt_upload_is_text_even_when_it_starts_like_a_wikipedia_dump(tmp_path):
    dump = (
        b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n<page><title>A</title>\n'
        b"<revision><text>Some words here.</text></revision></page>\n</mediawiki>\n"
    )
    with make_client(make_data_dir(tmp_path / "data")) as client:
        r = upload(client, "dump.txt", dump)
        assert r.status_code == 201 and r.json()["format"] in ("google", "text")


def big_labelled_csv(first_text: str, rows: int) -> bytes:
    lines = [f"{first_text},positive"] + [
        f"row {i} says nothing much at all,{('negative', 'positive')[i % 2]}" for i in range(rows)
    ]
    return ("text,label\n" + "\n".join(lines) + "\n").encode()


@pytest.mark.slow
def test_an_upload_is_checked_in_a_child_process_with_a_time_bound(tmp_path, monkeypatch):
    data_dir = make_data_dir(tmp_path / "data")
    big = big_labelled_csv("fine", 40_000)  # 1.4 MB
    in_process = []
    monkeypatch.setitem(dataset_checks.CHECKS, "labelled", lambda *args, **kwargs: in_process.append(args))
    with make_client(data_dir, max_dataset_bytes=4 << 20) as client:
        r = upload(client, "small.csv", labelled_csv())
        assert r.status_code == 201 and r.json()["labels"] == ["negative", "positive"], r.json()
        r = upload(client, "big.csv", big)
        assert r.status_code == 201, r.json()
        assert (r.json()["rows"], r.json()["num_labels"]) == (40_001, 2)
        r = upload(client, "long.csv", big_labelled_csv("word " * 220_000, 10))  # one row of 1.1 M characters
        assert (r.status_code, r.json()) == (
            422,
            {
                "error": "file: row 1's text is longer than 1048576 characters, the most one example may hold",
                "error_type": "validation",
            },
        )
    assert in_process == []  # the checks ran in the child processes, never in the API process's threads
    # A check that takes longer than the bound is stopped, and the upload refused.
    with make_client(data_dir, max_dataset_bytes=4 << 20, dataset_check_seconds=0.01) as client:
        r = upload(client, "slow.csv", big)
        assert (r.status_code, r.json()) == (
            422,
            {
                "error": "file: checking the dataset took longer than 0.01 s "
                "(BERT_DATASET_CHECK_SECONDS); upload a smaller file",
                "error_type": "validation",
            },
        )
    assert sorted(p.name for p in (data_dir / "datasets").iterdir()) == ["big", "small"]


def test_get_datasets_follows_every_change_to_the_datasets(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    with make_client(data_dir) as client:
        assert client.get("/datasets").json() == {"datasets": []}
        first = upload(client, "one.csv", labelled_csv()).json()
        assert client.get("/datasets").json() == {"datasets": [first]}
        second = upload(client, "two.csv", labelled_csv()).json()
        assert client.get("/datasets").json() == {"datasets": [first, second]}
        meta = data_dir / "datasets" / "one" / "meta.json"  # meta.json is replaced whole, as the store does
        changed = {k: v for k, v in first.items() if k != "disk_bytes"} | {"original_filename": "renamed.csv"}
        (data_dir / "datasets" / "one" / "meta.new").write_text(json.dumps(changed))
        os.replace(data_dir / "datasets" / "one" / "meta.new", meta)
        changed["disk_bytes"] = sum(f.stat().st_size for f in (data_dir / "datasets" / "one").iterdir())
        assert client.get("/datasets").json() == {"datasets": [changed, second]}
        shutil.rmtree(data_dir / "datasets" / "two")
        assert client.get("/datasets").json() == {"datasets": [changed]}


def test_any_other_failure_while_storing_an_upload_is_a_logged_500(env, monkeypatch, caplog):
    _, outer, data_dir = env

    def write(self, data):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(_Upload, "write", write)
    before = tree(outer)
    with make_client(data_dir, raise_server_exceptions=False) as client:
        r = upload(client, "broken.csv", labelled_csv(), name="broken")
    assert (r.status_code, r.json()) == (500, {"error": "internal server error", "error_type": "internal"})
    assert tree(outer) == before and staging_dirs(data_dir) == []
    assert "unhandled error on POST /datasets" in caplog.text and "Input/output error" in caplog.text


def test_a_malformed_multipart_body_is_422_and_leaves_nothing(env):
    client, outer, data_dir = env
    before = tree(outer)
    r = client.post(
        "/datasets", content=b"no boundary here", headers={"content-type": "multipart/form-data; boundary=xyz"}
    )
    assert (r.status_code, r.json()) == (
        422,
        {
            "error": "malformed multipart body: it does not follow the multipart/form-data format with the boundary "
            "its Content-Type names",
            "error_type": "validation",
        },
    )
    assert tree(outer) == before and staging_dirs(data_dir) == []


def test_upload_kinds_and_names(env):
    client, outer, data_dir = env
    r = upload(client, "../../escape.jsonl", b'{"text": "one", "label": "a"}\n{"text": "two", "label": "b"}\n')
    assert r.status_code == 201, r.text
    meta = r.json()
    assert (meta["name"], meta["kind"], meta["file"], meta["rows"]) == ("escape", "labelled", "data.jsonl", 2)
    assert (data_dir / "datasets" / "escape" / "data.jsonl").is_file()
    assert not (outer / "escape.jsonl").exists() and not (outer.parent / "escape.jsonl").exists()
    r = upload(client, "notes.jsonl", b'{"text": "The cat sat. The dog ran."}\n')
    assert (r.status_code, r.json()["kind"], r.json()["sentences"]) == (201, "corpus", 2)
    r = client.post("/datasets", content=b"file=x", headers={"content-type": "text/plain"})
    assert r.json() == {
        "error": "send the dataset as multipart/form-data (curl -F file=@data.csv -F name=NAME -F kind=labelled), or "
        'JSON {"name": ..., "source": "<Hub dataset repo id>"} to import one',
        "error_type": "validation",
    }
    r = client.post(
        "/datasets", json={"file": "x"}
    )  # JSON: an import from the Hub (tests/app/test_dataset_import_api.py)
    assert r.json() == {
        "error": "name: Field required; source: Field required; file: Extra inputs are not permitted",
        "error_type": "validation",
    }


# ---------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "keys, header, status",
    [
        ({"admin_key": "adm"}, None, 401),
        ({"admin_key": "adm"}, "inference", 401),  # an inference key never opens the training routes
        ({"admin_key": "adm"}, "adm", 200),
        ({}, None, 401),  # no admin key: the API key guards them
        ({}, "inference", 200),
    ],
)
def test_training_routes_need_the_admin_key(tmp_path, keys, header, status):
    data_dir = make_data_dir(tmp_path / "data")
    with make_client(data_dir, service={"api_key": "inference"}, **keys) as client:
        headers = {"Authorization": f"Bearer {header}"} if header else {}
        for method, path in (("GET", "/jobs"), ("GET", "/datasets")):
            r = client.request(method, path, headers=headers)
            assert r.status_code == status
            if status == 401:
                which = "BERT_ADMIN_KEY" if keys else "BERT_API_KEY"
                assert r.json() == {
                    "error": f"missing or wrong key: send 'Authorization: Bearer <{which}>'",
                    "error_type": "unauthorized",
                }
        assert client.post("/jobs", json=finetune_request("x"), headers=headers).status_code == (
            422 if status == 200 else 401
        )


def test_open_without_any_key(tmp_path):
    with make_client(make_data_dir(tmp_path / "data")) as client:
        assert client.get("/jobs").json() == {"jobs": []}
        assert client.get("/datasets").json() == {"datasets": []}


def test_dataset_uploads_are_capped_by_their_own_limit_not_the_json_body_limit(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    body = labelled_csv(rows=400)  # ~12 kB: over the inference body limit below, under the dataset one
    with make_client(data_dir, service={"max_body_bytes": 2_000}, max_dataset_bytes=len(body) + 4_000) as client:
        r = client.post("/datasets", files={"file": ("big.csv", body)}, data={"name": "big"})
        assert r.status_code == 201, r.text
        assert r.json()["rows"] == 400
        r = client.post(
            "/embeddings", content=b'{"inputs": "' + b"x" * 3_000 + b'"}', headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
