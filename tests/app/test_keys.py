"""Keys as data, over real ASGI: the keys file's keys and their scopes (401 and 403 with the exact
bodies), allowed models, the token rate after tokenising, the request rate's headers, a broken file
on reload (the last keys stay, /info says why) and at start (no service), the built-in keys beside the
file's, the exposure guard, and the keys file itself (atomic, locked writes). The server-level ones (many
keys hammered at once, revocation through the CLI, ownership of jobs, /usage, the audit log) are in
test_keys_server.py."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from app.keys.keyfile import Key, KeyFileError, change, hash_secret, new_secret, read_keys, write_keys
from app.keys.keyring import RECHECK_S
from app.launcher.server import exposure_refusal
from app.main import create_app
from tests.app.conftest import serve_app, settings_for
from tests.helpers import labelled_csv, make_data_dir

pytestmark = pytest.mark.anyio

SECRETS = {name: new_secret() for name in ("reader", "trainer", "boss", "narrow", "thrifty", "quick")}
KEYS = {
    "reader": Key("reader", hash_secret(SECRETS["reader"]), frozenset({"inference"})),
    "trainer": Key("trainer", hash_secret(SECRETS["trainer"]), frozenset({"jobs"})),
    "boss": Key("boss", hash_secret(SECRETS["boss"]), frozenset({"inference", "jobs", "admin", "metrics"})),
    "narrow": Key("narrow", hash_secret(SECRETS["narrow"]), frozenset({"inference"}), models=("tiny-cls",)),
    "thrifty": Key("thrifty", hash_secret(SECRETS["thrifty"]), frozenset({"inference"}), tokens_per_min=60),
    "quick": Key("quick", hash_secret(SECRETS["quick"]), frozenset({"inference"}), rps=0.5, burst=2),
}
REFUSAL = {
    "error": "missing, unknown or revoked key: this service requires a key, as it has a keys file (BERT_KEYS_FILE); "
    "send 'Authorization: Bearer <key>' with the secret `bert keys add` printed",
    "error_type": "unauthorized",
}


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.toml"
    write_keys(path, dict(KEYS))
    return path


async def test_unknown_keys_are_401_and_scopes_403_naming_scope_and_key(data_dir, keys_file, caplog):
    caplog.set_level("INFO", logger="bertserve")
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        starting = f"keys: required on every route but /health and /ready: 6 keys from {keys_file} (BERT_KEYS_FILE)"
        assert starting in [r.getMessage() for r in caplog.records]
        for headers in ({}, {"Authorization": "Bearer bsk_nothing"}, {"Authorization": f"Basic {SECRETS['reader']}"}):
            r = await c.post("/embeddings", json={"inputs": "the cat"}, headers=headers)
            assert (r.status_code, r.json()) == (401, REFUSAL)
        assert (await c.get("/nowhere")).json() == REFUSAL  # a miss is a 401 like a hit
        assert (await c.post("/embeddings", json={"inputs": "the cat"}, headers=auth("reader"))).status_code == 200
        r = await c.get("/jobs", headers=auth("reader"))
        assert (r.status_code, r.json()) == (
            403,
            {
                "error": "key 'reader' lacks the scope 'jobs' that GET /jobs needs (its scopes: inference)",
                "error_type": "forbidden",
            },
        )
        r = await c.post("/embeddings", content=b"{", headers=auth("trainer"))  # 403 before the body is read
        assert r.status_code == 403 and "lacks the scope 'inference' that POST /embeddings needs" in r.json()["error"]
        r = await c.get("/metrics", headers=auth("reader"))
        assert (
            r.json()["error"]
            == "key 'reader' lacks the scope 'metrics' that GET /metrics needs (its scopes: inference)"
        )
        r = await c.get("/usage", headers=auth("trainer"))
        assert (r.status_code, r.json()["error_type"]) == (403, "forbidden") and "'admin'" in r.json()["error"]
        assert (await c.get("/jobs", headers=auth("trainer"))).status_code == 200
        assert (await c.get("/metrics", headers=auth("boss"))).status_code == 200
        assert (await c.get("/info", headers=auth("trainer"))).status_code == 200  # any key
        for path in ("/health", "/ready"):
            assert (await c.get(path)).status_code == 200
    # the log names keys by their names, and never holds a secret
    assert "GET /jobs: key 'reader' lacks the scope 'jobs'" in caplog.text
    assert not any(secret in caplog.text for secret in SECRETS.values())


async def test_a_key_uses_only_its_models_the_default_resolved(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        r = await c.post("/embeddings", json={"inputs": "the cat"}, headers=auth("narrow"))  # default: tiny-pt
        assert (r.status_code, r.json()) == (
            403,
            {"error": "key 'narrow' may not use model 'tiny-pt' (its models: tiny-cls)", "error_type": "forbidden"},
        )
        r = await c.post("/classify", json={"inputs": "the cat", "model": "tiny-cls"}, headers=auth("narrow"))
        assert r.status_code == 200


async def test_a_missing_model_lists_only_the_models_the_key_may_use(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        body = {"inputs": "the cat", "model": "nothing"}
        for key, available in (("narrow", "tiny-cls"), ("reader", "tiny-cls, tiny-enc, tiny-mlm, tiny-pt")):
            r = await c.post("/classify", json=body, headers=auth(key))
            assert (r.status_code, r.json()) == (
                404,
                {"error": f"model 'nothing' not found (available: {available})", "error_type": "not_found"},
            )


async def test_the_token_rate_counts_tokens_after_tokenising(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        # 60 tokens a minute: the first request may overdraw the bucket, the next waits for it to refill
        body = {"inputs": ["the cat sat on the mat"] * 10}  # 8 tokens each with [CLS] and [SEP]: 80
        assert (await c.post("/embeddings", json=body, headers=auth("thrifty"))).status_code == 200
        r = await c.post("/embeddings", json={"inputs": "the cat"}, headers=auth("thrifty"))
        assert r.status_code == 429
        assert r.json()["error"].startswith("key 'thrifty' is over its token rate of 60 tokens per minute; retry in ")
        assert 20 <= int(r.headers["retry-after"]) <= 21  # 20 tokens of debt at one a second, plus this one's
        metrics = (await c.get("/usage", headers=auth("boss"))).json()["keys"]
        assert metrics["thrifty"] == {"requests": 2, "tokens": 80, "rate_limited": 1, "job_seconds": 0.0}
        text = (await c.get("/metrics", headers=auth("boss"))).text
        assert 'bert_key_rate_limited_total{key="thrifty",limit="tokens"} 1.0' in text
        assert 'bert_key_errors_total{key="thrifty",status="429"} 1.0' in text  # the dashboard's 429s by key
        assert 'bert_key_tokens_total{key="thrifty"} 80.0' in text


async def test_the_request_rate_answers_429_with_its_headers(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        answers = [await c.get("/models", headers=auth("quick")) for _ in range(3)]
        assert [r.status_code for r in answers] == [200, 200, 429]
        assert [r.headers["x-ratelimit-remaining"] for r in answers] == ["1", "0", "0"]
        assert {r.headers["x-ratelimit-limit"] for r in answers} == {"0.5"}
        assert answers[2].json() == {
            "error": "key 'quick' is over its request rate of 0.5 per second (bursts of 2); retry in 2 s",
            "error_type": "overloaded",
        }
        assert answers[2].headers["retry-after"] == "2"
        assert "x-ratelimit-limit" not in (await c.get("/models", headers=auth("reader"))).headers  # no limit
        usage = (await c.get("/usage", headers=auth("boss"))).json()["keys"]
        assert usage["quick"] == {"requests": 3, "tokens": 0, "rate_limited": 1, "job_seconds": 0.0}
        text = (await c.get("/metrics", headers=auth("boss"))).text
        assert 'bert_key_rate_limited_total{key="quick",limit="requests"} 1.0' in text
        assert 'bert_key_errors_total{key="quick",status="429"} 1.0' in text  # refused before the app: its key still
        assert SECRETS["quick"] not in text and KEYS["quick"].hash.split(":")[1] not in text


async def test_a_broken_file_keeps_the_last_keys_and_says_why(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        assert (await c.get("/info", headers=auth("reader"))).json()["keys"]["error"] is None
        keys_file.write_text(keys_file.read_text() + "\n[keys.broken\n")
        time.sleep(RECHECK_S)
        r = await c.get("/info", headers=auth("reader"))  # still the keys read before
        assert r.status_code == 200
        error = r.json()["keys"]["error"]
        assert error.startswith(f"keys file {keys_file}: ") and "line" in error
        assert (await c.get("/info")).status_code == 401  # nor is the service opened
        write_keys(keys_file, {"boss": KEYS["boss"]})  # fixed, without reader
        time.sleep(RECHECK_S)
        assert (await c.get("/info", headers=auth("reader"))).status_code == 401
        info = (await c.get("/info", headers=auth("boss"))).json()["keys"]
        assert info == {"file": str(keys_file), "keys": 1, "built_in": [], "error": None}


async def test_revoking_the_last_key_or_deleting_the_file_never_opens_the_service(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file)) as c:
        assert (await c.post("/embeddings", json={"inputs": "hi"}, headers=auth("reader"))).status_code == 200
        change(keys_file, lambda keys: keys.clear())  # every key revoked
        time.sleep(RECHECK_S)
        for headers in ({}, auth("reader")):
            r = await c.post("/embeddings", json={"inputs": "hi"}, headers=headers)
            assert (r.status_code, r.json()) == (401, REFUSAL)
        keys_file.unlink()
        time.sleep(RECHECK_S)
        r = await c.post("/embeddings", json={"inputs": "hi"})
        assert (r.status_code, r.json()) == (401, REFUSAL)


async def test_without_a_keys_file_the_service_is_open_as_before(data_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="bertserve")
    async with serve_app(settings_for(data_dir, keys_file=tmp_path / "none.toml")) as c:
        assert (await c.post("/embeddings", json={"inputs": "hi"})).status_code == 200
    assert (
        f"keys: none, every route is open: no keys file at {tmp_path / 'none.toml'} (BERT_KEYS_FILE), "
        "BERT_API_KEY and BERT_ADMIN_KEY unset"
    ) in [r.getMessage() for r in caplog.records]


def test_a_broken_file_at_start_is_a_startup_error(data_dir, tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[keys.x]\nhash = "sha256:00"\nscopes = ["inference"]\n')
    with pytest.raises(KeyFileError, match=r"key 'x': hash must be 'sha256:' and 64 hex digits"):
        create_app(settings_for(data_dir, keys_file=path))
    path.write_text(f'[keys.x]\nhash = "{hash_secret("s")}"\nscopes = ["inference", "root"]\n')
    with pytest.raises(KeyFileError, match=r"scopes must be some of inference, jobs, batch, admin, metrics"):
        create_app(settings_for(data_dir, keys_file=path))


async def test_the_built_in_keys_work_beside_the_file(data_dir, keys_file, caplog):
    caplog.set_level("INFO", logger="bertserve")
    settings = settings_for(data_dir, keys_file=keys_file, api_key="api-key-0123456789", admin_key="admin-0123456789")
    async with serve_app(settings) as c:
        assert (
            f"keys: required on every route but /health and /ready: 6 keys from {keys_file} (BERT_KEYS_FILE), "
            "plus BERT_ADMIN_KEY and BERT_API_KEY"
        ) in [r.getMessage() for r in caplog.records]
        assert "api-key-0123456789" not in caplog.text and "admin-0123456789" not in caplog.text
        api, admin = {"Authorization": "Bearer api-key-0123456789"}, {"Authorization": "Bearer admin-0123456789"}
        assert (await c.post("/embeddings", json={"inputs": "the cat"}, headers=api)).status_code == 200
        assert (await c.get("/jobs", headers=admin)).status_code == 200
        assert (await c.get("/usage", headers=admin)).status_code == 200
        assert (await c.get("/jobs", headers=api)).status_code == 401  # as it always was
        assert (await c.get("/jobs", headers=auth("trainer"))).status_code == 200
        info = (await c.get("/info", headers=api)).json()
        assert info["keys"]["built_in"] == ["admin", "api"] and info["keys"]["keys"] == len(KEYS)


def test_a_keys_file_with_keys_lets_the_service_beyond_loopback(data_dir, tmp_path):
    path = tmp_path / "keys.toml"
    assert exposure_refusal(settings_for(data_dir, keys_file=path), "0.0.0.0") is not None
    write_keys(path, {"reader": KEYS["reader"]})
    assert exposure_refusal(settings_for(data_dir, keys_file=path), "0.0.0.0") is None


def test_the_file_keeps_every_key_of_concurrent_changes(tmp_path):
    path = tmp_path / "keys.toml"

    def add(i: int) -> None:
        key = Key(f"k{i}", hash_secret(new_secret()), frozenset({"inference"}), rps=float(i + 1))
        change(path, lambda keys: keys.__setitem__(key.name, key))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = read_keys(path)
    assert sorted(keys) == sorted(f"k{i}" for i in range(16))
    assert keys["k3"] == Key("k3", keys["k3"].hash, frozenset({"inference"}), rps=4.0)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


async def test_the_api_schema_lists_the_403_and_the_429_of_keyed_routes(data_dir, keys_file):
    async with serve_app(settings_for(data_dir, keys_file=keys_file), wait_ready=False) as c:
        paths = (await c.get("/openapi.json", headers=auth("reader"))).json()["paths"]
        for path, method in (("/jobs", "get"), ("/embeddings", "post"), ("/usage", "get"), ("/datasets", "post")):
            assert {"401", "403", "429"} <= set(paths[path][method]["responses"]), path
        assert "403" not in paths["/ready"]["get"]["responses"]


@pytest.mark.parametrize(
    "table, error",
    [
        ('scopes = "inference"', "key 'x': scopes must be a list of names, got 'inference'"),
        ('scopes = ["inference"]\nmodels = "tiny"', "key 'x': models must be a list of names, got 'tiny'"),
        ('scopes = ["inference"]\nrps = 0', "key 'x': rps must be > 0, got 0"),
        ('scopes = ["inference"]\nrps = "fast"', "key 'x': rps must be a number, got 'fast'"),
        ('scopes = ["inference"]\nsecret = "bsk_x"', "key 'x': unknown fields secret"),
    ],
)
def test_a_key_that_cannot_be_read_is_named_with_its_fault(tmp_path, table, error):
    path = tmp_path / "keys.toml"
    path.write_text(f'[keys.x]\nhash = "{hash_secret("s")}"\n{table}\n')
    with pytest.raises(KeyFileError) as e:
        read_keys(path)
    assert str(e.value) == f"keys file {path}: {error}"


async def test_changes_are_audited_by_key_name_in_the_file_and_the_log(keys_file, tmp_path, caplog):
    caplog.set_level("INFO", logger="bertserve")
    data = make_data_dir(tmp_path / "data")
    async with serve_app(settings_for(data, keys_file=keys_file, default_model="tiny"), wait_ready=False) as c:
        files = {"file": ("reviews.csv", labelled_csv())}
        r = await c.post("/datasets", files=files, data={"name": "reviews"}, headers=auth("boss"))
        assert (r.status_code, r.json()["owner"]) == (201, "boss")
        r = await c.delete("/datasets/nothing", headers={**auth("boss"), "X-Request-ID": "abc-1"})
        assert r.status_code == 404
        line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "the cat"}}
        upload = {"file": ("in.jsonl", json.dumps(line).encode() + b"\n")}
        file_id = (await c.post("/v1/files", files=upload, data={"purpose": "batch"}, headers=auth("boss"))).json()[
            "id"
        ]
        body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        batch_id = (await c.post("/v1/batches", json=body, headers=auth("boss"))).json()["id"]
        assert (await c.delete("/v1/files/file-nothing", headers=auth("boss"))).status_code == 404
    lines = [json.loads(line) for line in (data / "audit.jsonl").read_text().splitlines()]
    assert [(e["key"], e["action"], e["target"], e["outcome"], e["source"]) for e in lines] == [
        ("boss", "dataset.upload", "dataset reviews", "ok", "api"),
        ("boss", "dataset.delete", "dataset nothing", "not_found", "api"),
        ("boss", "file.upload", f"file {file_id} (in.jsonl)", "ok", "api"),
        ("boss", "batch.submit", f"batch {batch_id} (file {file_id})", "ok", "api"),
        ("boss", "file.delete", "file file-nothing", "not_found", "api"),
    ]
    assert lines[1]["request_id"] == "abc-1" and len(lines[0]["request_id"]) == 32
    assert "dataset.delete of dataset nothing by key 'boss': not_found (request abc-1)" in caplog.text


@pytest.mark.parametrize("name", ["admin\n", "ci\n", "ci\nx", "-ci", "ci/x"])
def test_a_key_name_is_matched_whole(tmp_path, name):
    """`admin\\n` is not a key name (re.match's `$` would have let the final newline in)."""
    path = tmp_path / "keys.toml"
    path.write_text(f'[keys.{json.dumps(name)}]\nhash = "{hash_secret("s")}"\nscopes = ["inference"]\n')
    with pytest.raises(KeyFileError) as e:
        read_keys(path)
    rule = "1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
    assert str(e.value) == f"keys file {path}: key name {name!r}: {rule}"


def test_a_request_id_is_taken_only_when_it_is_plain_to_its_end():
    from starlette.requests import Request

    from app.api.auditing import request_id

    def asked(value: bytes) -> str:
        return request_id(Request({"type": "http", "headers": [(b"x-request-id", value)]}))

    assert asked(b"abc-1") == "abc-1"
    for value in (b"abc-1\n", b"abc 1", b"x" * 65):
        assert asked(value) != value.decode() and len(asked(value)) == 32


async def test_a_path_or_a_file_name_with_a_line_break_stays_on_one_log_line(data_dir, keys_file, caplog, tmp_path):
    """A request cannot forge a line in the service's log (a line feed in its path, unauthenticated) nor
    split a record of the audit log (U+2028 in an uploaded file's name)."""
    caplog.set_level("INFO", logger="bertserve")
    data = make_data_dir(tmp_path / "data")
    forged = "2026-12-04 15:38:37,029 INFO bertserve: job.submit of job x by key 'admin': ok (request r)"
    async with serve_app(settings_for(data, keys_file=keys_file, default_model="tiny"), wait_ready=False) as c:
        r = await c.get("/nowhere%0A" + forged.replace(" ", "%20") + "%E2%80%A8")
        assert (r.status_code, r.json()) == (401, REFUSAL)
        line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "the cat"}}
        upload = {"file": ("in\u2028put.jsonl", json.dumps(line).encode() + b"\n")}
        r = await c.post("/v1/files", files=upload, data={"purpose": "batch"}, headers=auth("boss"))
        assert r.status_code == 200, r.text
        file_id = r.json()["id"]
    messages = [r.getMessage() for r in caplog.records if r.name == "bertserve"]
    assert f"GET /nowhere\\n{forged}\\u2028: {REFUSAL['error']}" in messages
    assert f"file.upload of file {file_id} (in\\u2028put.jsonl) by key 'boss': ok" in "\n".join(messages)
    assert not [m for m in messages if len(m.splitlines()) != 1]
    text = (data / "audit.jsonl").read_text()
    entries = [json.loads(line) for line in text.splitlines()]
    assert [e["target"] for e in entries] == [f"file {file_id} (in\u2028put.jsonl)"]
    assert "\u2028" not in text
