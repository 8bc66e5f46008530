"""worker/training.py and worker/recovery.py in-process (no Celery): what a delivery does in each
situation, the attempt limit, the soft time limit, and the recovery sweep."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from app.schemas.jobs import PretrainParams
from datadir import JobRecords
from datadir.cards import read_card
from datadir.jobs import phase_of
from model.model_card import evaluate_card
from model.modeling import BertForSequenceClassification, load_model
from model.precision_choice import cpu_kind, native_precisions
from model.training.checkpoint import is_complete, load_checkpoint
from tests.helpers import (
    REDIS_URL,
    LeaseHolder,
    corpus_txt,
    finetune_spec,
    labelled_csv,
    make_data_dir,
    write_dataset,
)
from worker.celery_app import make_celery
from worker.recovery import lost_reason, note_lost_attempt, sweep
from worker.settings import WorkerSettings
from worker.training import run_delivery, run_job


@pytest.fixture
def data_dir(tmp_path):
    root = make_data_dir(tmp_path / "data")
    write_dataset(root, "reviews", labelled_csv(), "reviews.csv")
    return root


@pytest.fixture
def settings(data_dir):
    return WorkerSettings(data_dir=data_dir, worker_device="cpu", job_progress_interval_s=0, job_max_attempts=3)


def test_a_delivery_trains_publishes_and_a_second_one_does_nothing(data_dir, settings):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    assert run_job(job_id, settings) == {"job": job_id, "outcome": "succeeded"}
    record = store.read(job_id)
    assert (record["state"], record["attempts"], record["progress"]["step"]) == ("succeeded", 1, 10)
    assert record["result"]["model_dir"] == "models/clf/v1" and record["latest_checkpoint"] == "checkpoints/step-10"
    assert (data_dir / "models" / "clf" / "v1" / "model.safetensors").is_file()
    assert run_job(job_id, settings) == {"job": job_id, "outcome": "already succeeded"}
    card = read_card(data_dir / "models" / "clf" / "v1")
    # what auto chooses from on this kind of CPU: each native precision measured on its outputs
    table = card.pop("precision")
    assert list(table) == [cpu_kind()] and table[cpu_kind()]["outputs"] == ["embeddings", "classification"]
    assert sorted(table[cpu_kind()]["precisions"]) == sorted(native_precisions())
    assert card == {  # a classifier: the job's own evaluation only
        "source": {"kind": "job", "job_id": job_id},
        "evaluation": {
            "set": "wiki-heldout-v1",
            "skipped": "BertForSequenceClassification has no masked-LM or next-sentence head",
        },
        "job_eval": record["result"]["eval"],
    }


def test_a_pretrained_model_is_published_with_its_heldout_scores(data_dir, settings):
    write_dataset(data_dir, "wiki", corpus_txt(), "wiki.txt")
    store = JobRecords(data_dir)
    params = PretrainParams(max_steps=4, batch_size=8, max_seq_len=32, save_every=4, log_every=1).to_record()
    job_id = store.create(
        {"kind": "pretrain", "model_name": "mlm", "base_model": "tiny", "dataset": "wiki", "params": params}
    )["id"]
    assert run_job(job_id, settings)["outcome"] == "succeeded"
    evaluation = read_card(data_dir / "models" / "mlm" / "v1")["evaluation"]
    assert evaluation == evaluate_card(data_dir / "models" / "mlm" / "v1")
    row = read_card(data_dir / "models" / "mlm" / "v1")["precision"][cpu_kind()]
    assert row["outputs"] == ["embeddings", "fill_mask", "nsp"] and row["set"] == "wiki-heldout-v1"
    assert (evaluation["sequences"], evaluation["set"]) == (128, "wiki-heldout-v1") and 0 <= evaluation[
        "nsp_accuracy"
    ] <= 1


def test_a_job_says_what_it_does_before_its_first_step(data_dir, settings, monkeypatch):
    """Loading the model, tokenising the corpus (bytes read of all), then training: each is in the record's
    progress before the first step report, which replaces it."""
    corpus = write_dataset(data_dir, "wiki", corpus_txt(), "wiki.txt") / "data.txt"
    store = JobRecords(data_dir)
    params = PretrainParams(max_steps=2, batch_size=8, max_seq_len=32, log_every=1).to_record()
    job_id = store.create(
        {"kind": "pretrain", "model_name": "mlm", "base_model": "tiny", "dataset": "wiki", "params": params}
    )["id"]
    written: list[dict] = []
    update = JobRecords.update

    def noting(self, job_id, change):  # every write of the record, as it was written
        record = update(self, job_id, change)
        written.append(copy.deepcopy(record["progress"]))
        return record

    monkeypatch.setattr(JobRecords, "update", noting)
    assert run_job(job_id, settings)["outcome"] == "succeeded"
    changes = [p for i, p in enumerate(written) if p and (i == 0 or p != written[i - 1])]
    first_step = next(i for i, p in enumerate(changes) if p.get("step"))
    size = corpus.stat().st_size
    assert [(p["phase"], p["phase_done"], p["phase_total"]) for p in changes[:first_step]] == [
        ("loading the model", None, None),
        ("tokenising the corpus", 0, size),
        ("tokenising the corpus", size, size),
        ("training", None, None),
    ]
    assert changes[first_step]["step"] == 1 and "phase" not in changes[first_step]
    assert (
        phase_of({"state": "running", "progress": changes[2]})
        == f"tokenising the corpus: {size:,} of {size:,} bytes read"
    )


def test_a_delivery_while_another_process_trains_does_nothing(data_dir, settings):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    store.update(job_id, lambda r: r.update(state="running", attempts=1))
    holder = LeaseHolder(data_dir, job_id)
    try:
        assert run_job(job_id, settings)["outcome"] == "running elsewhere"
    finally:
        holder.kill()
    record = store.read(job_id)
    assert (record["state"], record["attempts"]) == ("running", 1)
    assert record["events"][-1]["event"] == "duplicate delivery ignored"
    assert not (data_dir / "models" / "clf").exists()


def test_a_job_that_keeps_dying_is_failed_after_max_attempts(data_dir, settings):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    store.update(job_id, lambda r: r.update(state="running", attempts=3))  # three workers died on it
    assert run_job(job_id, settings)["outcome"] == "failed"
    record = store.read(job_id)
    assert record["state"] == "failed" and record["attempts"] == 3
    assert record["error"] == (
        "gave up after 3 attempts (BERT_JOB_MAX_ATTEMPTS); last: attempt 3 did not finish: the worker died"
    )
    assert run_job(job_id, settings)["outcome"] == "already failed"


def test_a_training_error_fails_the_job_with_its_message(data_dir, settings):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    (data_dir / "datasets" / "reviews" / "data.csv").write_text("text,label\n")  # emptied after validation
    assert run_job(job_id, settings)["outcome"] == "failed"
    record = store.read(job_id)
    assert record["state"] == "failed" and "has no data rows" in record["error"]
    assert (store.job_dir(job_id) / "error.log").is_file()


def test_a_worker_shutting_down_begins_nothing_and_sends_the_message_back(data_dir, settings):
    """Ctrl-C: after its warm shutdown handed a job back, a delivery of that job (its message sent again) finds
    the worker stopping; it leaves the job as it is and sends the message on for the next worker."""
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    stopping, sent = threading.Event(), []
    stopping.set()
    assert run_delivery(job_id, settings, shutting_down=stopping, requeue=sent.append) == {
        "job": job_id,
        "outcome": "not started: the worker is shutting down",
    }
    record = store.read(job_id)
    assert (sent, record["state"], record["attempts"]) == ([job_id], "queued", 0)


def test_a_stop_another_rank_asked_for_hands_the_job_back(data_dir, settings, monkeypatch):
    """Data parallel: the ranks stop together when any of them asks, and another rank's SIGTERM (the worker's warm
    shutdown, sent to every rank) may be seen before rank 0's own handler has run. Rank 0 then stops with no
    reason of its own: the job is handed back, not failed as if by a time limit."""
    from model.training.trainer import Trainer

    summed = Trainer._sum_over_ranks  # the step's one all-reduce, which carries every rank's stop flag

    def another_rank_asks_at_step_3(self, losses, tokens, asked):
        losses, counts, asked = summed(self, losses, tokens, asked)
        return losses, counts, asked or self.step == 3

    monkeypatch.setattr(Trainer, "_sum_over_ranks", another_rank_asks_at_step_3)
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf", max_steps=50))["id"]
    assert run_job(job_id, settings)["outcome"] == "handed back"
    record = store.read(job_id)
    assert (record["state"], record["attempts"], record["latest_checkpoint"]) == ("queued", 0, "checkpoints/step-3")


def test_a_cancel_before_the_first_step_never_trains(data_dir, settings):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    store.update(job_id, lambda r: r.update(state="running"))  # e.g. a worker died, then a cancel came
    store.request_cancel(job_id)
    assert run_job(job_id, settings)["outcome"] == "cancelled"
    assert store.read(job_id)["attempts"] == 0


def test_the_soft_time_limit_stops_at_a_step_with_a_checkpoint(data_dir, settings):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf", max_steps=50))["id"]
    limited = settings.model_copy(update={"job_soft_time_limit": 0})
    assert run_job(job_id, limited)["outcome"] == "failed"
    record = store.read(job_id)
    assert record["error"] == (
        "stopped by the soft time limit (BERT_JOB_SOFT_TIME_LIMIT) at step 1; checkpoint checkpoints/step-1"
    )
    assert is_complete(store.job_dir(job_id) / "checkpoints" / "step-1")


def test_max_runtime_stops_the_job_with_a_loadable_checkpoint(data_dir, settings):
    """Earlier attempts used 59.8 of the job's 60 s: this one stops at its first step past 0.2 s."""
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf", max_steps=100_000, save_every=0, max_runtime=60))["id"]
    store.update(job_id, lambda r: r.update(runtime_s=59.8))
    assert run_job(job_id, settings)["outcome"] == "failed"
    record = store.read(job_id)
    step = record["progress"]["step"]
    assert 1 <= step < 100_000 and record["runtime_s"] >= 60
    assert record["error"] == (
        f"time limit: the job's max_runtime (60 s) was reached at step {step}, after "
        f"{record['runtime_s']:.0f} s of training; checkpoint checkpoints/step-{step}"
    )
    assert record["events"][-1]["event"] == "time limit" and record["latest_checkpoint"] == f"checkpoints/step-{step}"
    checkpoint = store.job_dir(job_id) / record["latest_checkpoint"]
    assert is_complete(checkpoint)
    model = load_model(checkpoint)  # a model directory: the classifier as trained so far
    state = load_checkpoint(checkpoint, model=BertForSequenceClassification(model.config))["trainer"]
    assert state["step"] == step and isinstance(model, BertForSequenceClassification)
    assert model(torch.tensor([[2, 5, 3]])).logits.shape == (1, 2)


