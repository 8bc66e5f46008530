"""Keys on a real server (uvicorn over HTTP, the suite's Redis as the broker): three keys with
different limits hammered at once, each held to its own bucket while an unlimited key is served; a key
revoked or rotated through the real `bert keys` refused once the server reads the file again; two jobs keys that
see and cancel only their own jobs, the admin that sees all, a key's job limit; GET /usage, /metrics
and the audit log naming who did what; and the CLI's own output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, read_keys, write_keys
from datadir import JobRecords
from tests.helpers import (
    REDIS_URL,
    ROOT,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    start_server,
)

pytestmark = pytest.mark.slow

SECRETS = {name: new_secret() for name in ("flood", "steady", "free", "alice", "bob", "boss")}
LIMITS = {"flood": (20.0, 20), "steady": (5.0, 5)}  # (requests per second, burst)
INFERENCE = frozenset({"inference"})
KEYS = {
    "flood": Key("flood", hash_secret(SECRETS["flood"]), INFERENCE, rps=20.0, burst=20),
    "steady": Key("steady", hash_secret(SECRETS["steady"]), INFERENCE, rps=5.0, burst=5),
    "free": Key("free", hash_secret(SECRETS["free"]), INFERENCE),
    "alice": Key("alice", hash_secret(SECRETS["alice"]), frozenset({"jobs"}), max_jobs=2),
    "bob": Key("bob", hash_secret(SECRETS["bob"]), frozenset({"jobs"}), max_priority=1),
    "boss": Key("boss", hash_secret(SECRETS["boss"]), frozenset({"inference", "jobs", "admin", "metrics"})),
}

# A client in a process of its own (so its threads do not share the test's interpreter): `threads`
# connections post to /embeddings with one key for `seconds`, holding off while the file `pause`
# exists; prints the statuses and the time taken. It runs at the lowest CPU priority: it stands for
# clients on other machines, so on a small test machine its own CPU use must not count as the server
# being slow for the third key. Each connection sends at most PACE requests a second (5 to 20 times
# its key's limit), with the standard library's http.client, a tenth of httpx's CPU a request: even at
# that priority, on a machine busy with other work, it floods, and on a quiet one it floods no harder.
HAMMER = """
import http.client, json, os, sys, threading, time, collections, urllib.parse
os.nice(19)
url, secret, seconds, threads, pause = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
where = urllib.parse.urlsplit(url)
headers = {"Authorization": "Bearer " + secret, "Content-Type": "application/json"}
body = json.dumps({"inputs": "the cat"}).encode()
statuses, lock = collections.Counter(), threading.Lock()
PACE = 100
def run():
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    due = time.monotonic()
    while (now := time.monotonic()) < deadline:
        if os.path.exists(pause):
            time.sleep(0.002)
            continue
        if now < due:
            time.sleep(due - now)
        due = max(due, now) + 1 / PACE
        conn.request("POST", "/embeddings", body, headers)
        response = conn.getresponse()
        response.read()
        with lock:
            statuses[response.status] += 1
    conn.close()
