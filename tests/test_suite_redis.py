"""The suite never touches a Redis it did not start: a user's Redis on 127.0.0.1:6379 keeps its data.

A real Redis-touching test (`bert init`, which flushes the test database and queues the bootstrap job)
runs in a pytest of its own, without BERT_TEST_REDIS_URL, beside a redis-server on 127.0.0.1:6379
that stands for the user's and holds a key in database 5 (the one the suite used to flush) and one in
database 0. Both run in a network namespace of their own, so the machine's real 127.0.0.1:6379, if
any, is not involved. Needs root, `unshare`, `ip`, `setpriv` and `redis-server`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REDIS_TOUCHING_TEST = (
    "tests/app/cli/test_service_commands.py::test_init_fills_an_empty_data_dir_once_even_when_run_twice_at_once"
)

# Run inside the namespace: the user's Redis, its keys, the inner pytest, then what is left of the keys.
BESIDE_A_USERS_REDIS = """
import json, os, subprocess, sys, tempfile, time
import redis
home = tempfile.mkdtemp()
server = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "redis-server", "--port", "6379", "--bind", "127.0.0.1",
                           "--dir", home, "--save", "", "--appendonly", "no"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def contents(db):
    return {k.decode(): db.get(k).decode() if db.type(k) == b"string" else db.type(k).decode() for k in db.keys()}
try:
    users = [redis.Redis(port=6379, db=db) for db in (5, 0)]
    for _ in range(100):
        try:
            users[0].ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    users[0].set("users-key", "kept")
    users[1].set("users-key-db0", "kept")
    env = {k: v for k, v in os.environ.items() if k != "BERT_TEST_REDIS_URL"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", sys.argv[1]], env=env,
                         capture_output=True, text=True)
    print(json.dumps({"returncode": run.returncode, "tail": run.stdout[-2000:] + run.stderr[-2000:],
                      "db5": contents(users[0]), "db0": contents(users[1])}))
finally:
    server.kill()
"""


@pytest.mark.slow
def test_a_key_in_the_users_redis_survives_a_redis_touching_test():
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("unshare", "ip", "redis-server", "setpriv")):
        pytest.skip(
            "needs root, unshare, ip, setpriv and redis-server for a network namespace with its own 127.0.0.1:6379"
        )
    script = f"ip link set lo up && exec {sys.executable} -c '{BESIDE_A_USERS_REDIS}' {REDIS_TOUCHING_TEST}"
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["returncode"] == 0, result["tail"]  # the inner test ran and passed
    assert result["db5"] == {"users-key": "kept"}  # not flushed, and nothing queued there
    assert result["db0"] == {"users-key-db0": "kept"}