def test_a_job_whose_max_runtime_is_used_up_fails_without_training(data_dir, settings):
    """An attempt killed past its max_runtime: the next delivery does not start another."""
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf", max_runtime=30))["id"]
    store.update(job_id, lambda r: r.update(state="running", attempts=1, runtime_s=31.0))
    assert run_job(job_id, settings)["outcome"] == "failed"
    record = store.read(job_id)
    assert (record["attempts"], record["events"][-1]["event"]) == (1, "time limit")
    assert record["error"] == (
        "time limit: the job's max_runtime (30 s) was used up by its earlier attempts (31 s); latest checkpoint None"
    )
    assert not (store.job_dir(job_id) / "checkpoints").exists()


def test_runtime_adds_up_over_attempts(data_dir, settings):
    """A hand-back (worker shutdown) after one step, then a second attempt to the end: both count."""
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf", max_steps=10, max_runtime=600))["id"]

    class Set:
        def is_set(self):
            return True

    assert run_job(job_id, settings, shutting_down=Set())["outcome"] == "handed back"
    first = store.read(job_id)["runtime_s"]
    assert first > 0
    store.update(job_id, lambda r: r.update(runtime_s=first + 100))  # as if the first had taken 100 s more
    assert run_job(job_id, settings)["outcome"] == "succeeded"
    record = store.read(job_id)
    assert record["runtime_s"] > first + 100 and record["error"] is None


