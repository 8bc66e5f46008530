"""`python -m worker.health`, the compose worker's healthcheck, against a real worker and a real
redis-server: healthy while the worker consumes, unhealthy for another node, a dead broker, or a
transport without remote control."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, RedisServer, child_env, start_worker

pytestmark = pytest.mark.slow


def health(data_dir, broker_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.health", "--timeout", "2", *args],
        cwd=ROOT,
        env=child_env(data_dir, broker_url),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_consuming_worker_is_healthy_and_nothing_else_is(tmp_path):
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    data_dir = tmp_path / "data"
    worker = start_worker(data_dir, redis.url, "probe", tmp_path)
    try:
        ok = health(data_dir, redis.url, "--node", "probe@%h")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.strip().endswith(": ok")

        other = health(data_dir, redis.url, "--node", "nobody@%h")
        assert other.returncode == 1 and "no reply within 2 s" in other.stdout

        worker.stop()
        gone = health(data_dir, redis.url, "--node", "probe@%h")
        assert gone.returncode == 1, "a stopped worker must not look healthy"

        redis.kill()
        down = health(data_dir, redis.url, "--node", "probe@%h")
        assert down.returncode == 1 and "broker unreachable" in down.stderr
    finally:
        worker.kill()
        redis.kill()


def test_a_transport_without_remote_control_is_refused_with_the_reason(tmp_path):
    result = health(tmp_path, f"sqla+sqlite:///{tmp_path}/broker.sqlite")
    assert result.returncode == 2 and "has no remote control" in result.stderr
