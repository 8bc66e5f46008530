"""GET /jobs/{id}/events: one job as a stream of Server-Sent Events (the WHATWG HTML standard's
`text/event-stream`), read from its record and metrics.jsonl in DATA_DIR (datadir), which
the worker keeps current. Events, each `event: <name>` and one `data:` line of JSON:

    progress  the job as GET /jobs/{id} answers it; first, then each time job.json changes (and, while
              it is queued, each time its place in line changes: looked at every PLACE_S)
    state     {"state", "previous"}: first (previous null), then on every change of state
    metrics   one metrics.jsonl record ({"type": "train"|"eval"|"resume", "step", ...}), in file order,
              with `id: <step>`; `?since=STEP` (or the Last-Event-ID header a reconnecting client
              sends) starts the curve at that step: records of earlier steps are not sent again
    reset     {"reason"}: metrics.jsonl was rewritten (a resumed attempt drops the steps it redoes);
              forget the curve, its records follow again from the first (or from `since`)
    end       {"state"}: the job has finished (or vanished); the server closes the stream after it

A comment line (`: keep-alive`) goes out when nothing else has for KEEPALIVE_S, so proxies keep the
connection and a client that has gone is noticed. No thread is held per client: each poll reads the
two files and writes the events' text in the shared thread pool (never on the event loop), then the
stream sleeps on the event loop. A long curve is paced: MAX_READ bytes a poll, one stream's replay
read at a time, REPLAY_PAUSE_S between two pieces. A metrics line longer than MAX_LINE is skipped
(its bytes are not kept). Streams are bounded (EventStreams): BERT_MAX_EVENT_STREAMS open at once,
BERT_MAX_EVENT_STREAMS_PER_JOB per job and BERT_MAX_EVENT_STREAMS_PER_KEY per API key (one more is a
429 with Retry-After), and each lasts at most BERT_EVENT_STREAM_MAX_SECONDS; then the server closes it (a client reconnects with Last-Event-ID), as it
does when the server stops (after SIGTERM's drain).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from app.errors import ServiceError
from app.schemas.jobs import JobStatus
from datadir import JobNotFound, JobRecord, JobRecords, scheduling
from datadir.jobs import METRICS, TERMINAL

POLL_S = 0.25  # the worker logs a step every log_every steps; a quarter second keeps a curve live
PLACE_S = 2.0  # a queued job's place depends on every job's record: read them all at most this often
KEEPALIVE_S = 15.0
MAX_READ = 1 << 18  # metrics bytes read per poll: a long curve arrives over many polls, not at once
MAX_LINE = 1 << 16  # a metrics record is ~200 bytes; a longer line than this is skipped, never buffered
REPLAY_PAUSE_S = 0.02  # between two pieces of a long curve, so other clients' requests run meanwhile


def sse(event: str, data: Any) -> str:
    """One event in the text/event-stream format (our JSON has no newlines: one data line)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class EventStreams:
    """How many event streams are open, in all, per job and per key; `open` refuses one past any limit
    (429). The event loop alone calls it, so a plain counter is enough."""

    def __init__(self, total: int, per_job: int, per_key: int | None = None):
        self.total, self.per_job, self.per_key = total, per_job, per_key or total
        self.by_job: Counter[str] = Counter()
        self.by_key: Counter[str] = Counter()
        self.replay = asyncio.Lock()  # one stream's replay piece read at a time (the GIL is shared)

    def open(self, job_id: str, key: str | None = None) -> Callable[[], None]:
        """Count a new stream of `job_id` for the API key named `key` (None: the service has no keys, and
        only the other limits apply); returns its release (idempotent)."""
        if key is not None and self.by_key[key] >= self.per_key:
            raise ServiceError(
                "overloaded",
                f"key '{key}' has {self.by_key[key]} event streams open, its limit "
                "(BERT_MAX_EVENT_STREAMS_PER_KEY); close one or retry later",
            )
        if sum(self.by_job.values()) >= self.total:
            raise ServiceError(
                "overloaded",
                f"{self.total} event streams are open, the most this service allows "
                "(BERT_MAX_EVENT_STREAMS); retry later",
            )
        if self.by_job[job_id] >= self.per_job:
            raise ServiceError(
                "overloaded",
                f"job '{job_id}' has {self.per_job} event streams open, the most this "
                "service allows for one job (BERT_MAX_EVENT_STREAMS_PER_JOB); retry "
                "later",
            )
        self.by_job[job_id] += 1
        if key is not None:
            self.by_key[key] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                _count_down(self.by_job, job_id)
                if key is not None:
                    _count_down(self.by_key, key)

        return release


def _count_down(counter: Counter[str], name: str) -> None:
    counter[name] -= 1
    if not counter[name]:
        del counter[name]


class MetricsTail:
    """The whole lines appended to a metrics.jsonl since the last read. A rewrite (the file replaced by
    rename, or shorter than what was read) starts over from its first line and says so. A line longer
    than MAX_LINE is skipped as it is read: the unfinished line kept between reads never exceeds it."""

    def __init__(self, path: Path):
        self.path = path
        self.inode: int | None = None
        self.offset = 0
        self.partial = b""  # a line the writer has not finished yet
        self.skipping = False  # inside a line longer than MAX_LINE: drop bytes up to its end

    def read(self) -> tuple[bool, list[dict]]:
        """(rewritten since the last read, the new records)."""
        rewritten, lines = self.read_lines()
        return rewritten, [record for record, _ in lines]

    def read_lines(self) -> tuple[bool, list[tuple[dict, str]]]:
        """(rewritten since the last read, each new record with its line as written)."""
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                rewritten = self.inode is not None and (stat.st_ino != self.inode or stat.st_size < self.offset)
                if rewritten:
                    self.offset, self.partial, self.skipping = 0, b"", False
                self.inode = stat.st_ino
                f.seek(self.offset)
                data = f.read(MAX_READ)
        except FileNotFoundError:
            return False, []
        self.offset += len(data)
        lines = self._split(data)
        return rewritten, [(r, line.decode()) for r, line in ((_record(line), line) for line in lines) if r is not None]

    def _split(self, data: bytes) -> list[bytes]:
        if self.skipping:
            end = data.find(b"\n")
            if end < 0:
                return []
            data, self.skipping = data[end + 1 :], False
        *lines, rest = (self.partial + data).split(b"\n")
        self.partial = rest
        if len(rest) > MAX_LINE:
            self.partial, self.skipping = b"", True
        return [line for line in lines if len(line) <= MAX_LINE]


