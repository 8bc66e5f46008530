"""`bert init` (the compose stack's first start) and the key guard of `bert init` / `bert up`, as
subprocesses with a real Redis: an empty DATA_DIR is filled once, however often and however many
at once it runs, and a service published beyond loopback without a key writes and starts nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from datadir import JobRecords
from datadir.cards import CARD, read_card
from tests.conftest import MINILM_DIR
from tests.helpers import REDIS_URL, ROOT, child_env, flush_redis

pytestmark = pytest.mark.slow
# The bundled encoder's card: where it came from, and its held-out evaluation (none: it has no MLM or NSP head).
MINILM_CARD = {
    "source": {"kind": "directory", "path": str(MINILM_DIR.resolve())},
    "evaluation": {"set": "wiki-heldout-v1", "skipped": "BertModel has no masked-LM or next-sentence head"},
}


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
    assert read_card(data_dir / "models" / "minilm") == MINILM_CARD  # the card `bert import` of its directory makes
    assert (data_dir / "datasets" / "wiki" / "meta.json").is_file()

    (data_dir / "models" / "minilm" / CARD).unlink()  # as an earlier start's import left it: the next start adds it
    code, out, _ = finish(bert(data_dir, "init"))
    assert code == 0 and f"bootstrap job {jobs[0]['id']} (queued)" in out
    assert read_card(data_dir / "models" / "minilm") == MINILM_CARD
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
