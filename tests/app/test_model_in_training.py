"""A model that a training job is still producing answers 503 naming the job (its progress: step, phase, time
to go), then is served as soon as the job publishes it; /fill-mask and /nsp may default to another model than
/embeddings, and when the job that was to make their default ended without it, they name the job and how to
start it again. /ready names no fill-mask model until there is one, and shows the job."""

from __future__ import annotations

import shutil

import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from datadir import JobRecords, jobs
from datadir.defaults import set_default
from model.modeling import BertForPreTraining
from tests.app.conftest import save_tiny, serve_app, settings_for
from worker.settings import WorkerSettings
from worker.training import JobReporter

pytestmark = pytest.mark.anyio


@pytest.fixture
def own_data_dir(tmp_path, data_dir):
    root = tmp_path / "data"
    shutil.copytree(data_dir / "models" / "tiny-enc", root / "models" / "tiny-enc")
    return root


def wiki_mlm_job(store: JobRecords, max_steps: int) -> dict:
    """The job that makes the default MLM model 'wiki-mlm' (as the bootstrap job does), queued."""
    spec = {"kind": "pretrain", "model_name": "wiki-mlm", "base_model": "tiny-enc", "dataset": "wiki"}
    return store.create({**spec, "params": {"max_steps": max_steps}})


def job_body(record: dict, state: str, step: int, phase: str | None = None, eta_s: float | None = None) -> dict:
    """The `job` of a 503 and /ready's `mlm_job` (app/errors.py's JobProgress)."""
    return {
        "id": record["id"],
        "model_name": record["model_name"],
        "state": state,
        "step": step,
        "total_steps": record["params"]["max_steps"],
        "phase": phase,
        "eta_s": eta_s,
        "status_url": f"/jobs/{record['id']}",
    }


def reporter(data_dir, store: JobRecords, record: dict) -> JobReporter:
    """The worker's progress reporter for the job, as its attempt writes the record (worker/training.py)."""
    store.move(record["id"], jobs.start, "host:1")
    return JobReporter(store, store.read(record["id"]), WorkerSettings(data_dir=data_dir, job_progress_interval_s=0))


async def test_ready_and_the_503_tell_the_job_its_progress_and_what_answers_meanwhile(own_data_dir):
    """While the default MLM model's job is queued, gets ready (a phase, no pace yet) and trains (a pace):
    /ready names no fill-mask model and shows the job; the 503 says the same in words, with what works now."""
    store = JobRecords(own_data_dir)
    record = wiki_mlm_job(store, 300)
    settings = settings_for(own_data_dir, default_model="tiny-enc", default_mlm_model="wiki-mlm")
    meanwhile = "; meanwhile /embeddings and /similarity answer with model 'tiny-enc'"
    tokenising = "tokenising the corpus: 1,048,576 of 4,825,178 bytes read"
    seen = [
        ("queued, step 0 of 300, not started yet", job_body(record, "queued", 0)),
        (
            f"running, step 0 of 300, {tokenising}, no time estimate before its first step report",
            job_body(record, "running", 0, phase=tokenising),
        ),
        (
            "running, step 45 of 300, about 19 min to go at its current pace",
            job_body(record, "running", 45, eta_s=1140.0),
        ),
    ]
    async with serve_app(settings) as client:
        for i, (words, job) in enumerate(seen):
            if i == 1:
                report = reporter(own_data_dir, store, record)
                report.on_prepare("loading the model")
                report.on_prepare("tokenising the corpus", 1_048_576, 4_825_178)
            elif i == 2:
                report.on_fit_start(0, False)
                report.on_step({"step": 45, "total_steps": 300, "loss": 7.1, "lr": 1e-4, "eta_s": 1140.0})
            assert (await client.get("/ready")).json() == {
                "status": "ready",
                "model": "tiny-enc",
                "mlm_model": None,
                "mlm_job": job,
            }
            r = await client.post("/fill-mask", json={"inputs": "the cat [MASK] on the mat."})
            assert (r.status_code, r.json()) == (
                503,
                {
                    "error": f"model 'wiki-mlm' is still being trained by job {record['id']} ({words}); "
                    f"it is served as soon as the job finishes{meanwhile}",
                    "error_type": "unavailable",
                    "job": job,
                },
            )
            assert (await client.get(f"/jobs/{record['id']}")).json()["phase"] == job["phase"]
        r = await client.post("/nsp", json={"inputs": {"text_a": "the cat sat.", "text_b": "it ran."}})
        assert r.status_code == 503 and r.json()["job"] == seen[-1][1]
        # The encoder default is unaffected.
        assert (await client.post("/embeddings", json={"inputs": "the cat"})).status_code == 200

        # The job publishes its model: served at once, no restart, and /ready names it.
        save_tiny(own_data_dir / "models" / "wiki-mlm", BertForPreTraining)
        store.update(record["id"], lambda r: r.update(state="succeeded"))
        r = await client.post("/fill-mask", json={"inputs": "the cat [MASK] on the mat.", "top_k": 2})
        assert r.status_code == 200 and len(r.json()) == 2
        assert (await client.post("/nsp", json={"inputs": {"text_a": "a", "text_b": "b"}})).status_code == 200
        assert (await client.get("/ready")).json() == {
            "status": "ready",
            "model": "tiny-enc",
            "mlm_model": "wiki-mlm",
            "mlm_job": None,
        }


