"""`bert up` (what `make run` runs): the whole system on one machine, without Docker or Redis.

It is the compose deployment with one difference, the broker URL: a Celery transport that needs no
server (kombu's SQLAlchemy transport on a sqlite file in DATA_DIR). The same `bert worker` and
`bert serve` run, as a child process and in this process. On first start it

- imports the bundled all-MiniLM-L6-v2 encoder as model `minilm` (the default: /embeddings works as
  soon as the server is up),
- registers the Wikipedia demo corpus as dataset `wiki`, and
- queues an ordinary pretraining job that warm-starts from `minilm` and publishes `wiki-mlm`, the
  default model of /fill-mask and /nsp. Until it finishes those routes answer 503 naming the job.

Nothing here is special-cased elsewhere: the job shows in GET /jobs and its model is a model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from model.datadir import DataDir, JobStore, read_meta
from model.demo_data import AssetMissingError, ensure_minilm, prepare_wiki
from model.errors import UserError
from model.files import TMP_PREFIX

from .datasets import add_local_dataset
from .errors import ServiceError
from .job_service import JobService
from .schemas import PretrainJobRequest, PretrainParams
from .server import serve
from .settings import Settings
from .store import ModelStore

ENCODER = "minilm"
CORPUS = "wiki"
BOOTSTRAP_MODEL = "wiki-mlm"
# Five to ten minutes on two CPU cores: whole-model continued pretraining (MLM + NSP), which beat
# heads-only training on a frozen encoder at equal time (README, "The bootstrap model is a
# placeholder"); checkpoints every 25 steps so a restart loses little.
BOOTSTRAP_PARAMS = dict(max_steps=200, batch_size=16, max_seq_len=128, lr=1e-4, warmup_steps=10,
                        save_every=25, eval_every=0, eval_fraction=0.02, log_every=5, seed=0)


def prepare(data_dir: Path, log=print) -> None:
    """The MiniLM encoder and the Wikipedia corpus in DATA_DIR, once."""
    if not DataDir(data_dir).model(ENCODER).is_dir():
        log(f"importing all-MiniLM-L6-v2 as model '{ENCODER}' ...")
        ensure_minilm(DataDir(data_dir).model(ENCODER))
    if read_meta(data_dir, CORPUS) is None:
        log(f"registering the Wikipedia demo corpus as dataset '{CORPUS}' ...")
        with tempfile.TemporaryDirectory(dir=data_dir, prefix=TMP_PREFIX) as staging:
            text = Path(staging) / "wiki.txt"
            prepare_wiki(text)
            add_local_dataset(data_dir, text, CORPUS, "corpus")


def bootstrap_job(settings: Settings, steps: int | None = None) -> dict | None:
    """Queue the bootstrap job unless it ran, runs, or its model exists; the record, or None."""
    data_dir = settings.data_dir
    if DataDir(data_dir).model(BOOTSTRAP_MODEL).is_dir():
        return None
    for record in JobStore(data_dir).list():
        if record.get("model_name") == BOOTSTRAP_MODEL and record["state"] != "cancelled":
            return record  # queued/running: the worker's recovery sweep picks it up; failed: say so
    request = PretrainJobRequest(kind="pretrain", model_name=BOOTSTRAP_MODEL, base_model=ENCODER, dataset=CORPUS,
                                 params=PretrainParams(**bootstrap_params(steps)))
    jobs = JobService(settings, data_dir, ModelStore(data_dir, ENCODER, torch.device("cpu")))
    return asyncio.run(jobs.submit(request))


def bootstrap_params(steps: int | None) -> dict:
    """BOOTSTRAP_PARAMS, shortened to `steps` (tests use a few; warmup and checkpoints scale with it)."""
    if not steps:
        return dict(BOOTSTRAP_PARAMS)
    return {**BOOTSTRAP_PARAMS, "max_steps": steps, "warmup_steps": min(BOOTSTRAP_PARAMS["warmup_steps"], steps // 10),
            "save_every": min(BOOTSTRAP_PARAMS["save_every"], steps), "log_every": 1}


def local_settings(data_dir: Path, host: str | None, port: int | None) -> tuple[Settings, dict]:
    """Settings for this process and the environment for the worker: the same values."""
    env = dict(os.environ)
    env["BERT_DATA_DIR"] = str(data_dir)
    env.setdefault("BERT_BROKER_URL", f"sqla+sqlite:///{data_dir}/broker.sqlite")
    env.setdefault("BERT_DEFAULT_MODEL", ENCODER)
    env.setdefault("BERT_DEFAULT_MLM_MODEL", BOOTSTRAP_MODEL)
    env.pop("REDIS_URL", None)  # the broker URL above wins; REDIS_URL is the compose spelling
    overrides = {"data_dir": data_dir, "broker_url": env["BERT_BROKER_URL"], "default_model": env["BERT_DEFAULT_MODEL"],
                 "default_mlm_model": env["BERT_DEFAULT_MLM_MODEL"]}
    overrides.update({k: v for k, v in (("host", host), ("port", port)) if v is not None})
    return Settings(**overrides), env


def start_worker(env: dict) -> subprocess.Popen:
    # Its own session: Ctrl-C in the terminal reaches only us, and we stop the worker the right way.
    return subprocess.Popen([sys.executable, "-m", "app.cli", "worker", "--hostname", "local@%h"], env=env,
                            start_new_session=True)


def stop_worker(worker: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM: the worker finishes its step, checkpoints and hands the job back (resumed next time)."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(grace_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def up(data_dir: str | Path, host: str | None = None, port: int | None = None, bootstrap: bool = True,
       bootstrap_steps: int | None = None) -> int:
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        prepare(data_dir)
    except AssetMissingError as e:
        raise UserError(str(e)) from None
    settings, env = local_settings(data_dir, host, port)
    # uvicorn re-raises the SIGTERM it caught once it has shut down; turn it into an exception so
    # the `finally` below still stops the worker (the default action would kill us first).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    worker = start_worker(env)
    try:
        if bootstrap:
            record = bootstrap_job(settings, bootstrap_steps)
            if record is not None:
                print(f"bootstrap job {record['id']} ({record['state']}) trains '{BOOTSTRAP_MODEL}'; "
                      f"GET /jobs/{record['id']} shows its progress")
        return serve(settings=settings)
    except ServiceError as e:
        raise UserError(e.message) from None
    finally:
        stop_worker(worker)