@pytest.mark.parametrize(
    "noted_attempt, reason",
    [
        (1, "the worker process was killed (SIGKILL; likely out of memory: the kernel's OOM killer sends SIGKILL)"),
        (0, "the worker died"),  # a note about an older attempt says nothing about this one
    ],
)
def test_a_lost_attempt_shows_why_it_was_lost(data_dir, settings, noted_attempt, reason):
    store = JobRecords(data_dir)
    job_id = store.create(finetune_spec("clf"))["id"]
    store.update(job_id, lambda r: r.update(state="running", attempts=1))
    if noted_attempt:
        note_lost_attempt(store, job_id, lost_reason("Worker exited prematurely: signal 9 (SIGKILL) Job: 0."))
    else:
        store.update(job_id, lambda r: r.update(lost_attempt={"attempt": 0, "reason": "stale"}))
    one = settings.model_copy(update={"job_max_attempts": 1})
    assert run_job(job_id, one)["outcome"] == "failed"
    record = store.read(job_id)
    assert (
        record["error"] == f"gave up after 1 attempts (BERT_JOB_MAX_ATTEMPTS); last: attempt 1 did not finish: {reason}"
    )
    lost = next(e for e in record["events"] if e["event"] == "attempt did not finish")
    assert lost["detail"] == f"attempt 1 did not finish: {reason}"


