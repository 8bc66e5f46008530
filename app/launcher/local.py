"""`bert up` (what `make run` runs): the whole system on one machine, without Docker or Redis.

It is the compose deployment with one difference, the broker URL: a Celery transport that needs no
server (kombu's SQLAlchemy transport on a sqlite file in DATA_DIR). The same `bert worker` and
`bert serve` run, as a child process and in this process, and the same first start as the compose
stack's `init` service (app/launcher/bootstrap.py): MiniLM as model `minilm`, the Wikipedia corpus as dataset
`wiki`, and the model for /fill-mask and /nsp (BERT_MLM_MODEL from the Hub, or the bootstrap job that
trains `wiki-mlm`).

A stop (Ctrl-C, or SIGTERM to this process alone or to every process at once, as systemd sends it) ends
the API as `bert serve` does, then the worker, which hands its job back within WORKER_STOP_GRACE_S;
SIGTERM's exit status is 0, Ctrl-C's 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from app.errors import ServiceError
from app.launcher.bootstrap import ENCODER, initialize
from app.launcher.demo_data import AssetMissingError
from app.launcher.server import exposure_refusal, listen_refusal, serve
from app.settings import Settings
from model.errors import UserError

# Seconds the worker gets to hand its job back (its step, a checkpoint) once the API has stopped: compose's
# stop_grace_period for a worker, and the time to give `docker run --stop-timeout` or systemd's TimeoutStopSec.
WORKER_STOP_GRACE_S = 120.0


def local_settings(data_dir: Path, host: str | None, port: int | None) -> tuple[Settings, dict]:
    """Settings for this process and the environment for the worker: the same values."""
    env = dict(os.environ)
    env["BERT_DATA_DIR"] = str(data_dir)
    env.setdefault("BERT_BROKER_URL", f"sqla+sqlite:///{data_dir}/broker.sqlite")
    env.setdefault("BERT_DEFAULT_MODEL", ENCODER)
    env.pop("REDIS_URL", None)  # the broker URL above wins; REDIS_URL is the compose spelling
    overrides: dict[str, Any] = {
        "data_dir": data_dir,
        "broker_url": env["BERT_BROKER_URL"],
        "default_model": env["BERT_DEFAULT_MODEL"],
        # unset: the model the first start chose for /fill-mask and /nsp (DATA_DIR/defaults.json)
        "default_mlm_model": env.get("BERT_DEFAULT_MLM_MODEL") or None,
    }
    overrides.update({k: v for k, v in (("host", host), ("port", port)) if v is not None})
    return Settings(**overrides), env


def start_worker(env: dict) -> subprocess.Popen:
    # Its own session: Ctrl-C in the terminal reaches only us, and we stop the worker the right way.
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", "worker", "--hostname", "local@%h"], env=env, start_new_session=True
    )


def stop_worker(worker: subprocess.Popen, grace_s: float = WORKER_STOP_GRACE_S) -> None:
    """SIGTERM: the worker finishes its step, checkpoints and hands the job back (resumed next time); SIGKILL to
    its process group after `grace_s`, or at once on Ctrl-C meanwhile. Another SIGTERM changes nothing: the
    stop is under way (systemd sends one to every process, and a person may send one more)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(grace_s)
    except subprocess.TimeoutExpired:
        _kill_group(worker)
    except KeyboardInterrupt:
        _kill_group(worker)
        raise


def _kill_group(worker: subprocess.Popen) -> None:
    """SIGKILL to the worker's process group: its main process and its pool process."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()


def up(
    data_dir: str | Path,
    host: str | None = None,
    port: int | None = None,
    bootstrap: bool = True,
    bootstrap_steps: int | None = None,
) -> int:
    settings, env = local_settings(Path(data_dir).resolve(), host, port)
    refusal = exposure_refusal(settings, settings.host) or listen_refusal(settings.host, settings.port)
    if refusal:  # before anything is written or started
        print(refusal, file=sys.stderr)
        return 2
    try:
        initialize(settings, bootstrap=False)  # the models and corpus, before anything starts
    except AssetMissingError as e:
        raise UserError(str(e)) from None
    # A SIGTERM before the server runs, or the one uvicorn re-raises once it has shut down (without a drain), ends
    # in the `finally` below, which stops the worker (the default action would kill us first). A stop by SIGTERM
    # is a clean one: exit status 0, as after the drain.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    worker = start_worker(env)
    try:
        if bootstrap:
            initialize(settings, steps=bootstrap_steps)
        return serve(settings=settings)
    except ServiceError as e:
        raise UserError(e.message) from None
    finally:
        stop_worker(worker)
