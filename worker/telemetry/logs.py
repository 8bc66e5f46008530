"""Log lines: `text` (as before, with the request's and job's ids after the message) or `json` (one object
per line: time, level, logger, message, request_id, trace_id, span_id, key, job_id), as BERT_LOG_FORMAT says.

Both formats keep each record on its line whatever a request sent: the text format escapes the controls
and U+2028/U+2029 (`escape_for_log`), the JSON one writes them as JSON escapes (datadir.audit.json_line,
as the audit log does), so neither lets a forged line in. The request's fields are bound for the request
(`bound`, the API's outermost middleware) and filled in as they become known (`note`: the key's name).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

from datadir.audit import json_line
from worker.telemetry import tracing

LOG_FORMATS = ("text", "json")
FIELDS = ("request_id", "trace_id", "span_id", "key", "job_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What a log line never carries raw: the C0 and C1 controls (line feeds among them) and DEL, and the
# Unicode line and paragraph separators, at which some log readers start a new line.
_LOG_ESCAPES: dict[int, str] = {
    **{c: f"\\u{c:04x}" for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]},
    **{ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"},
}
_fields: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("bertserve_log_fields", default=None)


def escape_for_log(value: object) -> str:
    """`value` as text that stays on its log line: `\\n`, `\\r` and `\\t` for those, `\\uXXXX` for the other
    controls and for U+2028 and U+2029."""
    return str(value).translate(_LOG_ESCAPES)


class OneLine(logging.Filter):
    """Makes each record's message (its arguments formatted in) one line, with escape_for_log. A traceback
    is not the message: the formatter adds it below, as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = escape_for_log(record.getMessage()), None
        return True


@contextlib.contextmanager
def bound(**fields: str | None) -> Iterator[dict[str, str]]:
    """Fields every log line inside the block carries (a request's, a job's)."""
    merged = {**(_fields.get() or {}), **{k: v for k, v in fields.items() if v is not None}}
    token = _fields.set(merged)
    try:
        yield merged
    finally:
        _fields.reset(token)


def note(**fields: str | None) -> None:
    """Add fields to those bound now (a request's key, known once its key was checked)."""
    current = _fields.get()
    if current is not None:
        current.update({k: v for k, v in fields.items() if v is not None})


def fields_of(record: logging.LogRecord) -> dict[str, str]:
    """The record's fields: those bound, the current span's ids, and any passed as `extra=`."""
    found: dict[str, str | None] = dict(_fields.get() or {})
    trace_id, span_id = tracing.ids()
    if trace_id is not None:
        found.update(trace_id=trace_id, span_id=span_id)
    for name in FIELDS:
        if (value := getattr(record, name, None)) is not None:
            found[name] = value
    return {name: str(found[name]) for name in FIELDS if found.get(name) is not None}


class LogFormatter(logging.Formatter):
    """One record, one line (its traceback below it in text; inside it in JSON)."""

    def __init__(self, log_format: str = "text", fmt: str = TEXT_FORMAT):
        super().__init__(fmt)
        self.json = log_format == "json"

    def format(self, record: logging.LogRecord) -> str:
        fields = fields_of(record)
        if self.json:
            return json_line(self._entry(record, fields))
        record.message = escape_for_log(record.getMessage())
        text = self.formatMessage(_with_time(record, self))
        if fields:
            text += " [" + " ".join(f"{k}={escape_for_log(v)}" for k, v in fields.items()) + "]"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text

    def _entry(self, record: logging.LogRecord, fields: dict[str, str]) -> dict[str, Any]:
        when = dt.datetime.fromtimestamp(record.created, dt.UTC)
        entry: dict[str, Any] = {
            "time": when.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **fields,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return entry


def _with_time(record: logging.LogRecord, formatter: logging.Formatter) -> logging.LogRecord:
    record.asctime = formatter.formatTime(record)
    return record


def install(log_format: str, level: int = logging.INFO, fmt: str = TEXT_FORMAT) -> None:
    """The root logger's handlers format with LogFormatter (one stderr handler if it has none)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level)
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(LogFormatter(log_format, fmt))
