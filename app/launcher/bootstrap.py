"""A first start on an empty DATA_DIR: what makes a fresh install useful at once.

`bert up` (make run) and `bert init` (the compose stack's one-shot `init` service) both call
`initialize`, which

- imports the bundled all-MiniLM-L6-v2 encoder as model `minilm` (the default model: /embeddings
  works as soon as the server is up), with the card an import of its directory gets,
- registers the Wikipedia demo corpus as dataset `wiki`, and
- makes a model for /fill-mask and /nsp: when the Hugging Face Hub answers, an import of BERT_MLM_MODEL
  (google-bert/bert-base-uncased) queued as an import job the API runs (app/jobs/imports.py);
  otherwise an ordinary pretraining job that warm-starts from `minilm` and publishes `wiki-mlm`, at
  the lowest priority (datadir/scheduling.py), so any job a person submits goes first. The
  choice is recorded in DATA_DIR/defaults.json, which every API process reads; until the job
  finishes those routes answer 503 naming it. A start that found the Hub unreachable leaves the next
  start to try again.

Each step happens once: a model, dataset or job that is already there is left alone, so running it
again (every `docker compose up`, several at once) does nothing more. A bootstrap job that was
cancelled or failed is queued again, and resumes from its latest checkpoint. An exclusive flock on
DATA_DIR/.init.lock serialises concurrent runs. Nothing here is special-cased elsewhere: the job
shows in GET /jobs and its model is a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from app.jobs.imports import Imports
from app.jobs.job_service import JobService
from app.jobs.uploads import add_local_dataset
from app.launcher.demo_data import ensure_minilm, prepare_wiki
from app.schemas.jobs import PretrainJobRequest, PretrainParams
from app.serving.model_registry import ModelRegistry
from app.settings import Settings
from datadir import DataDir, JobRecord, model_dir_for, read_meta
from datadir.defaults import set_default
from datadir.files import TMP_PREFIX
from datadir.scheduling import BOOTSTRAP_PRIORITY
from model.sources import hub_model_name, hub_unreachable

ENCODER = "minilm"
CORPUS = "wiki"
BOOTSTRAP_MODEL = "wiki-mlm"
# Whole-model continued pretraining (MLM + NSP), which beat heads-only training on a frozen encoder at
# equal time (docs/training.md, "The bootstrap model"): minutes on idle CPU cores, several times that
# on busy ones; checkpoints every 25 steps so a restart loses little; every step reported, so the job's
# pace (its ETA, in GET /jobs/{id}, /ready and the 503 of /fill-mask) is known after its first step.
BOOTSTRAP_PARAMS = dict(
    max_steps=200,
    batch_size=16,
    max_seq_len=128,
    lr=1e-4,
    warmup_steps=10,
    save_every=25,
    eval_every=0,
    eval_fraction=0.02,
    log_every=1,
    seed=0,
)


def initialize(
    settings: Settings, bootstrap: bool = True, steps: int | None = None, log: Callable[[str], None] = print
) -> JobRecord | None:
    """Encoder, corpus and (if `bootstrap`) the bootstrap job, each unless already there; the job's
    record, or None when there is none to follow. Raises AssetMissingError when an asset is not
    installed and ServiceError when the job cannot be queued (the broker is down)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(DataDir(settings.data_dir).init_lock):
        prepare(settings.data_dir, log)
        if not bootstrap:
            return None
        imported, record = mlm_import(settings, log)
        if not imported:
            record = bootstrap_job(settings, steps)
            set_default(settings.data_dir, "mlm", BOOTSTRAP_MODEL)
    if record is not None:
        job = "import job" if record["kind"] == "import" else "bootstrap job"
        what = f"imports '{record['model_name']}'" if record["kind"] == "import" else f"trains '{BOOTSTRAP_MODEL}'"
        if record["kind"] != "import" and record["state"] == "queued" and record.get("latest_checkpoint"):
            what = f"resumes training '{BOOTSTRAP_MODEL}' from {record['latest_checkpoint']}"
        log(f"{job} {record['id']} ({record['state']}) {what}; GET /jobs/{record['id']} shows its progress")
    return record


