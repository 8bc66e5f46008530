"""BERT_LOG_FORMAT=json on a real server: every line it logs is one JSON object, with the request's id, trace
id and key, even when the request put a newline or U+2028 in what is logged (its path)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import make_data_dir, start_server

pytestmark = pytest.mark.slow
KEY = "log-lines-key-0123456789"
NO_BROKER = "redis://127.0.0.1:1/0"


def test_json_log_lines_parse_one_by_one_whatever_the_request_sent(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    server, url = start_server(data_dir, NO_BROKER, tmp_path, BERT_LOG_FORMAT="json", BERT_API_KEY=KEY)
    try:
        forged = '/info%0A{"level": "INFO", "message": "forged"}%E2%80%A8{"message": "forged"}'
        headers = {"authorization": "Bearer wrong-key-0123456789", "x-request-id": "req-forge"}
        r = httpx.get(url + forged, headers=headers, timeout=30)
        assert r.status_code == 401
        trace_id = r.headers["trace-id"]
        r = httpx.post(
            f"{url}/datasets",
            files={"file": ("d.txt", b"one document\n")},
            data={"name": "bad name\u2028", "kind": "corpus"},
            headers={"authorization": f"Bearer {KEY}", "x-request-id": "req-upload"},
            timeout=30,
        )
        assert r.status_code == 422
    finally:
        server.stop()
    entries = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    others = [line for line in server.log().splitlines() if not line.startswith("{")]
    assert not [line for line in others if "forged" in line or "req-" in line], others
    (refused,) = [e for e in entries if e.get("request_id") == "req-forge"]
    # the service's own escaping (app/errors.py's OneLine) came first: the path's controls are written out
    assert refused["message"] == (
        r'GET /info\n{"level": "INFO", "message": "forged"}\u2028{"message": "forged"}: missing or wrong API key: '
        "send 'Authorization: Bearer <BERT_API_KEY>'"
    )
    (upload,) = [e for e in entries if e.get("request_id") == "req-upload"]
    assert upload["message"] == "dataset.upload of dataset by key 'api': validation (request req-upload)"
    assert upload["key"] == "api" and len(upload["trace_id"]) == 32  # the key is known once it was checked
    assert (refused["trace_id"], refused["logger"], refused["level"]) == (trace_id, "bertserve", "INFO")
    assert set(refused) == {"time", "level", "logger", "message", "request_id", "trace_id"}