def _record(line: bytes) -> dict | None:
    if b"\r" in line:  # a CR would end the SSE data line early; the worker never writes one
        return None
    try:
        record = json.loads(line)
    except ValueError:  # blank, or torn by a killed writer (the worker repairs the file on resume)
        return None
    return record if isinstance(record, dict) else None


class _Stream:
    """One client's view of a job: what it was last told. `poll` (in a thread) reads the job's two files
    and returns the text of the events they make, and whether the job has ended with its curve read."""

    def __init__(
        self, records: JobRecords, job_id: str, since: int | None, named: Callable[[Mapping], bool] | None = None
    ):
        self.records, self.job_id, self.since = records, job_id, since
        self.named = named or (lambda record: True)  # which other jobs its place may name by id
        self.tail = MetricsTail(records.job_dir(job_id) / METRICS)
        self.updated: str | None = None
        self.state: str | None = None
        self.read_all = False  # the last poll read the metrics file to its end
        self.place: dict[str, Any] | None = None  # a queued job's place in line, as last sent
        self.place_at = 0.0

    def poll(self) -> tuple[str, bool]:
        # The record first: when it says the job has ended, every line written before that is read next.
        try:
            record = self.records.read(self.job_id)
        except JobNotFound:  # removed under us (a job whose message never left the app)
            return sse("end", {"state": None}), True
        rewritten, lines = self.tail.read_lines()
        self.read_all = not lines
        chunk = [sse("reset", {"reason": "metrics.jsonl was rewritten"})] if rewritten else []
        chunk += [
            f"event: metrics\nid: {r['step']}\ndata: {line}\n\n"
            if isinstance(r.get("step"), int)
            else f"event: metrics\ndata: {line}\n\n"
            for r, line in lines
            if self._wanted(r)
        ]
        place_moved = self._place_moved(record)
        if record["updated_at"] != self.updated or place_moved:
            self.updated = record["updated_at"]
            status = JobStatus.from_record(
                record, self.records.disk_bytes(self.job_id), self.place
            )  # as GET /jobs/{id}
            chunk.append(sse("progress", status.model_dump(mode="json")))
        if record["state"] != self.state:
            chunk.append(sse("state", {"state": record["state"], "previous": self.state}))
            self.state = record["state"]
        if self.state in TERMINAL and self.read_all:  # ended, and the curve is read to its end
            return "".join(chunk) + sse("end", {"state": self.state}), True
        return "".join(chunk), False

    def _place_moved(self, record: JobRecord) -> bool:
        """Whether a queued job's place in line changed since it was last sent (read at most every PLACE_S)."""
        if record["state"] != "queued":
            self.place = None
            return False
        now = time.monotonic()
        if now - self.place_at < PLACE_S and record["updated_at"] == self.updated:
            return False
        self.place_at = now
        place = scheduling.queue_place(self.records.list(), self.job_id, self.named)
        moved, self.place = place != self.place, place
        return moved

    def _wanted(self, record: dict) -> bool:
        step = record.get("step")
        return self.since is None or not isinstance(step, int) or step >= self.since


async def job_events(
    records: JobRecords,
    job_id: str,
    disconnected: Callable[[], Awaitable[bool]],
    poll_s: float = POLL_S,
    since: int | None = None,
    max_seconds: float | None = None,
    replay: asyncio.Lock | None = None,
    stopping: Callable[[], bool] = lambda: False,
    named: Callable[[Mapping], bool] | None = None,
) -> AsyncIterator[str]:
    """The events of one job until it ends, the client goes (`disconnected`), `max_seconds` pass or the
    server is `stopping` (the client reconnects, through a balancer to another replica); metrics from
    step `since` on. `replay` (EventStreams.replay) lets one stream read a long curve at a time. A queued
    job's place names by id only the jobs `named` lets its reader see (JobService.visible)."""
    stream = _Stream(records, job_id, since, named)
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    replay = replay or asyncio.Lock()
    quiet = 0.0
    while True:
        if stream.read_all:
            text, ended = await asyncio.to_thread(stream.poll)
        else:  # a piece of a long curve
            async with replay:
                text, ended = await asyncio.to_thread(stream.poll)
        if ended:
            yield text
            return
        quiet = 0.0 if text else quiet + poll_s
        if quiet >= KEEPALIVE_S:
            text, quiet = ": keep-alive\n\n", 0.0
        if text:
            yield text
        if await disconnected():
            return
        if stopping():
            yield ": this server is stopping; reconnect\n\n"
            return
        if deadline is not None and time.monotonic() >= deadline:
            yield ": the stream has reached its lifetime (BERT_EVENT_STREAM_MAX_SECONDS); reconnect\n\n"
            return
        await asyncio.sleep(poll_s if stream.read_all else REPLAY_PAUSE_S)
