"""The order training jobs run in, read from their records: both the worker (which job a delivery
runs, whether a running job makes way) and the service (a queued job's position) use this module.

- A job's `priority` (PRIORITY_MIN..PRIORITY_MAX, default 0) orders the queue: the highest first,
  then the oldest (created_at), so equal priorities are first come, first served, except that the
  jobs of an owner (an API key) over its `worker_share` go after the others of their priority: an
  owner is over its share when its jobs took more than that fraction of the worker time all jobs took
  in the last SHARE_WINDOW_S (runtime_s of the jobs running or finished in it). The share is the one
  the owner's key had when it submitted its newest job (the record's `worker_share`).
- A delivery runs the first waiting job in that order, whichever job its message named: the broker
  only says that a slot is free, the records say what to run in it.
- Preemption: when a job of higher priority has waited for a worker longer than the grace (an idle
  slot would have taken it by then), the lowest-priority running job (the newest among equals) hands
  itself back at its next step, exactly as on a warm shutdown; its record names the job it made way
  for (`preempted_for`), so no second running job makes way for the same one. An owner's jobs make
  others make way at most `max_per_hour` times in PREEMPTION_WINDOW_S, counted from the records' "made
  way" events (`preemptions`): past it they wait for a free worker like any other, so submitting and
  cancelling urgent jobs in a loop cannot keep stopping everyone else's.

The bootstrap job runs at PRIORITY_MIN, so any job a person submits goes ahead of it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from datadir.jobs import API_KINDS, owner_of, steps_of

PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = -10, 10, 0
BOOTSTRAP_PRIORITY = PRIORITY_MIN  # a user's job never waits behind the first start's bootstrap
SHARE_WINDOW_S = 24 * 3600  # the worker time an owner's share is measured against
PREEMPTION_WINDOW_S = 3600  # the window an owner's preemptions are counted in (per hour)

Record = Mapping[str, Any]


def priority_of(record: Record) -> int:
    return int(record.get("priority", DEFAULT_PRIORITY))


def over_share(records: Iterable[Record], now: dt.datetime | None = None) -> set[str]:
    """The owners whose jobs took more than their `worker_share` of the worker time used in the window."""
    used: dict[str, float] = {}
    share: dict[str, tuple[str, float]] = {}  # owner -> (created_at of its newest job with a share, share)
    for r in records:
        if not _scheduled(r):
            continue
        owner = owner_of(r)
        if r.get("worker_share") is not None and (r.get("created_at") or "") >= share.get(owner, ("", 0.0))[0]:
            share[owner] = (r.get("created_at") or "", float(r["worker_share"]))
        ended = r.get("finished_at")
        if r.get("state") == "running" or (ended and seconds_since(ended, now) <= SHARE_WINDOW_S):
            used[owner] = used.get(owner, 0.0) + float(r.get("runtime_s") or 0.0)
    total = sum(used.values())
    return {o for o, (_, fraction) in share.items() if total > 0 and used.get(o, 0.0) / total > fraction}


def order_key(records: Iterable[Record] = ()) -> Callable[[Record], tuple]:
    """The queue's order: the highest priority first, then the owners within their share, then the oldest."""
    over = over_share(records)
    return lambda r: (-priority_of(r), owner_of(r) in over, r.get("created_at") or "", r["id"])


def _scheduled(record: Record) -> bool:
    return record.get("kind") not in API_KINDS  # imports, batches and mining jobs run in the API process


def waiting(records: Iterable[Record]) -> list[Record]:
    """The queued training jobs, in the order they will run."""
    records = list(records)
    queued = [r for r in records if _scheduled(r) and r.get("state") == "queued" and not r.get("cancel_requested")]
    return sorted(queued, key=order_key(records))


def running(records: Iterable[Record]) -> list[Record]:
    """The running training jobs, the first to make way first: the lowest priority, then the newest."""
    active = [r for r in records if _scheduled(r) and r.get("state") == "running"]
    return sorted(active, key=lambda r: (priority_of(r), _negated(r.get("created_at") or "")))


def _negated(text: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in text)


def delivery_order(records: Iterable[Record], orphans: Iterable[Record] = ()) -> list[str]:
    """The job ids a delivery tries, in order: the waiting jobs and the `orphans` (running jobs whose
    worker died), each at its place in the order."""
    records = list(records)
    candidates = {r["id"]: r for r in [*waiting(records), *orphans]}
    return [r["id"] for r in sorted(candidates.values(), key=order_key(records))]


