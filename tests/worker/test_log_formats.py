"""worker/telemetry/logs.py: both log formats keep a record on one line whatever a request put in it (a newline,
U+2028), and carry the fields bound for the request or the job."""

from __future__ import annotations

import json
import logging

import pytest

from worker.telemetry import logs

FORGED = 'ok\n2026-12-05 10:00:00 INFO bertserve: forged\u2028{"level": "INFO", "message": "forged"}\r\x1b[2J'


def record(message: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("bertserve", logging.WARNING, __file__, 1, message, args, exc_info)


def test_a_json_line_is_one_object_with_the_bound_fields():
    formatter = logs.LogFormatter("json")
    with logs.bound(request_id="req-1", trace_id="0af7651916cd43dd8448eb211c80319c"):
        logs.note(key=f"alice{FORGED}")
        line = formatter.format(record("path %s", FORGED))
    assert line.splitlines() == [line] and "\u2028" not in line and "\x1b" not in line
    entry = json.loads(line)
    assert entry["message"] == f"path {FORGED}" and entry["key"] == f"alice{FORGED}"  # the values, whole
    assert (entry["level"], entry["logger"], entry["request_id"]) == ("WARNING", "bertserve", "req-1")
    assert entry["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert list(entry) == ["time", "level", "logger", "message", "request_id", "trace_id", "key"]


def test_a_text_line_escapes_what_would_start_another_and_names_the_fields():
    formatter = logs.LogFormatter("text")
    with logs.bound(request_id="req-1", job_id="20261205-000000-abcdef"):
        line = formatter.format(record("path %s", FORGED))
    assert line.splitlines() == [line]
    assert line.endswith(r"\u001b[2J [request_id=req-1 job_id=20261205-000000-abcdef]")
    assert r"ok\n2026-12-05 10:00:00 INFO bertserve: forged\u2028{" in line


def test_outside_a_request_a_line_has_no_fields_and_a_traceback_stays_inside_json():
    try:
        raise RuntimeError("bad\nthing")
    except RuntimeError:
        import sys

        exc = sys.exc_info()
    line = logs.LogFormatter("json").format(record("failed", exc_info=exc))
    assert line.splitlines() == [line]
    entry = json.loads(line)
    assert "request_id" not in entry and "RuntimeError: bad\nthing" in entry["exception"]
    text = logs.LogFormatter("text").format(record("failed", exc_info=exc))
    assert text.splitlines()[0].endswith("WARNING bertserve: failed")  # the traceback below, as before


@pytest.mark.parametrize("log_format", logs.LOG_FORMATS)
def test_bound_fields_end_with_their_block(log_format):
    with logs.bound(request_id="req-1"):
        pass
    assert logs.fields_of(record("x")) == {}