def test_lost_reasons():
    assert lost_reason("Worker exited prematurely: signal 11 (SIGSEGV) Job: 0.") == (
        "the worker process was killed by signal 11 (SIGSEGV)"
    )
    assert lost_reason("Worker exited prematurely: exitcode 70 Job: 0.") == (
        "the worker process exited unexpectedly (exit code 70)"
    )
    assert lost_reason("Worker exited prematurely: SystemExit.") == (
        "the worker process was lost: Worker exited prematurely: SystemExit."
    )


def test_the_sweep_resends_jobs_whose_lease_is_free_and_says_what_each_was(data_dir, caplog):
    store = JobRecords(data_dir)
    names = ("queued", "queued-too", "orphan", "alive", "done")
    ids = {name: store.create(finetune_spec(name))["id"] for name in names}
    for name, state in (("orphan", "running"), ("alive", "running"), ("done", "succeeded")):
        store.update(ids[name], lambda r, s=state: r.update(state=s))
    holder = LeaseHolder(data_dir, ids["alive"])
    sent = []
    try:
        with caplog.at_level("INFO", logger="bertserve.worker"):
            assert set(sweep(store, sent.append)) == {ids["queued"], ids["queued-too"], ids["orphan"]}
        waiting = ", ".join(r["id"] for r in store.list("queued"))  # the sweep's order: the listing's
        assert [r.getMessage() for r in caplog.records] == [
            f"recovery sweep: 2 jobs queued, waiting for a worker; sent again in case the broker lost the message: "
            f"{waiting}",
            f"recovery sweep: 1 job left running by a worker that stopped; sent again to resume from the latest "
            f"checkpoint: {ids['orphan']}",
        ]
        caplog.clear()
        with caplog.at_level("INFO", logger="bertserve.worker"):
            assert sweep(store, lambda *a: None, states=("running",)) == [ids["orphan"]]
        assert [r.getMessage() for r in caplog.records] == [
            f"recovery sweep: 1 job left running by a worker that stopped; sent again to resume from the latest "
            f"checkpoint: {ids['orphan']}"
        ]
    finally:
        holder.kill()
    assert sorted(sent) == sorted([ids["queued"], ids["queued-too"], ids["orphan"]])
    event = store.read(ids["queued"])["events"][-1]
    assert (event["event"], event["detail"]) == (
        "re-enqueued",
        "recovery sweep: queued, waiting for a worker; sent again in case the broker lost the message",
    )
    assert store.read(ids["orphan"])["events"][-1]["event"] == "re-enqueued"


def test_the_celery_app_is_configured_for_long_jobs(tmp_path):
    app = make_celery(
        WorkerSettings(
            data_dir=tmp_path,
            broker_url=REDIS_URL,
            visibility_timeout=7200,
            job_soft_time_limit=100,
            job_time_limit_grace=20,
        )
    )
    conf = app.conf
    assert (conf.task_serializer, conf.result_serializer, conf.accept_content) == ("json", "json", ["json"])
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.task_default_queue == "training" and conf.task_time_limit == 120
    assert conf.broker_transport_options == {"visibility_timeout": 7200}
    assert conf.worker_enable_remote_control  # celery inspect / Flower; off for the embedded transports
    embedded = make_celery(WorkerSettings(data_dir=tmp_path, broker_url="filesystem://"))
    assert not embedded.conf.worker_enable_remote_control
    import worker.tasks

    # one task for every kind (the record says which), and the names earlier versions sent, for messages
    # still queued at an upgrade
    assert {"bert.train", "bert.pretrain", "bert.finetune"} <= set(worker.tasks.app.tasks.keys())