def seconds_since(timestamp: str | None, now: dt.datetime | None = None) -> float:
    if not timestamp:
        return 0.0
    then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return ((now or dt.datetime.now(dt.UTC)) - then).total_seconds()


def preemptions(records: Iterable[Record], now: dt.datetime | None = None) -> dict[str, int]:
    """How often each owner's jobs made a running job make way in the last PREEMPTION_WINDOW_S: the "made
    way" events of every record, by the owner of the job each names (noted in the event; for an event
    that does not note it, the owner of that job's record, if it is still there)."""
    records = list(records)
    owners = {r["id"]: owner_of(r) for r in records}
    counts: dict[str, int] = {}
    for record in records:
        for event in record.get("events") or ():
            if event.get("event") != "made way" or seconds_since(event.get("at"), now) > PREEMPTION_WINDOW_S:
                continue
            owner = event.get("preempted_for_owner") or owners.get(event.get("preempted_for"))
            if owner is not None:
                counts[owner] = counts.get(owner, 0) + 1
    return counts


def make_way_for(
    records: Sequence[Record],
    job_id: str,
    grace_s: float,
    lease_is_free: Callable[[str], bool],
    max_per_hour: int | None = None,
    now: dt.datetime | None = None,
) -> Record | None:
    """The waiting job that running job `job_id` should hand itself back for, or None.

    The waiting jobs of higher priority that nobody made way for yet, and that waited past `grace_s`
    (an idle slot would have taken them), are paired with the running jobs lowest first; `job_id` makes
    way when its pair outranks it. `lease_is_free` skips a job a worker is taking up right now. A job
    whose owner's jobs already made others make way `max_per_hour` times in the last hour
    (`preemptions`) makes no running job make way (None: no bound)."""
    claimed = {r.get("preempted_for") for r in records if r.get("state") == "queued"}
    spent = preemptions(records, now) if max_per_hour is not None else {}
    queue = [
        r
        for r in waiting(records)
        if r["id"] not in claimed
        and seconds_since(r.get("enqueued_at") or r.get("created_at"), now) >= grace_s
        and (max_per_hour is None or spent.get(owner_of(r), 0) < max_per_hour)
    ]
    for ahead, victim in zip(queue, running(records), strict=False):
        if priority_of(ahead) <= priority_of(victim):
            return None
        if victim["id"] == job_id:
            return ahead if lease_is_free(ahead["id"]) else None
    return None


def _every(record: Record) -> bool:
    return True


def job_words(record: Record, named: Callable[[Record], bool] = _every) -> str:
    """'job <id>', or 'another key's job' for a job whose id the reader may not see (`named` says which)."""
    return f"job {record['id']}" if named(record) else "another key's job"


def describe(record: Record, named: Callable[[Record], bool] = _every) -> str:
    """A running job in a few words: 'job <id> (priority 0, step 140 of 200)'."""
    step, total = steps_of(record)
    return f"{job_words(record, named)} (priority {priority_of(record)}, step {step} of {total})"


def queue_place(
    records: Sequence[Record], job_id: str, named: Callable[[Record], bool] = _every
) -> dict[str, Any] | None:
    """A queued job's place: its position (1 = next), what it waits for in words, and an estimate of
    the seconds until it starts when one can be had; None for a job that is not waiting. The jobs it
    waits for are named by id where `named` says the reader may see them (its owner's own, or every
    job for an admin); the others are 'another key's job', with their priority and progress only."""
    queue = waiting(records)
    index = next((i for i, r in enumerate(queue) if r["id"] == job_id), None)
    if index is None:
        return None
    me, busy = queue[index], running(records)
    lower = [r for r in busy if priority_of(r) < priority_of(me)]
    ahead = [r for r in busy if priority_of(r) >= priority_of(me)]
    parts = []
    if index:
        names = ", ".join(f"{job_words(r, named)} (priority {priority_of(r)})" for r in queue[:index])
        parts.append(f"{index} queued job{'s' if index > 1 else ''} ahead: {names}")
    if index == 0 and lower:
        parts.append(f"{describe(lower[0], named)} to hand back at its next step")
    elif ahead:
        parts.append("; ".join(describe(r, named) for r in ahead))
    elif not parts:
        parts.append("a free worker")
    estimate = None
    if index == 0 and not lower and ahead:
        etas = [(r.get("progress") or {}).get("eta_s") for r in ahead]
        estimate = min((e for e in etas if e is not None), default=None)
    return {"queue_position": index + 1, "waiting_for": "; ".join(parts), "start_estimate_s": estimate}
