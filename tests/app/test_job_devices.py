"""params.devices: bounded by BERT_JOB_MAX_DEVICES at POST /jobs (exact 422 bodies), and by what the
worker has (BERT_WORKER_DEVICES) when it starts the job. Data-parallel jobs through a real worker are in
tests/worker/test_data_parallel_jobs.py."""

from __future__ import annotations

import pytest

from model.errors import UserError
from tests.app.test_jobs_api import make_client, post_job
from tests.helpers import finetune_request, labelled_csv, make_data_dir
from worker.settings import WorkerSettings
from worker.training import check_devices


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    data_dir = make_data_dir(tmp_path_factory.mktemp("devices") / "data")
    with make_client(data_dir) as client:
        files = {"file": ("reviews.csv", labelled_csv())}
        assert client.post("/datasets", files=files, data={"name": "reviews"}).status_code == 201
    return data_dir


@pytest.mark.parametrize(
    "limit, devices, status, error",
    [
        (1, 2, 422, "params.devices: 2 is more than this service allows (1, BERT_JOB_MAX_DEVICES)"),
        (2, 3, 422, "params.devices: 3 is more than this service allows (2, BERT_JOB_MAX_DEVICES)"),
        (2, 2, 503, None),  # valid: it reaches the (unreachable) broker
    ],
)
def test_devices_are_bounded_by_the_service(data_dir, limit, devices, status, error):
    with make_client(data_dir, job_max_devices=limit) as client:
        code, body = post_job(client, finetune_request("wide", devices=devices))
    assert code == status
    if error is not None:
        assert body == {"error": error, "error_type": "validation"}


def test_devices_below_one_are_a_validation_error(data_dir):
    with make_client(data_dir) as client:
        code, body = post_job(client, finetune_request("wide", devices=0))
    assert (code, body) == (
        422,
        {"error": "finetune.params.devices: Input should be greater than or equal to 1", "error_type": "validation"},
    )


def test_a_worker_with_fewer_devices_refuses_the_job(tmp_path):
    settings = WorkerSettings(data_dir=tmp_path, worker_device="cpu", worker_devices=2)
    check_devices(2, settings)
    with pytest.raises(UserError) as e:
        check_devices(3, settings)
    assert str(e.value) == "params.devices is 3, but this worker runs at most 2 processes (BERT_WORKER_DEVICES)"
