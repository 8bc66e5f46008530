"""Real parts for the job tests: a data directory with a tiny base model, small datasets, a real
`celery worker` subprocess, a real uvicorn server, a private redis-server, and polling helpers.

Redis: the suite's own redis-server, started on a free port the first time a test module imports
REDIS_URL and stopped when the suite ends (or dies), so a test never touches data it did not create;
BERT_TEST_REDIS_URL names another server instead (its database is flushed per test). A test that
kills its broker starts one more (`RedisServer`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from model.config import BertConfig
from model.modeling import BertForPreTraining
from model.tokenizer import BertTokenizer
from model.training.callbacks import Callback
from tests.conftest import TINY_VOCAB

ROOT = Path(__file__).resolve().parents[1]
BASE_MODEL = "tiny"

VOCAB = TINY_VOCAB  # the tiny test vocabulary (tests/conftest.py)
POSITIVE = ["the movie was great", "i love this film", "a good film", "great movie ! love it", "good day"]
NEGATIVE = ["the movie was awful", "i hate this film", "a bad film", "awful movie ! hate it", "bad night"]


def tiny_config(**overrides) -> BertConfig:
    values = dict(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    return BertConfig(**{**values, **overrides})


def make_data_dir(root: Path) -> Path:
    """DATA_DIR with DATA_DIR/models/tiny: a random tiny BertForPreTraining and its vocabulary."""
    torch.manual_seed(0)
    BertForPreTraining(tiny_config()).save_pretrained(
        root / "models" / BASE_MODEL, tokenizer=BertTokenizer.from_vocab(VOCAB)
    )
    return root


def labelled_csv(rows: int = 40) -> bytes:
    lines = ["text,label"]
    for i in range(rows):
        lines.append(f"{POSITIVE[i % 5]},positive" if i % 2 else f"{NEGATIVE[i % 5]},negative")
    return ("\n".join(lines) + "\n").encode()


def corpus_txt(documents: int = 30) -> bytes:
    """Google format: a sentence per line, a blank line between documents."""
    sentences = [
        "the cat sat on the mat .",
        "the dog ran fast in the city .",
        "a man eats bread .",
        "she reads a book at night .",
        "they love the blue river .",
        "the sky is blue .",
    ]
    docs = ["\n".join(sentences[(d + k) % 6] for k in range(4)) for d in range(documents)]
    return ("\n\n".join(docs) + "\n").encode()


# Token classification: who (PER) does what with which thing (THING) where (LOC).
TAGGED = [
    (["the", "man", "eats", "bread", "in", "the", "city"], ["O", "B-PER", "O", "B-THING", "O", "O", "B-LOC"]),
    (["she", "reads", "a", "book", "at", "the", "river"], ["B-PER", "O", "O", "B-THING", "O", "O", "B-LOC"]),
    (
        ["the", "woman", "sat", "on", "the", "big", "red", "car"],
        ["O", "B-PER", "O", "O", "O", "B-THING", "I-THING", "I-THING"],
    ),
    (["he", "ran", "to", "the", "mountain"], ["B-PER", "O", "O", "O", "B-LOC"]),
]
QA_CONTEXTS = ["the man eats bread in the city . the dog sat on the mat", "she reads a book at the river at night"]
QA_QUESTIONS = [
    ("what does the man eat ?", 0, "bread"),
    ("where does he eat ?", 0, "the city"),
    ("what sat on the mat ?", 0, "the dog"),
    ("what does she read ?", 1, "a book"),
    ("where does she read ?", 1, "the river"),
    ("when does she read ?", 1, "night"),
]


def tagged_conll(repeat: int = 5) -> bytes:
    """CoNLL columns (token and tag), a blank line after each sentence."""
    return "".join("".join(f"{t} {g}\n" for t, g in zip(*sentence)) + "\n" for sentence in TAGGED * repeat).encode()


def squad_json(impossible: bool = False) -> bytes:
    """SQuAD v1.1 (or v2.0 with one impossible question per context)."""
    paragraphs = []
    for k, context in enumerate(QA_CONTEXTS):
        qas = [
            {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
            for i, (q, c, a) in enumerate(QA_QUESTIONS)
            if c == k
        ]
        if impossible:
            qas.append({"id": f"x{k}", "question": "what is blue ?", "answers": [], "is_impossible": True})
        paragraphs.append({"context": context, "qas": qas})
    return json.dumps(
        {"version": "v2.0" if impossible else "v1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}
    ).encode()


def finetune_request(model_name: str, dataset: str = "reviews", **params) -> dict:
    values = dict(max_steps=30, batch_size=8, max_seq_len=32, save_every=10, log_every=1, lr=1e-3)
    return {
        "kind": "finetune",
        "model_name": model_name,
        "base_model": BASE_MODEL,
        "dataset": dataset,
        "params": {**values, **params},
    }


def pretrain_request(model_name: str, dataset: str = "wiki", **params) -> dict:
    values = dict(max_steps=30, batch_size=8, max_seq_len=32, save_every=10, log_every=1, lr=1e-3)
    return {
        "kind": "pretrain",
        "model_name": model_name,
        "base_model": BASE_MODEL,
        "dataset": dataset,
        "params": {**values, **params},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def __getattr__(name: str):
    # `from tests.helpers import REDIS_URL`: the suite's Redis, started on first use (PEP 562)
    if name == "REDIS_URL":
        return suite_redis_url()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def suite_redis_url() -> str:
    """BERT_TEST_REDIS_URL, else a redis-server of the suite's own (no persistence, a temp dir, a free port),
    stopped at exit; the variable is set to it, so a pytest run inside a test uses it too."""
    if url := os.environ.get("BERT_TEST_REDIS_URL"):
        return url
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bertserve-test-redis-")), persistent=False)
    server.start()
    atexit.register(server.remove)
    os.environ["BERT_TEST_REDIS_URL"] = server.url
    return server.url


def flush_redis(url: str | None = None) -> None:
    import redis

    redis.Redis.from_url(url or suite_redis_url()).flushdb()


def child_env(data_dir: Path, broker_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERT_")}
    env.update(
        BERT_DATA_DIR=str(data_dir),
        BERT_BROKER_URL=broker_url,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        BERT_WORKER_DEVICE="cpu",
        BERT_JOB_PROGRESS_INTERVAL_S="0.1",
        BERT_JOB_HEARTBEAT_S="1",
        BERT_DRAIN_SECONDS="0",  # no balancer in front: a server stops at SIGTERM at once
        BERT_PRECISION="fp32",  # answers are compared with fp32 references; auto may choose bf16 where measured
    )
    env.update(extra)
    return env


class Process:
    """A subprocess in its own process group (so SIGKILL takes its children too), logging to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115  (the process's output, closed when it stops)
        self.proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not in {self.log_path.name}:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole group: the worker's main process and its pool children, mid-anything."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:  # SIGTERM to the main process only: Celery's warm shutdown
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._log.close()


def start_worker(data_dir: Path, broker_url: str, name: str, log_dir: Path, **env: str) -> Process:
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "worker",
        "-Q",
        "training",
        "--concurrency",
        "1",
        "--without-gossip",
        "--without-mingle",
        "--hostname",
        f"{name}@%h",
        "--loglevel",
        "INFO",
    ]
    worker = Process(argv, child_env(data_dir, broker_url, **env), log_dir / f"{name}.log")
    worker.wait_for_log(" ready.")
    return worker


