"""Priorities with real processes: a job of higher priority makes the low one running on the only worker
hand itself back at its next step; the low one resumes later and ends exactly as an uninterrupted run.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    REDIS_URL,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    read_metrics,
    read_record,
    start_server,
    start_worker,
    tiny_config,
    train_steps,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.slow

DONE = {"succeeded", "failed", "cancelled"}


def weights(data_dir, name: str) -> dict[str, torch.Tensor]:
    return load_file(data_dir / "models" / name / "v1" / "model.safetensors")


def test_a_higher_priority_job_takes_the_only_worker_and_the_low_one_resumes_exactly(tmp_path):
    from model.modeling import BertForPreTraining
    from model.tokenizer import BertTokenizer
    from tests.helpers import VOCAB

    flush_redis()
    data_dir = make_data_dir(tmp_path / "data")
    torch.manual_seed(0)  # a base without dropout: the resumed run's weights must equal an uninterrupted one's
    config = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertForPreTraining(config).save_pretrained(data_dir / "models" / "still", tokenizer=BertTokenizer.from_vocab(VOCAB))
    server, url = start_server(data_dir, REDIS_URL, tmp_path)
    worker = None
    try:
        client = httpx.Client(base_url=url, timeout=30)
        r = client.post("/datasets", files={"file": ("reviews.csv", labelled_csv())}, data={"name": "reviews"})
        assert r.status_code == 201, r.text
        worker = start_worker(
            data_dir, REDIS_URL, "only", tmp_path, BERT_JOB_PREEMPT_AFTER_S="0", BERT_JOB_PREEMPT_CHECK_S="0.001"
        )
        low_spec = {**finetune_request("low", max_steps=150, save_every=50), "base_model": "still", "priority": -3}
        low = client.post("/jobs", json=low_spec).json()["id"]
        wait_for(lambda: len(train_steps(data_dir, low)) >= 5, 60, "the low job training")

        high = client.post("/jobs", json={**finetune_request("high", max_steps=10), "priority": 2}).json()["id"]
        seen = max(train_steps(data_dir, low))  # the step it had logged once the high job was queued
        assert wait_state(client, high, DONE, timeout=60)["state"] == "succeeded"
        job = wait_state(client, low, DONE, timeout=90)
        assert (job["state"], job["step"], job["attempts"]) == ("succeeded", 150, 1)

        # Handed back at the step after the one it had logged (or that one), and made way for the high job.
        record = read_record(data_dir, low)
        made_way = next(e for e in record["events"] if e["event"] == "made way")
        resumes = [r["step"] for r in read_metrics(data_dir, low) if r["type"] == "resume"]
        assert len(resumes) == 1 and seen <= resumes[0] <= seen + 1, (seen, resumes)
        assert made_way["detail"] == (
            f"for a job of priority 2; at step {resumes[0]}, checkpoint checkpoints/step-{resumes[0]}"
        )
        assert (made_way["preempted_for"], made_way["preempted_for_owner"]) == (high, "anonymous")
        high_record = read_record(data_dir, high)
        assert made_way["at"] <= high_record["started_at"] <= high_record["finished_at"]
        resumed_at = next(e["at"] for e in record["events"] if e["event"] == "resumed")
        assert high_record["finished_at"] <= resumed_at  # not taken again ahead of the higher job
        assert train_steps(data_dir, low) == list(range(1, 151))  # every step once

        # The same job, uninterrupted: the same weights.
        again = client.post("/jobs", json={**low_spec, "model_name": "again"}).json()["id"]
        assert wait_state(client, again, DONE, timeout=90)["state"] == "succeeded"
        assert not [r for r in read_metrics(data_dir, again) if r["type"] == "resume"]
        resumed, uninterrupted = weights(data_dir, "low"), weights(data_dir, "again")
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    finally:
        if worker is not None:
            worker.kill()
        server.stop()