async def test_a_failed_job_leaves_a_plain_404(own_data_dir):
    store = JobRecords(own_data_dir)
    record = store.create(
        {"kind": "pretrain", "model_name": "gone", "base_model": None, "dataset": "wiki", "params": {"max_steps": 10}}
    )
    store.update(record["id"], lambda r: r.update(state="failed"))
    async with serve_app(settings_for(own_data_dir, default_model="tiny-enc")) as client:
        r = await client.post("/fill-mask", json={"inputs": "a [MASK]", "model": "gone"})
        assert r.status_code == 404
        assert r.json() == {"error": "model 'gone' not found (available: tiny-enc)", "error_type": "not_found"}


@pytest.mark.parametrize("ended", ["cancelled", "failed"])
async def test_a_default_mlm_model_whose_job_ended_names_the_job_and_how_to_start_it_again(own_data_dir, ended):
    store = JobRecords(own_data_dir)
    record = wiki_mlm_job(store, 200)
    store.move(record["id"], jobs.start, "host:1")
    store.update(record["id"], lambda r: r.update(progress={"step": 22, "total_steps": 200}))
    if ended == "cancelled":
        store.request_cancel(record["id"])
        store.move(record["id"], jobs.cancel, "at step 22, checkpoint checkpoints/step-22")
    else:
        store.move(record["id"], jobs.fail, "ValueError: boom")
    store.update(record["id"], lambda r: r.update(latest_checkpoint="checkpoints/step-22"))
    set_default(own_data_dir, "mlm", "wiki-mlm")  # as the first start chose it
    why = ": ValueError: boom" if ended == "failed" else ""
    async with serve_app(settings_for(own_data_dir, default_model="tiny-enc")) as client:
        for route, body in (
            ("/fill-mask", {"inputs": "a [MASK]"}),
            ("/nsp", {"inputs": {"text_a": "a", "text_b": "b"}}),
        ):
            r = await client.post(route, json=body)
            assert (r.status_code, r.json()) == (
                503,
                {
                    "error": f"model 'wiki-mlm', the default for /fill-mask and /nsp, is missing: job {record['id']} "
                    f"that makes it was {ended} at step 22 of 200{why}; start it again with `bert init`, or by "
                    "starting `bert up` (`make run`) again, which resumes it from checkpoints/step-22",
                    "error_type": "unavailable",
                    "job": job_body(record, ended, 22),
                },
            )
        assert (await client.get("/ready")).json() == {
            "status": "ready",
            "model": "tiny-enc",
            "mlm_model": None,
            "mlm_job": job_body(record, ended, 22),
        }


async def test_the_503_names_another_keys_job_without_its_id(own_data_dir, tmp_path):
    """An inference key is told a model is being made by another key's job, with no id and no `job`; the
    job's own key and an admin key get the id, and the job, as before."""
    store = JobRecords(own_data_dir)
    spec = {"kind": "pretrain", "model_name": "later", "base_model": "tiny-enc", "dataset": "wiki"}
    record = store.create({**spec, "params": {"max_steps": 300}, "owner": "alice"})
    keys = {"reader": {"inference"}, "alice": {"inference", "jobs"}, "boss": {"inference", "admin"}}
    secrets = {name: new_secret() for name in keys}
    keys_file = tmp_path / "keys.toml"
    write_keys(keys_file, {n: Key(n, hash_secret(secrets[n]), frozenset(keys[n])) for n in keys})
    settings = settings_for(own_data_dir, default_model="tiny-enc", keys_file=keys_file)
    async with serve_app(settings) as client:
        answers = {
            name: await client.post(
                "/embeddings", json={"inputs": "a", "model": "later"}, headers={"Authorization": f"Bearer {secret}"}
            )
            for name, secret in secrets.items()
        }
    assert (answers["reader"].status_code, answers["reader"].json()) == (
        503,
        {
            "error": "model 'later' is still being trained by another key's job (queued, step 0 of 300, not started "
            "yet); it is served as soon as the job finishes",
            "error_type": "unavailable",
        },
    )
    for name in ("alice", "boss"):
        assert (answers[name].status_code, answers[name].json()["job"]["id"]) == (503, record["id"])
        assert answers[name].json()["error"].startswith(f"model 'later' is still being trained by job {record['id']} ")


async def test_a_default_mlm_model_whose_job_ended_is_told_to_another_key_without_the_job(own_data_dir, tmp_path):
    store = JobRecords(own_data_dir)
    record = wiki_mlm_job(store, 200)  # no owner: the admin's
    store.move(record["id"], jobs.start, "host:1")
    store.update(record["id"], lambda r: r.update(progress={"step": 22, "total_steps": 200}))
    store.move(record["id"], jobs.fail, "ValueError: boom")
    store.update(record["id"], lambda r: r.update(latest_checkpoint="checkpoints/step-22"))
    set_default(own_data_dir, "mlm", "wiki-mlm")
    secret = new_secret()
    write_keys(tmp_path / "keys.toml", {"reader": Key("reader", hash_secret(secret), frozenset({"inference"}))})
    settings = settings_for(own_data_dir, default_model="tiny-enc", keys_file=tmp_path / "keys.toml")
    async with serve_app(settings) as client:
        r = await client.post("/fill-mask", json={"inputs": "a [MASK]"}, headers={"Authorization": f"Bearer {secret}"})
        ready = (await client.get("/ready")).json()  # open, while /fill-mask needs a key: no job
    assert ready == {"status": "ready", "model": "tiny-enc", "mlm_model": None, "mlm_job": None}
    assert (r.status_code, r.json()) == (
        503,
        {
            "error": "model 'wiki-mlm', the default for /fill-mask and /nsp, is missing: another key's job that makes "
            "it was failed at step 22 of 200; start it again with `bert init`, or by starting `bert up` (`make run`) "
            "again",
            "error_type": "unavailable",
        },
    )