def mlm_import(settings: Settings, log: Callable[[str], None] = print) -> tuple[bool, JobRecord | None]:
    """The BERT_MLM_MODEL import: (True, its unfinished job or None when the model is there) once it is
    chosen; (False, None) when it is disabled, or the Hub did not answer (the bootstrap job serves instead)."""
    repo = settings.mlm_model.strip()
    if not repo:
        return False, None
    name, data_dir = hub_model_name(repo), settings.data_dir
    imports = Imports(data_dir)
    record = imports.unfinished(name)
    if record is None and model_dir_for(data_dir, name) is None:
        reason = hub_unreachable(repo)
        if reason is not None:
            log(f"not importing {repo} for /fill-mask and /nsp ({reason}); the next start tries again")
            return False, None
        record = imports.submit(name, {"kind": "hub", "repo": repo, "revision": None}, start=False)
    set_default(data_dir, "mlm", name)
    return True, record


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def prepare(data_dir: Path, log: Callable[[str], None] = print) -> None:
    """The MiniLM encoder (with its card) and the Wikipedia corpus in DATA_DIR, once."""
    encoder, found = DataDir(data_dir).model(ENCODER), model_dir_for(data_dir, ENCODER)
    if found is None:
        log(f"importing all-MiniLM-L6-v2 as model '{ENCODER}' ...")
    if found in (None, encoder):  # absent, or the bundled one (an earlier start's import may lack its card)
        # a flat directory (one version, 1), so data/models/minilm is a model directory the CLI takes
        ensure_minilm(encoder)
    if read_meta(data_dir, CORPUS) is None:
        log(f"registering the Wikipedia demo corpus as dataset '{CORPUS}' ...")
        with tempfile.TemporaryDirectory(dir=data_dir, prefix=TMP_PREFIX) as staging:
            text = Path(staging) / "wiki.txt"
            prepare_wiki(text)
            add_local_dataset(data_dir, text, CORPUS, "corpus")


def bootstrap_job(settings: Settings, steps: int | None = None) -> JobRecord | None:
    """Queue the bootstrap job unless its model exists; one that was cancelled or failed is queued again
    (it resumes from its latest checkpoint), one that is queued or running is left to the workers. The
    record, or None."""
    data_dir = settings.data_dir
    if model_dir_for(data_dir, BOOTSTRAP_MODEL) is not None:
        return None
    jobs = JobService(settings, data_dir, ModelRegistry(data_dir, ENCODER, torch.device("cpu")))
    record = next((r for r in jobs.records.list() if r.get("model_name") == BOOTSTRAP_MODEL), None)  # newest first
    if record is not None and record["state"] in ("cancelled", "failed"):
        return jobs.restart(record["id"])
    if record is not None:
        return record  # queued/running: the worker's recovery sweep picks it up
    request = PretrainJobRequest(
        kind="pretrain",
        model_name=BOOTSTRAP_MODEL,
        base_model=ENCODER,
        dataset=CORPUS,
        params=PretrainParams(**bootstrap_params(steps)),
        priority=BOOTSTRAP_PRIORITY,
    )
    return asyncio.run(jobs.submit(request))


def bootstrap_params(steps: int | None) -> dict:
    """BOOTSTRAP_PARAMS, shortened to `steps` (tests use a few; warmup and checkpoints scale with it)."""
    if not steps:
        return dict(BOOTSTRAP_PARAMS)
    return {
        **BOOTSTRAP_PARAMS,
        "max_steps": steps,
        "warmup_steps": min(BOOTSTRAP_PARAMS["warmup_steps"], steps // 10),
        "save_every": min(BOOTSTRAP_PARAMS["save_every"], steps),
    }
