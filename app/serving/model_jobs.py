"""What the service says of a model that a job is still making: the 503 of a request for it, and /ready's
`mlm_job` while the default MLM model (the bootstrap job's `wiki-mlm`, or the BERT_MLM_MODEL import) is not
there yet.

Both tell the same facts from the job's record (datadir/jobs.py): its state, step of total steps, what it
does before its first step report (`phase_of`), and its time to go at the pace of its latest report, or
that it has none yet. A job is named by its id, with its progress in the 503's body (`job`, app/errors.py's
JobProgress), only where the reader may see it: the request's own key's job, any job for an admin key, or
any where the service has no keys; the others are "another key's job".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.errors import ServiceError
from app.keys.limits import CALLER
from datadir import JobRecords
from datadir.jobs import JobRecord, phase_of, steps_of
from datadir.scheduling import job_words

ENDED = ("cancelled", "failed")


def caller_sees(record: Mapping[str, Any]) -> bool:
    """Whether the request being served may see this job by its id: its key's own, or any job for a key
    with the scope admin, or where the service has no keys (app/keys/limits.py's CALLER)."""
    caller = CALLER.get()
    return caller is None or caller.sees_job(record)


def making(jobs: JobRecords, name: str) -> JobRecord | None:
    """The job that will publish model `name` (queued or running), else the newest one that was to and was
    cancelled or failed; None when there is neither."""
    record = jobs.unfinished_job_for_model(name)
    if record is not None:
        return record
    ended = next((r for r in jobs.list() if r.get("model_name") == name), None)  # newest first
    return ended if ended is not None and ended["state"] in ENDED else None


def progress(record: Mapping[str, Any]) -> dict[str, Any]:
    """The job as JobProgress has it (a 503's `job`, /ready's `mlm_job`)."""
    step, total = steps_of(record)
    return {
        "id": record["id"],
        "model_name": record["model_name"],
        "state": record["state"],
        "step": step,
        "total_steps": total,
        "phase": phase_of(record),
        "eta_s": eta_of(record),
        "status_url": f"/jobs/{record['id']}",
    }


def eta_of(record: Mapping[str, Any]) -> float | None:
    """Seconds to go at the pace of the job's latest step report; None before its first, or when not running."""
    eta = (record.get("progress") or {}).get("eta_s")
    return float(eta) if record["state"] == "running" and eta is not None else None


def time_words(seconds: float) -> str:
    """'about 40 s', 'about 19 min', 'about 2 h 5 min'."""
    if seconds < 90:
        return f"about {max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    return f"about {minutes} min" if minutes < 90 else f"about {minutes // 60} h {minutes % 60} min"


def progress_words(record: Mapping[str, Any]) -> str:
    """'running, step 45 of 200, about 19 min to go at its current pace', or what it does before it has a pace."""
    step, total = steps_of(record)
    words = [record["state"], f"step {step} of {total}"]
    if (phase := phase_of(record)) is not None:
        words.append(phase)
    if record["state"] == "queued":
        words.append("not started yet")
    elif (eta := eta_of(record)) is not None:
        words.append(f"{time_words(eta)} to go at its current pace")
    elif record["state"] == "running":
        words.append("no time estimate before its first step report")
    return ", ".join(words)


def _detail(record: Mapping[str, Any]) -> dict[str, Any]:
    """The `job` of a 503's body: a job the request's key may see; else none."""
    return {"job": progress(record)} if caller_sees(record) else {}


def still_making(name: str, record: Mapping[str, Any], meanwhile: str = "") -> ServiceError:
    """The 503 for model `name` while a queued or running job makes it; `meanwhile`: what answers until then."""
    who = job_words(record, caller_sees)
    if record.get("kind") == "import":
        done = record.get("progress") or {}
        bytes_done = f", {done['downloaded_bytes']:,} of {done['total_bytes']:,} bytes" if done else ""
        doing = f"being imported by {who} ({record['state']}{bytes_done})"
    else:
        doing = f"still being trained by {who} ({progress_words(record)})"
    message = f"model '{name}' is {doing}; it is served as soon as the job finishes{meanwhile}"
    return ServiceError("unavailable", message, **_detail(record))


def ended(name: str, record: Mapping[str, Any]) -> ServiceError:
    """The 503 for the default MLM model `name` when the job that was to make it (the bootstrap job, or its
    import) was cancelled or failed: the job, and how to start it again."""
    step, total = steps_of(record)
    seen = caller_sees(record)
    how = "`bert init`, or by starting `bert up` (`make run`) again"
    if record.get("kind") != "import" and record.get("latest_checkpoint") and seen:
        how += f", which resumes it from {record['latest_checkpoint']}"
    why = f": {record['error']}" if record["state"] == "failed" and record.get("error") and seen else ""
    return ServiceError(
        "unavailable",
        f"model '{name}', the default for /fill-mask and /nsp, is missing: {job_words(record, caller_sees)} "
        f"that makes it was {record['state']} at step {step} of {total}{why}; start it again with {how}",
        **_detail(record),
    )
