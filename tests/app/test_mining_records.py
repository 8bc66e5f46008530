"""A mining job's crash windows that a kill -9 rarely hits, forced on its record (app/jobs/mining.py): a new
attempt cuts the embeddings a killed one wrote past its last count, and an attempt that finds its dataset
installed (the process died between the rename and the record) succeeds without mining again, while a
dataset of that name that is not its own is never taken for it."""

from __future__ import annotations

import json

import numpy as np

from app.jobs.mining import EMBEDDINGS, KIND, Mining
from datadir import jobs as transitions
from model.training.hard_negatives import MiningPlan
from tests.app.conftest import settings_for


def mining(tmp_path) -> Mining:
    return Mining(settings_for(tmp_path), embedder=lambda: None)  # nothing here embeds


def record(m: Mining, **progress) -> str:
    spec = {"kind": KIND, "model_name": "", "base_model": "tiny", "dataset": "faq", "params": {"name": "faq-hard"}}
    job_id = m.records.create({**spec, "owner": "alice"})["id"]
    m.records.update(job_id, lambda r: r.__setitem__("progress", progress))
    return job_id


def test_a_new_attempt_cuts_the_vectors_written_past_the_last_count(tmp_path):
    m = mining(tmp_path)
    job_id = record(m, step=2, dimension=4, model_version=1)
    vectors = np.arange(12, dtype="<f4").reshape(3, 4)
    (m.records.job_dir(job_id) / EMBEDDINGS).write_bytes(vectors.tobytes() + b"\x00\x01")  # a row and a torn one
    plan = MiningPlan.of([("a", "p"), ("b", "q")], ["x"])
    assert m._prepare(job_id, plan) == 2
    assert (m.records.job_dir(job_id) / EMBEDDINGS).read_bytes() == vectors[:2].tobytes()
    progress = m.records.read(job_id)["progress"]
    assert (progress["step"], progress["total_steps"], progress["anchors"], progress["corpus"]) == (2, 5, 2, 3)


def test_vectors_of_another_model_version_start_the_embedding_over(tmp_path):
    m = mining(tmp_path)
    job_id = record(m, step=0, total_steps=4)
    assert m._commit(job_id, 0, np.ones((2, 3), dtype=np.float32), 1, 4)
    assert m._commit(job_id, 2, np.ones((1, 3), dtype=np.float32), 2, 4) is False  # promoted meanwhile
    progress = m.records.read(job_id)["progress"]
    assert (progress["step"], progress["model_version"]) == (0, 2)
    assert (m.records.job_dir(job_id) / EMBEDDINGS).read_bytes() == b""


def test_an_installed_dataset_is_the_jobs_result_only_when_it_is_its_own(tmp_path):
    m = mining(tmp_path)
    result = {"dataset": "faq-hard", "rows": 3, "dropped": 0}
    job_id = record(m, publishing=result, published_sha256="abc")
    folder = tmp_path / "datasets" / "faq-hard"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(
        json.dumps({"name": "faq-hard", "kind": "pairs", "sha256": "abc", "owner": "alice"})
    )
    assert m._published(m.records.read(job_id)) == {**result, "sha256": "abc"}
    (folder / "meta.json").write_text(
        json.dumps({"name": "faq-hard", "kind": "pairs", "sha256": "abc", "owner": "bob"})
    )
    assert m._published(m.records.read(job_id)) is None
    m.records.move(job_id, transitions.start, "here")
    assert m._published(m.records.read(job_id) | {"progress": {}}) is None  # nothing noted: never published
