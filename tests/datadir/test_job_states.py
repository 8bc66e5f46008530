"""datadir/jobs.py's lifecycle: every named transition from every state. A move the table declares
takes the job to the declared state and appends its event; any other raises (JobFinished from a finished
state) and leaves job.json on disk byte for byte as it was."""

from __future__ import annotations

import copy

import pytest

from datadir import STATES, TERMINAL, TRANSITIONS, IllegalTransition, JobFinished, JobRecords, jobs
from tests.helpers import finetune_spec

# Each named transition, the arguments it takes, and the event it appends (by the job's state for
# ask_to_cancel: a queued job is cancelled at once, a running one is asked to stop).
NAMED = {
    jobs.enqueued: ((), "enqueued"),
    jobs.requeued: (("recovery sweep",), "re-enqueued"),
    jobs.duplicate_ignored: (("running elsewhere",), "duplicate delivery ignored"),
    jobs.start: (("host:1",), "started"),
    jobs.attempt_did_not_finish: ((), "attempt did not finish"),
    jobs.worker_process_lost: (("SIGKILL",), "worker process lost"),
    jobs.ranks_lost: (("a rank died",), "training processes lost"),
    jobs.resumed: (("checkpoints/step-5",), "resumed"),
    jobs.ask_to_cancel: ((), lambda state: "cancelled" if state == "queued" else "cancel requested"),
    jobs.hand_back: (("the worker is shutting down",), "handed back"),
    jobs.make_way: (("20261204T120000-0a0b0c0d", "for a job of higher priority"), "made way"),
    jobs.restart: ((), "restarted"),
    jobs.succeed: (({"model": "m"}, "model 'm' published"), "succeeded"),
    jobs.fail: (("ValueError: boom",), "failed"),
    jobs.time_out: (("time limit: used up", "at step 5"), "time limit"),
    jobs.give_up: (("gave up after 3 attempts",), "too many attempts"),
    jobs.cancel: (("at step 5",), "cancelled"),
    jobs.cancel_before_start: ((), "cancelled before it could run"),
    jobs.discard: (("the broker could not be reached",), "discarded"),
    jobs.checkpoints_removed: ((1024,), "checkpoints removed"),
}


def event_of(transition, state: str) -> str:
    event = NAMED[transition][1]
    return event(state) if callable(event) else event


@pytest.fixture
def store(tmp_path):
    return JobRecords(tmp_path / "data")


def job_in(store: JobRecords, state: str) -> str:
    job_id = store.create(finetune_spec("m"))["id"]
    store.update(job_id, lambda r: r.update(state=state, attempts=1))  # a test may set any state
    return job_id


def test_the_named_transitions_cover_the_whole_table():
    declared = {event for _, event in TRANSITIONS}
    named = {event_of(t, s) for t in NAMED for s in STATES}
    assert named == declared
    assert {s for pair in TRANSITIONS.items() for s in (pair[0][0], pair[1])} <= set(STATES)
    public = {
        name
        for name, f in vars(jobs).items()
        if callable(f)
        and not name.startswith("_")
        and getattr(f, "__module__", None) == jobs.__name__
        and not isinstance(f, type)
        and name not in ("steps_of", "phase_of", "with_phase", "encode", "owner_of")  # readers, progress, the encoder
    }
    assert public == {t.__name__ for t in NAMED}  # a transition added to jobs.py must be walked here too


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("transition", list(NAMED), ids=lambda t: t.__name__)
def test_every_transition_from_every_state(store, state, transition):
    job_id = job_in(store, state)
    path = store.job_dir(job_id) / jobs.RECORD
    before = path.read_bytes()
    args, event = NAMED[transition][0], event_of(transition, state)
    to = TRANSITIONS.get((state, event))
    if to is None:
        with pytest.raises(JobFinished if state in TERMINAL else IllegalTransition) as illegal:
            store.move(job_id, transition, *args)
        assert (illegal.value.job_id, illegal.value.state, illegal.value.event) == (job_id, state, event)
        assert f"job {job_id} is {state}" in str(illegal.value)
        assert path.read_bytes() == before
        return
    record = store.move(job_id, transition, *args)
    assert store.read(job_id) == record
    assert (record["state"], record["events"][-1]["event"]) == (to, event)
    assert len(record["events"]) == len(store.read(job_id)["events"]) == 2  # "created", then this one
    if to in TERMINAL and state not in TERMINAL:
        assert record["finished_at"] is not None and record["heartbeat_at"] is None


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("transition", list(NAMED), ids=lambda t: t.__name__)
def test_an_illegal_move_changes_nothing_in_memory_either(store, state, transition):
    """Callers run several transitions in one locked update (worker/training.py: begin): a refused one
    must not leave the record half changed."""
    record = store.read(job_in(store, state))
    if (state, event_of(transition, state)) in TRANSITIONS:
        return
    before = copy.deepcopy(record)
    with pytest.raises(IllegalTransition):
        transition(record, *NAMED[transition][0])
    assert record == before


