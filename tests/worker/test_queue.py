"""worker/queue.py: kombu's transport options per broker URL."""

from __future__ import annotations

from worker.queue import VISIBILITY_TIMEOUT_S, broker_transport_options, has_fanout, producer
from worker.settings import WorkerSettings


def test_broker_options_follow_the_url(tmp_path):
    assert broker_transport_options("redis://h:6379/0", tmp_path, 99) == {"visibility_timeout": 99}
    assert broker_transport_options("sqla+sqlite:////x.db", tmp_path, 99) == {}
    folder = str(tmp_path / "broker")
    assert broker_transport_options("filesystem://", tmp_path, 99) == {
        "data_folder_in": folder,
        "data_folder_out": folder,
        "control_folder": f"{folder}/control",
    }
    assert broker_transport_options(f"filesystem://{tmp_path}/q", tmp_path, 99)["data_folder_in"] == f"{tmp_path}/q"


def test_remote_control_needs_a_fanout_transport():
    assert has_fanout("redis://h:6379/0") and has_fanout("amqp://guest@h//")
    assert not has_fanout("sqla+sqlite:////x.db") and not has_fanout("filesystem://")


def test_the_publisher_and_the_workers_default_share_one_visibility_timeout(tmp_path, monkeypatch):
    monkeypatch.delenv("BERT_VISIBILITY_TIMEOUT", raising=False)
    assert WorkerSettings().visibility_timeout == VISIBILITY_TIMEOUT_S
    celery = producer("redis://127.0.0.1:6379/0", tmp_path)
    assert celery.conf.broker_transport_options == {"visibility_timeout": VISIBILITY_TIMEOUT_S}