def start_server(data_dir: Path, broker_url: str, log_dir: Path, **env: str) -> tuple[Process, str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "app.main:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    server = Process(
        argv,
        child_env(data_dir, broker_url, BERT_DEFAULT_MODEL=BASE_MODEL, BERT_LOAD="lazy", BERT_DEVICE="cpu", **env),
        log_dir / "server.log",
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start:\n{server.log()[-3000:]}")
        time.sleep(0.1)


class RedisServer:
    """A private redis-server on loopback (AOF on, fsync always, unless not `persistent`) that a test may
    kill and restart; it dies with the process that started it."""

    def __init__(self, workdir: Path, persistent: bool = True):
        self.dir, self.port, self.persistent = workdir, free_port(), persistent
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError(
                "the tests need the redis-server binary (apt-get install redis-server), or "
                "BERT_TEST_REDIS_URL naming a Redis whose database they may flush"
            )
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        argv = [
            shutil.which("redis-server"),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            *persistence,
            "--save",
            "",
        ]
        if shutil.which("setpriv") and threading.current_thread() is threading.main_thread():
            argv = ["setpriv", "--pdeathsig", "KILL", *argv]  # gone with this process, even a killed one
        with open(self.dir / "redis.log", "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        import redis

        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(redis.ConnectionError):
                if redis.Redis(port=self.port).ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def job_stack(
    root: Path,
    name: str,
    datasets: list[tuple[str, str, bytes]],
    prepare=None,
    timeout: float = 60,
):
    """A data directory under `root` served by a real uvicorn server and a real `celery worker` (named `name`) on the
    suite's Redis, flushed before and after; `prepare(data_dir)` runs before they start (models to put in place),
    and `datasets` (name, file name, body) are uploaded through POST /datasets. Yields (client, data_dir)."""
    from types import SimpleNamespace

    flush_redis()
    data_dir = make_data_dir(root / "data")
    if prepare is not None:
        prepare(data_dir)
    server, url = start_server(data_dir, suite_redis_url(), root)
    worker = start_worker(data_dir, suite_redis_url(), name, root)
    client = httpx.Client(base_url=url, timeout=timeout)
    try:
        for dataset, filename, body in datasets:
            r = client.post("/datasets", files={"file": (filename, body)}, data={"name": dataset})
            assert r.status_code == 201, r.text
        yield SimpleNamespace(client=client, data_dir=data_dir)
    finally:
        client.close()
        worker.stop()
        server.stop()
        flush_redis()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def read_record(data_dir: Path, job_id: str) -> dict:
    return json.loads((data_dir / "jobs" / job_id / "job.json").read_text())


def read_metrics(data_dir: Path, job_id: str) -> list[dict]:
    path = data_dir / "jobs" / job_id / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_steps(data_dir: Path, job_id: str) -> list[int]:
    """The training steps a job's metrics.jsonl holds, in order (none before its first step)."""
    if not (data_dir / "jobs" / job_id / "metrics.jsonl").exists():
        return []
    return [r["step"] for r in read_metrics(data_dir, job_id) if r["type"] == "train"]


def wait_state(client: httpx.Client, job_id: str, states: set[str], timeout: float = 60.0) -> dict:
    def reached():
        body = client.get(f"/jobs/{job_id}").json()
        return body if body["state"] in states else None

    return wait_for(reached, timeout, f"job {job_id} to reach {states}", interval=0.1)


def write_dataset(data_dir: Path, name: str, body: bytes, filename: str) -> Path:
    """A dataset as POST /datasets leaves it (for tests that run the worker code without the app)."""
    root = data_dir / "datasets" / name
    root.mkdir(parents=True)
    ext = Path(filename).suffix
    (root / f"data{ext}").write_bytes(body)
    kind = "labelled" if ext in (".csv", ".tsv") else "corpus"
    meta = {"name": name, "kind": kind, "file": f"data{ext}", "format": "google" if ext == ".txt" else ext[1:]}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def finetune_spec(model_name: str, dataset: str = "reviews", **params) -> dict:
    """A job spec as POST /jobs stores it: the parameters set, and devices and max_runtime."""
    from app.schemas.jobs import FinetuneParams

    values = dict(max_steps=10, batch_size=8, max_seq_len=32, save_every=5, log_every=1, lr=1e-3)
    return {
        "kind": "finetune",
        "model_name": model_name,
        "base_model": BASE_MODEL,
        "dataset": dataset,
        "params": FinetuneParams(**{**values, **params}).to_record(),
    }


class LeaseHolder:
    """Another process holding a job's lease (as a worker training it elsewhere would)."""

    def __init__(self, data_dir: Path, job_id: str):
        # A bare flock on the lease file, as Lease takes it (no imports: starts in milliseconds).
        code = (
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('held', flush=True); time.sleep(600)"
        )
        lease = data_dir / "jobs" / job_id / ".lease"
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", code, str(lease)], stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == b"held"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class StopAt(Callback):
    """A trainer callback that asks the run to stop, as a warm shutdown
    does, once it has seen step `at`."""

    def __init__(self, at: int):
        self.step, self.at = 0, at

    def on_step(self, state):
        self.step = state["step"]

    def should_stop(self):
        return self.step >= self.at
