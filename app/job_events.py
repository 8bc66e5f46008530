"""GET /jobs/{id}/events: one job as a stream of Server-Sent Events (the WHATWG HTML standard's
`text/event-stream`), read from its record and metrics.jsonl in DATA_DIR (model.datadir), which
the worker keeps current. Events, each `event: <name>` and one `data:` line of JSON:

    progress  the job as GET /jobs/{id} answers it; first, then each time job.json changes
    state     {"state", "previous"}: first (previous null), then on every change of state
    metrics   one metrics.jsonl record ({"type": "train"|"eval"|"resume", "step", ...}), in file order
    reset     {"reason"}: metrics.jsonl was rewritten (a resumed attempt drops the steps it redoes);
              forget the curve, its records follow again from the first
    end       {"state"}: the job has finished (or vanished); the server closes the stream after it

A comment line (`: keep-alive`) goes out when nothing else has for KEEPALIVE_S, so proxies keep the
connection and a client that has gone is noticed. No thread is held per client: each poll reads the
two files in the shared thread pool for a moment, then the stream sleeps on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from model.datadir import JobNotFound, JobStore
from model.datadir.jobs import METRICS, TERMINAL

from .schemas import JobStatus

POLL_S = 0.25  # the worker logs a step every log_every steps; a quarter second keeps a curve live
KEEPALIVE_S = 15.0
MAX_READ = 1 << 20  # metrics bytes read per poll: a long curve arrives over a few polls, not at once


def sse(event: str, data: Any) -> str:
    """One event in the text/event-stream format (our JSON has no newlines: one data line)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class MetricsTail:
    """The whole lines appended to a metrics.jsonl since the last read. A rewrite (the file replaced by
    rename, or shorter than what was read) starts over from its first line and says so."""

    def __init__(self, path: Path):
        self.path = path
        self.inode: int | None = None
        self.offset = 0
        self.partial = b""  # a line the writer has not finished yet

    def read(self) -> tuple[bool, list[dict]]:
        """(rewritten since the last read, the new records)."""
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                rewritten = self.inode is not None and (stat.st_ino != self.inode or stat.st_size < self.offset)
                if rewritten:
                    self.offset, self.partial = 0, b""
                self.inode = stat.st_ino
                f.seek(self.offset)
                data = f.read(MAX_READ)
        except FileNotFoundError:
            return False, []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return rewritten, [r for r in map(_record, lines) if r is not None]


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:  # blank, or torn by a killed writer (the worker repairs the file on resume)
        return None
    return record if isinstance(record, dict) else None


def _poll(store: JobStore, job_id: str, tail: MetricsTail) -> tuple[dict, bool, list[dict]]:
    # The record first: when it says the job has ended, every line written before that is read next.
    record = store.read(job_id)
    return (record, *tail.read())


async def job_events(store: JobStore, job_id: str, disconnected: Callable[[], Awaitable[bool]],
                     poll_s: float = POLL_S) -> AsyncIterator[str]:
    """The events of one job until it ends or the client goes (`disconnected`)."""
    tail = MetricsTail(store.job_dir(job_id) / METRICS)
    updated = state = None
    quiet = 0.0
    while True:
        try:
            record, rewritten, records = await asyncio.to_thread(_poll, store, job_id, tail)
        except JobNotFound:  # removed under us (a job whose message never left the app)
            yield sse("end", {"state": None})
            return
        chunk = [sse("reset", {"reason": "metrics.jsonl was rewritten"})] if rewritten else []
        chunk += [sse("metrics", r) for r in records]
        if record["updated_at"] != updated:
            updated = record["updated_at"]
            chunk.append(sse("progress", JobStatus.from_record(record).model_dump(mode="json")))
        if record["state"] != state:
            chunk.append(sse("state", {"state": record["state"], "previous": state}))
            state = record["state"]
        if state in TERMINAL and not records:  # ended, and the curve is read to its end
            yield "".join(chunk) + sse("end", {"state": state})
            return
        quiet = 0.0 if chunk else quiet + poll_s
        if quiet >= KEEPALIVE_S:
            chunk, quiet = [": keep-alive\n\n"], 0.0
        if chunk:
            yield "".join(chunk)
        if await disconnected():
            return
        if not records:  # a long curve is sent as fast as it is read
            await asyncio.sleep(poll_s)
