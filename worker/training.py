"""One delivery of a training job: an attempt through the runner (datadir/runner.py), training with
reporting callbacks, publishing.

    run_job(job_id, settings)
      1. lease     the runner takes DATA_DIR/jobs/<id>/.lease; held elsewhere -> a duplicate delivery: noted
      2. begin     the runner decides under the record lock: finished/cancelled -> nothing; a previous attempt
                   that died is noted, with the reason the worker saw (worker/recovery.py), as the job's error;
                   too many attempts, or max_runtime used up -> failed; else attempts += 1, running
      3. train     model.training.runs' run_pretraining/run_finetuning, the job directory as run directory
                   (worker/recipes.py): it continues from the latest complete checkpoint; callbacks write
                   progress and runtime into job.json and stop the loop on a cancel request, the job's
                   max_runtime or the worker's soft time limit (the trainer checkpoints first)
      4. finish    completed -> the final model's card is measured (model/model_card.py), the model is
                   renamed into DATA_DIR/models/<name> -> succeeded;
                   stopped -> cancelled (or failed: time limit); exception -> failed with the error;
                   the worker is shutting down (SIGTERM) -> handed back: state queued again, the
                   attempt not counted, and, once the lease is released, the job is sent again;
                   a job of higher priority waits for this slot (datadir/scheduling.py) ->
                   made way: handed back the same way, naming the job it made way for

A delivery (run_delivery) runs the first waiting job in the queue's order, by priority and age,
which need not be the job its message named.

The job's kind is its record's; every change of its state goes through datadir.jobs' named
transitions. Only a process death skips step 4; the next delivery (redelivery, or the recovery sweep in
worker/recovery.py) then finds the lease free and the state "running", and resumes.
This module does not import celery: tests drive it directly.

A job with params.devices = N > 1 trains data-parallel: step 3 runs torchrun (model.training.torchrun) with N
ranks of worker/ddp_job.py as a child process in its own session, and rank 0 does steps 3 and 4 as
above (the same `train`, on the attempt this process began: runner.Attempt.joined; the lease stays here). This process waits:
on a warm shutdown it sends SIGTERM to the ranks' process group (they stop at the same step, rank 0
checkpoints and records the hand-back); if the ranks end without rank 0 recording an outcome (one
died), the attempt is noted as lost and the job sent again, to resume from its latest checkpoint. The
launcher and the ranks die with this process (PR_SET_PDEATHSIG), so a `kill -9` leaves nothing running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from datadir import (
    TERMINAL,
    IllegalTransition,
    JobRecords,
    jobs,
    lease_is_free,
    now_iso,
    publish_model,
    runner,
    scheduling,
)
from datadir.jobs import CANCEL, JobRecord, with_phase
from datadir.publish import NotOwner, audit_publish
from model.errors import UserError
from model.model_card import write_card
from model.training import checkpoint as ckpt
from model.training.callbacks import Callback
from model.training.distributed import is_peer_failure, launched, torchrun_command
from model.training.trainer import FINAL_MODEL
from worker import recipes
from worker.job_trace import TraceCallback
from worker.settings import WorkerSettings
from worker.telemetry import logs, tracing

log = logging.getLogger("bertserve.worker")

HANDED_BACK = "handed back"
RANKS_LOST = "training processes lost"  # a data-parallel attempt ended without an outcome: sent again
RANKS_LOG = "ranks.log"  # a data-parallel job's torchrun output
PROGRESS_KEYS = (
    "step",
    "total_steps",
    "loss",
    "mlm_loss",
    "nsp_loss",
    "lr",
    "tokens_per_s",
    "eta_s",
    "epoch",
    "grad_norm",
    "tokens_seen",
    "world_size",
    "rank_tokens_per_s",
)


NOT_STARTED = "not started: the worker is shutting down"
TRAINING = "training"  # the phase from the loop's start to its first step report (at step log_every)


class Flag(Protocol):
    def is_set(self) -> bool: ...


def run_delivery(
    job_id: str,
    settings: WorkerSettings,
    *,
    shutting_down: Flag | None = None,
    requeue: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Handle a delivery of job `job_id`'s message: run the first job in the queue's order
    (datadir/scheduling.py), which is this one unless one of higher priority, or an older one of
    the same, waits (a running job whose worker died among them). A job another process holds is
    skipped for the next. The job passed over keeps waiting: the message of the job that ran in its
    stead is still queued, and runs it later."""
    if shutting_down is not None and shutting_down.is_set():
        # A warm shutdown: this worker begins nothing more (not even the job it has just handed back, whose
        # message may come to it again before it stops). The message goes back for the next worker.
        if requeue is not None:
            requeue(job_id)
        return {"job": job_id, "outcome": NOT_STARTED}
    listed = JobRecords(settings.data_dir).list()
    # Running jobs whose lease is free lost their worker: they wait too, at their place in the order.
    order = scheduling.delivery_order(listed, runner.orphans(JobRecords(settings.data_dir), listed))
    if job_id not in order:
        order.append(job_id)  # finished or unknown: run_job says so
    result: dict[str, Any] = {"job": job_id, "outcome": "nothing to run"}
    for candidate in order:
        with logs.bound(job_id=candidate):
            result = run_job(candidate, settings, shutting_down=shutting_down, requeue=requeue)
        if result["outcome"] != runner.RUNNING_ELSEWHERE:
            break
    return result