start = time.monotonic()
deadline = start + seconds
workers = [threading.Thread(target=run) for _ in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(json.dumps({"statuses": statuses, "elapsed": time.monotonic() - start}))
"""


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def bert_keys(*args: str, data_dir, keys_file) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "app.cli", "keys", *args, "--file", str(keys_file), "--data-dir", str(data_dir)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    data_dir = make_data_dir(root / "data")
    keys_file = root / "keys.toml"
    write_keys(keys_file, dict(KEYS))
    flush_redis()
    server, url = start_server(data_dir, REDIS_URL, root, BERT_KEYS_FILE=str(keys_file))
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post(
                "/datasets",
                files={"file": ("reviews.csv", labelled_csv())},
                data={"name": "reviews"},
                headers=auth("boss"),
            )
            assert r.status_code == 201, r.text
            yield client, data_dir, keys_file
    finally:
        server.stop()


def latencies(client: httpx.Client, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        assert client.post("/embeddings", json={"inputs": "the cat"}, headers=auth("free")).status_code == 200
        times.append(time.perf_counter() - start)
    return times


def test_each_key_gets_its_own_limit_and_a_third_is_served_while_another_floods(system, tmp_path):
    """Two keys flood at many times their rates: each is held to its own bucket (never more answered than the
    bucket lets through in the time the client measured, which holds the server's window of its requests, and
    every refusal counted by the server as the client saw it), while a third key's requests are all answered.
    How fast the third key stays is measured by bench/bounds_bench.py, not here: it depends on the machine."""
    client, _, _ = system
    latencies(client, 20)  # loads the model, warms the connection
    pause, seconds = tmp_path / "pause", 9.0  # never created: the flood runs throughout
    hammers = {
        name: subprocess.Popen(
            [sys.executable, "-c", HAMMER, str(client.base_url), SECRETS[name], str(seconds), str(threads), str(pause)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, threads in (("flood", 2), ("steady", 1))
    }
    time.sleep(1.5)  # the clients are up and flooding
    latencies(client, 40)  # every one a 200
    results = {name: json.loads(p.communicate(timeout=120)[0]) for name, p in hammers.items()}
    usage = client.get("/usage", headers=auth("boss")).json()["keys"]
    for name, result in results.items():
        statuses = Counter({int(k): v for k, v in result["statuses"].items()})
        rps, burst = LIMITS[name]
        allowed = burst + rps * result["elapsed"]  # the bucket arithmetic: what the window lets through at most
        assert set(statuses) == {200, 429}, (name, statuses)
        assert statuses[429] > 50, (name, statuses)  # it really was flooded
        assert statuses[200] <= allowed + 1, (name, statuses, result["elapsed"])
        assert usage[name]["rate_limited"] == statuses[429], (name, usage[name], statuses)


# The keys file is read again at most every RECHECK_S (0.5 s) by the server's own clock; the bound here only
# keeps a broken reload from hanging the suite, and is generous for a loaded machine.
TAKEN_WITHIN_S = 30


def test_a_revoked_or_rotated_key_is_refused_at_the_next_check(system):
    client, data_dir, keys_file = system
    added = bert_keys("add", "temp", "--scope", "inference", data_dir=data_dir, keys_file=keys_file)
    assert added.returncode == 0, added.stderr
    secret = added.stdout.splitlines()[-1]
    headers = {"Authorization": f"Bearer {secret}"}
    deadline = time.monotonic() + TAKEN_WITHIN_S
    while client.get("/models", headers=headers).status_code != 200:
        assert time.monotonic() < deadline, f"the new key was not taken within {TAKEN_WITHIN_S} s"
        time.sleep(0.05)

    rotated = bert_keys("rotate", "temp", data_dir=data_dir, keys_file=keys_file)
    assert rotated.returncode == 0, rotated.stderr
    new_headers = {"Authorization": f"Bearer {rotated.stdout.splitlines()[-1]}"}
    started = time.monotonic()
    while client.get("/models", headers=headers).status_code != 401:
        assert time.monotonic() - started < TAKEN_WITHIN_S, "the old secret still works after the rotation"
        time.sleep(0.05)
    assert client.get("/models", headers=new_headers).status_code == 200

    started = time.monotonic()
    revoked = bert_keys("revoke", "temp", data_dir=data_dir, keys_file=keys_file)
    assert revoked.returncode == 0, revoked.stderr
    while (r := client.get("/models", headers=new_headers)).status_code != 401:
        assert time.monotonic() - started < TAKEN_WITHIN_S, "the revoked key still works after `bert keys revoke`"
        time.sleep(0.05)
    assert r.json() == {
        "error": "missing, unknown or revoked key: this service requires a key, as it has a keys file "
        "(BERT_KEYS_FILE); send 'Authorization: Bearer <key>' with the secret `bert keys add` printed",
        "error_type": "unauthorized",
    }


def test_jobs_keys_see_their_own_jobs_and_the_admin_all(system):
    client, data_dir, _ = system
    legacy = JobRecords(data_dir).create(
        {"kind": "finetune", "model_name": "old", "base_model": "tiny", "dataset": "reviews", "params": {}}
    )  # a record from before owners
    JobRecords(data_dir).update(legacy["id"], lambda r: r.update(state="succeeded", runtime_s=12.5))

    def submit(key: str, name: str) -> httpx.Response:
        return client.post("/jobs", json=finetune_request(name), headers={**auth(key), "X-Request-ID": f"req-{name}"})

    a1, a2 = submit("alice", "a1").json()["id"], submit("alice", "a2").json()["id"]
    r = submit("alice", "a3")
    assert (r.status_code, r.json()) == (
        429,
        {
            "error": "key 'alice' has 2 jobs queued or running, its limit (max_jobs); submit again when one has finished",
            "error_type": "overloaded",
        },
    )
    b1 = submit("bob", "b1").json()["id"]
    r = client.post("/jobs", json={**finetune_request("b2"), "priority": 2}, headers=auth("bob"))
    assert (r.status_code, r.json()["error"]) == (
        422,
        "priority: 2 is more than key 'bob' may give (1, its max_priority)",
    )

    def listed(key: str) -> set[str]:
        return {j["id"] for j in client.get("/jobs", headers=auth(key)).json()["jobs"]}

    assert listed("alice") == {a1, a2} and listed("bob") == {b1}
    assert listed("boss") >= {a1, a2, b1, legacy["id"]}
    assert client.get(f"/jobs/{a1}", headers=auth("alice")).json()["owner"] == "alice"
    assert client.get(f"/jobs/{legacy['id']}", headers=auth("boss")).json()["owner"] == "admin"
    not_found = {"error": f"job '{b1}' not found", "error_type": "not_found"}
    for method, path in (("GET", f"/jobs/{b1}"), ("GET", f"/jobs/{b1}/metrics"), ("POST", f"/jobs/{b1}/cancel")):
        r = client.request(method, path, headers=auth("alice"))
        assert (r.status_code, r.json()) == (404, not_found), path
    assert client.post(f"/jobs/{b1}/cancel", headers=auth("bob")).status_code == 202
    assert client.post(f"/jobs/{a2}/cancel", headers=auth("boss")).status_code == 202  # admin cancels any job
    assert submit("alice", "a4").status_code == 202  # a2 is cancelled: one of her two places is free

    usage = client.get("/usage", headers=auth("boss")).json()["keys"]
    assert usage["admin"]["job_seconds"] == 12.5
    assert usage["alice"]["requests"] >= 6 and usage["alice"]["job_seconds"] == 0.0
    metrics = client.get("/metrics", headers=auth("boss")).text
    assert 'bert_key_job_seconds{key="admin"} 12.5' in metrics
    assert 'bert_key_requests_total{key="bob"} 4.0' in metrics

    lines = [json.loads(line) for line in (data_dir / "audit.jsonl").read_text().splitlines()]
    api = [(e["key"], e["action"], e["target"], e["outcome"]) for e in lines if e["source"] == "api"]
    assert ("boss", "dataset.upload", "dataset reviews", "ok") in api
    assert ("alice", "job.submit", f"job {a1} (finetune of model a1)", "ok") in api
    assert ("alice", "job.submit", "a3", "overloaded") in api
    assert ("alice", "job.cancel", f"job {b1}", "not_found") in api
    assert ("bob", "job.cancel", f"job {b1}", "ok") in api
    assert ("bob", "job.submit", "b2", "validation") in api
    assert ("boss", "job.cancel", f"job {a2}", "ok") in api
    assert next(e for e in lines if e["target"] == f"job {a1} (finetune of model a1)")["request_id"] == "req-a1"
    text = (data_dir / "audit.jsonl").read_text()
    assert not any(secret in text for secret in SECRETS.values())


def test_the_cli_prints_the_secret_once_and_lists_no_hashes(tmp_path):
    keys_file, data_dir = tmp_path / "keys.toml", tmp_path / "data"
    r = bert_keys(
        "add", "svc", "--scope", "inference", "--scope", "jobs", "--model", "tiny", "--rps", "20",
        "--tokens-per-min", "100000", "--max-jobs", "3", "--max-priority", "5", "--worker-share", "0.25",
        data_dir=data_dir, keys_file=keys_file,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    *text, secret = r.stdout.splitlines()
    assert text == [
        f"added key 'svc' to {keys_file}: scopes inference, jobs; models tiny; rps=20, tokens_per_min=100000, "
        "max_jobs=3, max_priority=5, worker_share=0.25",
        "its secret, shown only this once (send it as 'Authorization: Bearer <secret>'):",
    ]
    assert secret.startswith("bsk_") and len(secret) == 47 and secret not in keys_file.read_text()
    assert read_keys(keys_file)["svc"].hash == hash_secret(secret)
    listed = bert_keys("list", data_dir=data_dir, keys_file=keys_file).stdout
    created = read_keys(keys_file)["svc"].created_at
    assert listed.splitlines() == [
        f"svc  created {created}  scopes inference, jobs; models tiny; rps=20, tokens_per_min=100000, max_jobs=3, "
        "max_priority=5, worker_share=0.25"
    ]
    rotated = bert_keys("rotate", "svc", data_dir=data_dir, keys_file=keys_file)
    new = rotated.stdout.splitlines()[-1]
    assert new != secret and read_keys(keys_file)["svc"].hash == hash_secret(new)
    again = bert_keys("add", "svc", data_dir=data_dir, keys_file=keys_file)
    assert (again.returncode, again.stderr) == (
        2,
        "bert keys: error: key 'svc' exists: `bert keys rotate svc` gives it a new secret\n",
    )
    bad = bert_keys("add", "x", "--scope", "jobs", "--worker-share", "2", data_dir=data_dir, keys_file=keys_file)
    assert (bad.returncode, bad.stderr) == (2, "bert keys: error: key 'x': worker_share must be in (0, 1], got 2.0\n")
    gone = bert_keys("revoke", "nobody", data_dir=data_dir, keys_file=keys_file)
    assert (gone.returncode, gone.stderr) == (2, f"bert keys: error: no key 'nobody' in {keys_file}\n")
    audit = [json.loads(line) for line in (data_dir / "audit.jsonl").read_text().splitlines()]
    assert [(e["key"], e["action"], e["target"], e["outcome"]) for e in audit] == [
        ("cli", "key.add", "key svc", "ok"),
        ("cli", "key.rotate", "key svc", "ok"),
    ]
