"""`bert init` (the compose stack's first start) and the key guard of `bert init` / `bert up`, as
subprocesses with a real Redis: an empty DATA_DIR is filled once, however often and however many
at once it runs, and a service published beyond loopback without a key, or on a port in use, writes and
starts nothing. `bert up` as users run it (its sqlite broker): what a first start says, and its stop by
SIGTERM, however the signal arrives."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from datadir import JobRecords
from datadir.cards import CARD, read_card
from model.precision_choice import cpu_kind
from tests.conftest import MINILM_DIR
from tests.helpers import REDIS_URL, ROOT, child_env, flush_redis, free_port, wait_for

pytestmark = pytest.mark.slow
# The bundled encoder's card: where it came from, and its held-out evaluation (none: it has no MLM or NSP head).
MINILM_CARD = {
    "source": {"kind": "directory", "path": str(MINILM_DIR.resolve())},
    "evaluation": {"set": "wiki-heldout-v1", "skipped": "BertModel has no masked-LM or next-sentence head"},
}


def minilm_card(data_dir: Path) -> dict:
    """The bundled encoder's card, less the row of precisions measured where it was imported: this kind of CPU's
    (model/precision_choice.py), the one row it has."""
    card = read_card(data_dir / "models" / "minilm")
    assert set(card.pop("precision")) == {cpu_kind()}
    return card


def bert(data_dir: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args, "--data-dir", str(data_dir)],
        cwd=ROOT,
        env=child_env(data_dir, REDIS_URL, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=280)  # two inits at once on a loaded 2-core machine; pytest's own is 300
    return proc.returncode, out, err


def test_init_fills_an_empty_data_dir_once_even_when_run_twice_at_once(tmp_path):
    """... and queues the bootstrap job again once it was cancelled."""
    flush_redis()
    data_dir = tmp_path / "data"
    results = [finish(p) for p in [bert(data_dir, "init", "--bootstrap-steps", "3") for _ in range(2)]]
    assert [code for code, _, _ in results] == [0, 0], results
    jobs = JobRecords(data_dir).list()
    assert [j["model_name"] for j in jobs] == ["wiki-mlm"], "one bootstrap job, not one per run"
    assert jobs[0]["params"]["max_steps"] == 3
    assert (data_dir / "models" / "minilm" / "config.json").is_file()
    assert minilm_card(data_dir) == MINILM_CARD  # the card `bert import` of its directory makes
    assert (data_dir / "datasets" / "wiki" / "meta.json").is_file()

    (data_dir / "models" / "minilm" / CARD).unlink()  # as an earlier start's import left it: the next start adds it
    code, out, _ = finish(bert(data_dir, "init"))
    assert code == 0 and f"bootstrap job {jobs[0]['id']} (queued)" in out
    assert minilm_card(data_dir) == MINILM_CARD
    assert len(JobRecords(data_dir).list()) == 1
    assert jobs[0]["priority"] == -10  # the lowest: any job a person submits goes first

    # Cancelled, it is queued again by the next start: the same job (it resumes its checkpoint), not a new one.
    store = JobRecords(data_dir)
    store.request_cancel(jobs[0]["id"])
    flush_redis()
    code, out, err = finish(bert(data_dir, "init"))
    assert code == 0, err
    assert f"bootstrap job {jobs[0]['id']} (queued) trains 'wiki-mlm'" in out
    [again] = store.list()
    assert (again["id"], again["state"], again["cancel_requested"]) == (jobs[0]["id"], "queued", False)
    assert [e["event"] for e in again["events"]][-2:] == ["restarted", "enqueued"]
    assert redis.Redis.from_url(REDIS_URL).llen("training") == 1  # its message was sent


def test_init_without_the_bootstrap_job_from_the_environment(tmp_path):
    data_dir = tmp_path / "data"
    code, out, err = finish(bert(data_dir, "init", BERT_BOOTSTRAP="false"))
    assert code == 0, err
    assert JobRecords(data_dir).list() == [] and (data_dir / "models" / "minilm").is_dir()

    code, _, err = finish(bert(tmp_path / "other", "init", BERT_BOOTSTRAP="maybe"))
    assert code == 2 and "BERT_BOOTSTRAP must be true or false, got 'maybe'" in err


@pytest.mark.parametrize(
    "env, read",
    [
        ({}, (True, None)),
        ({"BERT_BOOTSTRAP": " ", "BERT_BOOTSTRAP_STEPS": ""}, (True, None)),  # compose passes blanks
        ({"BERT_BOOTSTRAP": "Off", "BERT_BOOTSTRAP_STEPS": " 6 "}, (False, 6)),
        ({"BERT_BOOTSTRAP": "yes", "BERT_BOOTSTRAP_STEPS": "0"}, (True, 0)),  # `bert init` refuses 0, as its flag
        ({"BERT_BOOTSTRAP_STEPS": "six"}, "BERT_BOOTSTRAP_STEPS must be a whole number, got 'six'"),
    ],
)
def test_the_bootstrap_variables_are_settings(monkeypatch, env, read):
    from pydantic import ValidationError

    from app.settings import Settings

    for name in ("BERT_BOOTSTRAP", "BERT_BOOTSTRAP_STEPS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(read, tuple):
        settings = Settings()
        assert (settings.bootstrap, settings.bootstrap_steps) == read
        return
    with pytest.raises(ValidationError, match=read):
        Settings()


@pytest.mark.parametrize("command", ["init", "up"])
def test_published_beyond_loopback_without_a_key_nothing_is_written_or_started(tmp_path, command):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    code, _, err = finish(bert(data_dir, command, BERT_HOST="0.0.0.0", BERT_PUBLISHED_HOST="0.0.0.0"))
    assert code == 2
    assert "refusing to serve: the port is published on 0.0.0.0" in err and "BERT_API_KEY" in err
    assert list(data_dir.iterdir()) == []


@pytest.mark.parametrize("command", ["serve", "up"])
@pytest.mark.parametrize("by_setting", [False, True], ids=["--port", "BERT_PORT"])
def test_a_port_in_use_is_refused_before_anything_starts(tmp_path, command, by_setting):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args, env = ([command], {"BERT_PORT": port}) if by_setting else ([command, "--port", port], {})
        code, out, err = finish(bert(data_dir, *args, **env))
    # one line, and no other: nothing was loaded, probed (the Hub) or started before it
    assert (code, out, err) == (
        2,
        "",
        f"refusing to start: 127.0.0.1:{port} is already in use; choose another port with --port or BERT_PORT\n",
    )
    assert list(data_dir.iterdir()) == []


# -- `bert up`, started and stopped as a service manager does ----------------------------------------


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, session id) of every process, from /proc/<pid>/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, rest = stat.read_text().split(" (", 1)
            state, ppid, _, sid = rest.rsplit(") ", 1)[1].split()[:4]
            found.append((int(pid), state, int(ppid), int(sid)))
    return found


def alive_in(*sids: int) -> list[int]:
    """The processes of these sessions that have not ended (a zombie has)."""
    return [pid for pid, state, _, sid in processes() if sid in sids and state != "Z"]


def worker_of(up: subprocess.Popen) -> int:
    """The worker `bert up` started, in a session of its own."""
    return next(pid for pid, _, ppid, sid in processes() if ppid == up.pid and sid == pid)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("to", ["every process", "bert up"])
def test_up_starts_quietly_and_any_sigterm_stops_every_process(tmp_path, to):
    """A first start says what happened and nothing more, and the bundled model has its card. SIGTERM to every
    process at once (systemd's stop: the whole control group) or to `bert up` alone: the running job hands back
    at its next step, and every process of both sessions ends, with exit status 0, well within the drain, the
    graceful timeout and the worker's grace (the deadline is a hang check, not a measure)."""
    from app.launcher.local import WORKER_STOP_GRACE_S
    from app.settings import Settings

    data_dir, port, drain = tmp_path / "data", free_port(), 1.0
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERT_") and k != "REDIS_URL"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", BERT_MLM_MODEL="", BERT_DRAIN_SECONDS=str(drain))
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")  # noqa: SIM115  (bert up's, read below)
    argv = ["up", "--data-dir", str(data_dir), "--port", str(port), "--bootstrap-steps", "100"]
    up = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True
    )
    url, worker = f"http://127.0.0.1:{port}", None
    try:
        with httpx.Client(base_url=url, timeout=10) as client:

            def running() -> dict | None:
                assert up.poll() is None, (tmp_path / "err").read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    jobs = client.get("/jobs").json()["jobs"]
                    return next((j for j in jobs if j["state"] == "running" and j["step"]), None)
                return None

            job = wait_for(running, 300, "the bootstrap job's first step", interval=0.5)
            card = client.get("/models/minilm").json()["card"]
        worker = worker_of(up)
        os.killpg(up.pid, signal.SIGTERM)
        if to == "every process":
            os.killpg(worker, signal.SIGTERM)
        deadline = drain + Settings.model_fields["graceful_timeout"].default + WORKER_STOP_GRACE_S + 60
        assert up.wait(deadline) == 0
        wait_for(lambda: not alive_in(up.pid, worker), 10, "the processes of bert up's sessions to end")
    finally:
        for group in (up.pid, worker):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.killpg(group, signal.SIGKILL)
        out.close()
        err.close()
    assert set(card.pop("precision")) == {cpu_kind()} and card == MINILM_CARD  # its row of measured precisions
    record = JobRecords(data_dir).read(job["id"])
    events = [e["event"] for e in record["events"]]
    assert record["state"] == "queued" and "handed back" in events and "attempt did not finish" not in events
    log = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert (
        f"recovery sweep: 1 job queued, waiting for a worker; sent again in case the broker lost the message: "
        f"{job['id']}" in log
    )
    warnings = [line for line in log.splitlines() if re.search("warn", line, re.I)]
    if os.geteuid() == 0:  # Celery's warning that a worker should not run as root (its two lines): that one is true
        warnings = [w for w in warnings if "running the worker with superuser" not in w and "_warn_or_raise" not in w]
    assert warnings == []