def run_job(
    job_id: str,
    settings: WorkerSettings,
    *,
    shutting_down: Flag | None = None,
    requeue: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Handle one delivery of job `job_id` through the runner (datadir/runner.py); returns what happened
    (the task's result, for logs).

    `shutting_down` (set by the worker on SIGTERM) stops the loop at the next step; the job is then
    handed back and, once the lease is released, `requeue(job_id)` sends it again for another worker.
    """
    records = JobRecords(settings.data_dir)
    if not records.exists(job_id):
        log.warning("job %s: no record in %s; dropping the message", job_id, records.root)
        return {"job": job_id, "outcome": "unknown job"}

    def body(attempt: runner.Attempt) -> str:
        try:
            return train(attempt, settings, shutting_down)
        finally:
            _free_accelerator_memory()

    def after_release(outcome: str) -> None:  # only now: the next delivery must find the lease free
        if outcome in (HANDED_BACK, RANKS_LOST) and requeue is not None:
            requeue(job_id)
            with contextlib.suppress(IllegalTransition):  # another worker took the job and finished it meanwhile
                records.move(job_id, jobs.requeued, "after the hand-back")

    outcome = runner.run(
        records,
        job_id,
        body,
        heartbeat_s=settings.job_heartbeat_s,
        wait_s=1.0,  # a short wait: a recovery sweep's probe holds the lease for an instant
        max_attempts=settings.job_max_attempts,
        after_release=after_release,
    )
    if outcome == runner.RUNNING_ELSEWHERE:
        records.move(job_id, jobs.duplicate_ignored, outcome)
        log.info("job %s is running elsewhere; this delivery does nothing", job_id)
    elif outcome.startswith("already") or outcome == "cancelled":
        log.info("job %s: %s", job_id, outcome)
    return {"job": job_id, "outcome": outcome}


def _free_accelerator_memory() -> None:
    """The pool process outlives the job: hand cached CUDA blocks back for the next one."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- training


class JobReporter(Callback):
    """Trainer callbacks: progress and runtime into job.json (throttled); stop on cancel, worker
    shutdown, the job's max_runtime or the worker's soft time limit.

    Before its first step report the attempt's progress says what it does (datadir.jobs.with_phase): loading
    the model, tokenising the corpus (bytes read of all), then training until that report, which comes
    at once, however recent the last write.

    Runtime is the wall-clock time of the job's attempts, summed: this attempt's clock starts before
    the run loads its data (so learning a vocabulary counts) and job.json's `runtime_s` is brought up
    to date with each progress write and at least every BERT_JOB_HEARTBEAT_S, so a killed attempt
    loses at most that much of its count. Time spent queued does not count.
    """

    def __init__(
        self, records: JobRecords, record: JobRecord, settings: WorkerSettings, shutting_down: Flag | None = None
    ):
        self.records, self.job_id, self.shutting_down = records, record["id"], shutting_down
        self.cancel_path = records.job_dir(self.job_id) / CANCEL
        self.interval = settings.job_progress_interval_s
        self.runtime_interval = settings.job_heartbeat_s
        self.started = time.monotonic()
        self.runtime_before = float(record.get("runtime_s") or 0.0)
        self.max_runtime = record["params"].get("max_runtime")  # None for jobs queued before it existed
        left = self.max_runtime - self.runtime_before if self.max_runtime else float("inf")
        self.limit = "max_runtime" if left <= settings.job_soft_time_limit else "BERT_JOB_SOFT_TIME_LIMIT"
        self.deadline = self.started + min(left, settings.job_soft_time_limit)
        self.preempt_after, self.preempt_check = settings.job_preempt_after_s, settings.job_preempt_check_s
        self.max_preemptions = settings.job_max_preemptions_per_hour  # per owner (scheduling.make_way_for)
        self.stop_reason: str | None = None
        self.making_way_for: Mapping[str, Any] | None = None  # the job of higher priority this one stops for
        self._last_write = self._last_runtime_write = self._last_queue_look = 0.0
        self._phase: str | None = None  # what the record's progress says the attempt does, until its first step

    def runtime(self) -> float:
        """Seconds of training of this job so far, every attempt included."""
        return self.runtime_before + (time.monotonic() - self.started)

    def on_prepare(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        now = time.monotonic()
        if phase == self._phase and now - self._last_write < self.interval and done != total:
            return
        self._phase, self._last_write = phase, now
        self.records.update(
            self.job_id, lambda r: r.__setitem__("progress", with_phase(r.get("progress") or {}, phase, done, total))
        )

    def on_fit_start(self, step: int, resumed: bool) -> None:
        self.on_prepare(TRAINING)

    def on_step(self, state: dict[str, Any]) -> None:
        now = time.monotonic()
        if self._phase is None and now - self._last_write < self.interval and state["step"] < state["total_steps"]:
            return
        self._phase, self._last_write, self._last_runtime_write = None, now, now
        progress, runtime = {k: state.get(k) for k in PROGRESS_KEYS}, round(self.runtime(), 3)
        self.records.update(self.job_id, lambda r: r.update({"progress": progress, "runtime_s": runtime}))

    def on_eval(self, metrics: dict[str, Any]) -> None:
        self.records.update(self.job_id, lambda r: r.__setitem__("eval", metrics))

    def on_checkpoint(self, path: Path) -> None:
        relative = Path(path).relative_to(self.records.job_dir(self.job_id)).as_posix()
        self.records.update(self.job_id, lambda r: r.__setitem__("latest_checkpoint", relative))

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now - self._last_runtime_write >= self.runtime_interval:
            self._last_runtime_write = now
            runtime = round(self.runtime(), 3)
            self.records.update(self.job_id, lambda r: r.__setitem__("runtime_s", runtime))
        if self.cancel_path.exists():
            self.stop_reason = "cancelled"
        elif self.shutting_down is not None and self.shutting_down.is_set():
            self.stop_reason = "shutdown"
        elif now > self.deadline:
            self.stop_reason = "time limit"
        elif self._higher_priority_waits(now):
            self.stop_reason = "preempted"
        return self.stop_reason is not None

    def _higher_priority_waits(self, now: float) -> bool:
        """At most once per BERT_JOB_PREEMPT_CHECK_S: whether a job of higher priority waits for this one's slot."""
        if now - self._last_queue_look < self.preempt_check:
            return False
        self._last_queue_look = now
        self.making_way_for = scheduling.make_way_for(
            self.records.list(),
            self.job_id,
            self.preempt_after,
            lambda job_id: lease_is_free(self.records, job_id),
            max_per_hour=self.max_preemptions,
        )
        return self.making_way_for is not None

    def time_limit_error(self, step: int, checkpoint: str | None, runtime: float) -> str:
        if self.limit == "max_runtime":
            return (
                f"time limit: the job's max_runtime ({self.max_runtime} s) was reached at step {step}, after "
                f"{runtime:.0f} s of training; checkpoint {checkpoint}"
            )
        return f"stopped by the soft time limit (BERT_JOB_SOFT_TIME_LIMIT) at step {step}; checkpoint {checkpoint}"


def train(attempt: runner.Attempt, settings: WorkerSettings, shutting_down: Flag | None = None) -> str:
    """Run (or resume) the training of a job whose attempt has begun, and end it; returns the outcome. With
    tracing on, in a span of the trace of the request that submitted it (a rank: of its launcher's span)."""
    assert attempt.record is not None
    parent = os.environ.get("TRACEPARENT") if launched() else None
    with tracing.job_span(attempt.record, "train", parent) as span:
        outcome = _train(attempt, settings, shutting_down)
        tracing.annotate(**{"bertserve.outcome": outcome})
        if outcome == "failed":
            tracing.fail(span, "the job failed")
    tracing.flush()  # a pool process may be ended before the exporter's next batch
    return outcome


def _train(attempt: runner.Attempt, settings: WorkerSettings, shutting_down: Flag | None) -> str:
    records, record = attempt.records, attempt.record
    assert record is not None
    if record["params"].get("devices", 1) > 1 and not launched():
        return train_ranks(attempt, settings, shutting_down)
    job_id, job_dir = record["id"], records.job_dir(record["id"])
    reporter = JobReporter(records, record, settings, shutting_down)
    try:
        _mark_resume(records, record)
        callbacks = [reporter, *([TraceCallback()] if tracing.enabled() else [])]
        result = recipes.run(record, settings.data_dir, job_dir, settings.worker_device, callbacks)
    except Exception as e:
        if launched() and is_peer_failure(e):  # another rank died: this attempt is lost (train_ranks), not failed
            raise
        return _fail(attempt, e, reporter.runtime())
    if result.stopped:
        return _stopped(attempt, reporter, result)
    _write_card(job_dir / FINAL_MODEL, job_id, result.eval_metrics)
    try:
        with tracing.span("publish", **{"bertserve.model": record["model_name"]}):
            published = publish_model(settings.data_dir, job_id, job_dir / FINAL_MODEL, record["model_name"])
    except Exception as e:
        return _fail(attempt, e, reporter.runtime())
    summary = {
        "model": record["model_name"],
        "model_dir": published.relative_to(settings.data_dir).as_posix(),
        "step": result.step,
        "train_loss": result.train_loss,
        "eval": result.eval_metrics,
        "best_checkpoint": _relative(job_dir, result.best_checkpoint),
    }
    checkpoint = _relative(job_dir, result.checkpoint)
    fields = {"runtime_s": round(reporter.runtime(), 3), **({"latest_checkpoint": checkpoint} if checkpoint else {})}
    audit_publish(settings.data_dir, job_id, record["model_name"], published, source="worker")
    return attempt.succeed(summary, f"model '{record['model_name']}' published", **fields)


def _write_card(model_dir: Path, job_id: str, job_eval: dict | None) -> None:
    """The final model's card (held-out scores, the job's own evaluation), before it is published, so the
    model appears with it. Nothing here fails the job: a retried publish finds the model already moved."""
    if not model_dir.is_dir():
        return
    try:
        write_card(model_dir, job_eval=job_eval, source={"kind": "job", "job_id": job_id})
    except Exception:
        log.exception("job %s: the model card could not be written", job_id)


def train_ranks(attempt: runner.Attempt, settings: WorkerSettings, shutting_down: Flag | None = None) -> str:
    """A data-parallel job: torchrun with params.devices ranks of worker/ddp_job.py; see the module docstring."""
    records, record = attempt.records, attempt.record
    assert record is not None
    job_id, job_dir, devices = record["id"], records.job_dir(record["id"]), record["params"]["devices"]
    try:
        check_devices(devices, settings)
        recipes.prepare(record, settings.data_dir, job_dir)
    except Exception as e:
        return _fail(attempt, e, float(record.get("runtime_s") or 0.0))
    cmd = torchrun_command(["-m", "worker.ddp_job", job_id], devices)
    with open(job_dir / RANKS_LOG, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, env=_rank_env(settings), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    signalled = False
    try:
        while proc.poll() is None:
            if not signalled and shutting_down is not None and shutting_down.is_set():
                os.killpg(proc.pid, signal.SIGTERM)  # torchrun and every rank: all stop at the same step
                signalled = True
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # leaving on an exception: the ranks must not train on without the lease
            _end_group(proc)
    return _ranks_outcome(attempt, proc.returncode)


def _end_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to torchrun's process group (the ranks checkpoint and stop), SIGKILL after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def check_devices(devices: int, settings: WorkerSettings) -> None:
    """UserError when this worker has fewer devices than the job asks (BERT_WORKER_DEVICES)."""
    import torch

    from model.compute.device import resolve_device

    on_cuda = resolve_device(settings.worker_device).type == "cuda"
    have = settings.worker_devices or (torch.cuda.device_count() if on_cuda else os.cpu_count() or 1)
    if devices > have:
        what = "GPUs" if on_cuda else "processes"
        raise UserError(
            f"params.devices is {devices}, but this worker runs at most {have} {what} (BERT_WORKER_DEVICES)"
        )
    if on_cuda and settings.worker_device.startswith("cuda:"):
        raise UserError(
            f"params.devices is {devices}, but BERT_WORKER_DEVICE={settings.worker_device} names "
            "one GPU; a data-parallel job takes cuda:0 to cuda:N-1 (set it to cuda or auto)"
        )


def _rank_env(settings: WorkerSettings) -> dict[str, str]:
    """The ranks read this worker's settings from the environment, as this process did."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if (traceparent := tracing.traceparent()) is not None:  # the ranks' spans continue this attempt's
        env["TRACEPARENT"] = traceparent
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"BERT_{name.upper()}"] = str(value)
    return env


def _ranks_outcome(attempt: runner.Attempt, code: int) -> str:
    """What rank 0 recorded; when it recorded nothing (a rank died, the launcher failed), a lost attempt."""
    record = attempt.records.read(attempt.job_id)
    if record["state"] == "queued":
        return HANDED_BACK
    if record["state"] in TERMINAL:
        return record["state"]
    reason = (
        f"a training process of the data-parallel run ended it (torchrun exit status {code}; "
        f"see {RANKS_LOG} in the job directory)"
    )
    attempt.end(jobs.ranks_lost, reason)  # read by the next delivery's begin
    return RANKS_LOST


def _mark_resume(records: JobRecords, record: JobRecord) -> None:
    """Before a resumed fit: drop a torn metrics line, and mark in the curve where this attempt picks up."""
    job_dir = records.job_dir(record["id"])
    records.repair_metrics(record["id"])
    latest = ckpt.latest_checkpoint(job_dir)
    if latest is None:
        return
    step = ckpt.checkpoint_step(latest)
    # The trainer keeps metrics records with step <= the checkpoint's; this one (step == it) survives.
    records.append_metric(
        record["id"],
        {
            "type": "resume",
            "step": step,
            "attempt": record["attempts"],
            "checkpoint": _relative(job_dir, latest),
            "at": now_iso(),
        },
    )
    records.move(record["id"], jobs.resumed, _relative(job_dir, latest))


def _stopped(attempt: runner.Attempt, reporter: JobReporter, result) -> str:
    # A stop with no reason of this process's own is another rank's: the ranks of a data-parallel job stop
    # together when any asks (model.training.distributed.any_rank), and the other ranks' one reason is their
    # SIGTERM, the warm shutdown's, which may reach them before rank 0's own handler has run: a hand-back.
    job_dir, reason = attempt.records.job_dir(attempt.job_id), reporter.stop_reason or "shutdown"
    checkpoint = _relative(job_dir, result.checkpoint)
    where = f"at step {result.step}, checkpoint {checkpoint}"
    runtime = round(reporter.runtime(), 3)

    def stop(r: JobRecord) -> None:
        r["latest_checkpoint"] = checkpoint or r.get("latest_checkpoint")
        r["runtime_s"] = runtime
        r["progress"] = {**(r.get("progress") or {}), "step": result.step, "eta_s": None}  # progress is throttled
        if reason == "shutdown":  # a clean hand-over, not a failed attempt
            jobs.hand_back(r, f"the worker is shutting down; {where}")
        elif reason == "preempted" and reporter.making_way_for is not None:
            ahead = reporter.making_way_for  # named in the event's fields; the words carry no other key's id
            why = f"for a job of priority {scheduling.priority_of(ahead)}; {where}"
            jobs.make_way(r, ahead["id"], why, jobs.owner_of(ahead))
        elif reason == "cancelled":
            jobs.cancel(r, where)
        else:
            jobs.time_out(r, reporter.time_limit_error(result.step, checkpoint, runtime), where)

    record = attempt.end(stop)
    return HANDED_BACK if reason in ("shutdown", "preempted") else record["state"]


def _fail(attempt: runner.Attempt, error: BaseException, runtime: float) -> str:
    log.exception("job %s failed", attempt.job_id)
    message = str(error) if isinstance(error, UserError | NotOwner) else None
    return attempt.fail(error, message, runtime_s=round(runtime, 3))


def _relative(job_dir: Path, path: str | Path | None) -> str | None:
    if not path:
        return None
    try:
        return Path(path).relative_to(job_dir).as_posix()
    except ValueError:
        return str(path)