def test_what_the_moves_write_besides_the_state(store):
    job_id = store.create(finetune_spec("m"))["id"]
    record = store.move(job_id, jobs.start, "host:1")
    assert (record["attempts"], record["worker"], record["events"][-1]["detail"]) == (
        1,
        "host:1",
        "attempt 1 on host:1",
    )
    assert record["started_at"] and record["heartbeat_at"]
    first_start = record["started_at"]
    record = store.move(job_id, jobs.worker_process_lost, "SIGKILL")
    assert record["lost_attempt"]["attempt"] == 1 and record["lost_attempt"]["reason"] == "SIGKILL"
    record = store.move(job_id, jobs.attempt_did_not_finish)
    assert record["error"] == "attempt 1 did not finish: SIGKILL" == record["events"][-1]["detail"]
    record = store.move(job_id, jobs.start, "host:2")
    assert (record["attempts"], record["started_at"]) == (2, first_start)
    record = store.move(job_id, jobs.hand_back, "the worker is shutting down")
    assert (record["state"], record["attempts"], record["worker"], record["heartbeat_at"]) == ("queued", 1, None, None)
    store.move(job_id, jobs.start, "host:3")
    record = store.move(job_id, jobs.succeed, {"model": "m"}, "model 'm' published")
    assert (record["result"], record["error"], record["finished_at"] is not None) == ({"model": "m"}, None, True)
    assert [e["event"] for e in record["events"]] == [
        "created",
        "started",
        "worker process lost",
        "attempt did not finish",
        "started",
        "handed back",
        "started",
        "succeeded",
    ]


def test_a_cancel_of_a_finished_job_is_refused_with_its_state(store):
    job_id = job_in(store, "succeeded")
    with pytest.raises(JobFinished) as finished:
        store.request_cancel(job_id)
    assert (finished.value.state, str(finished.value)) == ("succeeded", f"job {job_id} is succeeded")
    assert not store.cancel_requested(job_id)


def test_making_way_and_restarting_write_what_the_next_attempt_needs(store):
    job_id = store.create(finetune_spec("m"))["id"]
    store.move(job_id, jobs.start, "host:1")
    record = store.move(job_id, jobs.make_way, "20261204T120000-0a0b0c0d", "for job 20261204T120000-0a0b0c0d")
    assert (record["state"], record["attempts"], record["worker"], record["preempted_for"]) == (
        "queued",
        0,
        None,
        "20261204T120000-0a0b0c0d",
    )
    assert store.move(job_id, jobs.start, "host:2")["preempted_for"] is None  # it runs again: nobody waits on it

    store.request_cancel(job_id)
    store.move(job_id, jobs.cancel, "at step 5")
    assert store.cancel_requested(job_id)
    record = store.restart(job_id)
    assert (record["state"], record["attempts"], record["cancel_requested"], record["finished_at"]) == (
        "queued",
        0,
        False,
        None,
    )
    assert record["events"][-1] == {"at": record["events"][-1]["at"], "event": "restarted", "detail": "was cancelled"}
    assert not store.cancel_requested(job_id)  # the cancel file is gone: the next attempt trains
    with pytest.raises(IllegalTransition):
        store.restart(job_id)  # a queued job cannot be restarted
