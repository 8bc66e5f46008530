"""The Docker image and the compose stack, for real: built, started on a fresh project and volume, used
as docs/deploying.md says, and torn down. `make compose-test` runs this file.

Needs a Docker engine with compose and the base images (python:3.11-slim, redis:7-alpine); on a
machine without a registry, `../shared/docker-offline/prepare` makes them and serves the torch wheel,
whose index reaches the build through TORCH_INDEX (the Makefile reads it from docker-offline's
build-args). Without them every test here is skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, labelled_csv, wait_for

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "bertserve:compose-test"
BASE_IMAGES = ("python:3.11-slim", "redis:7-alpine")


def _docker_missing() -> str | None:
    if shutil.which("docker") is None:
        return "no docker command on PATH"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "the Docker engine does not answer `docker info`"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        return "no `docker compose`"
    for image in BASE_IMAGES:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30).returncode != 0:
            return f"base image {image} is not present (no registry here: run ../shared/docker-offline/prepare)"
    return None


_MISSING = _docker_missing()
pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(_MISSING is not None, reason=f"needs Docker: {_MISSING}"),
]


class Stack:
    """One compose project (its own name, network and volumes) with its own env file."""

    def __init__(self, tmp: Path, **env: str):
        self.project = f"bstest{secrets.token_hex(3)}"
        self.port = free_port()
        self.admin_key = "admin-" + secrets.token_hex(12)
        values = {
            "REDIS_PASSWORD": secrets.token_hex(16),
            "BERT_ADMIN_KEY": self.admin_key,
            "BERT_API_KEY": "",
            "BERT_BIND": "127.0.0.1",
            "BERT_PORT": str(self.port),
            "BERT_IMAGE": IMAGE,
            "FLOWER_PASSWORD": "unused",
            "HF_HUB_OFFLINE": "1",  # never the real Hub: the first start runs the bootstrap job
            "TORCH_INDEX": os.environ.get("TORCH_INDEX", ""),
            **env,
        }
        if not values["TORCH_INDEX"]:
            del values["TORCH_INDEX"]  # the Dockerfile's default (download.pytorch.org's CPU index)
        self.env_file = tmp / f"{self.project}.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        self.url = f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file), *args]
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}\n{self.logs()}"
            )
        return result

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def state(self, service: str) -> dict:
        cid = self.container(service)
        if not cid:
            return {}
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State}}", cid], capture_output=True, text=True, timeout=30
        )
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def health(self, service: str) -> str | None:
        return (self.state(service).get("Health") or {}).get("Status")

    def wait_healthy(self, services: tuple[str, ...], timeout: float = 300) -> float:
        start = time.monotonic()
        try:
            wait_for(
                lambda: all(self.health(s) == "healthy" for s in services),
                timeout,
                f"{services} to be healthy",
                interval=1,
            )
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.compose('ps').stdout}\n{self.logs()}") from None
        return time.monotonic() - start

    def logs(self) -> str:
        result = subprocess.run(
            [
                "docker",
                "compose",
                "-p",
                self.project,
                "--env-file",
                str(self.env_file),
                "logs",
                "--no-color",
                "--tail",
                "40",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout[-6000:]

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", check=False, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> float:
    """The image, built once through the compose file (the `init` service carries `build:`)."""
    stack = Stack(tmp_path_factory.mktemp("build"))
    start = time.monotonic()
    stack.compose("build", "init", timeout=1800)
    return time.monotonic() - start


def test_a_fresh_stack_serves_at_once_trains_on_the_worker_and_resumes_after_a_restart(built, tmp_path):
    stack = Stack(tmp_path, BERT_BOOTSTRAP_STEPS="6")
    try:
        started = time.monotonic()
        stack.compose("up", "-d")
        took = stack.wait_healthy(("redis", "api", "worker"))
        print(
            f"image build {built:.0f} s; every container healthy {took:.0f} s after `up -d` returned "
            f"({time.monotonic() - started:.0f} s after it was run)"
        )
        init = stack.state("init")
        assert init.get("Status") == "exited" and init.get("ExitCode") == 0, stack.logs()

        client = httpx.Client(base_url=stack.url, timeout=60)
        admin = {"Authorization": f"Bearer {stack.admin_key}"}
        assert client.get("/ready").json() == {"status": "ready", "model": "minilm", "mlm_model": "wiki-mlm"}
        r = client.post("/embeddings", json={"inputs": ["a fresh stack serves at once"]})
        assert r.status_code == 200 and len(r.json()[0]) == 384
        assert client.get("/console").status_code == 200, "the console's files are in the installed package"

        # The bootstrap job: /fill-mask names it while it trains, and answers once it has published.
        (job,) = [j for j in client.get("/jobs", headers=admin).json()["jobs"] if j["model_name"] == "wiki-mlm"]
        r = client.post("/fill-mask", json={"inputs": "paris is the [MASK] of france ."})
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["job"]["id"] == job["id"]
        wait_for(
            lambda: client.post("/fill-mask", json={"inputs": "paris is the [MASK] of france ."}).status_code == 200,
            300,
            "the bootstrap model to be served",
            interval=2,
        )

        # A fine-tune job on the worker container, restarted mid-job: it resumes from its checkpoint.
        r = client.post(
            "/datasets", headers=admin, files={"file": ("reviews.csv", labelled_csv(80))}, data={"name": "reviews"}
        )
        assert r.status_code == 201, r.text
        body = {
            "kind": "finetune",
            "model_name": "reviews-clf",
            "base_model": "minilm",
            "dataset": "reviews",
            "params": {
                "max_steps": 40,
                "batch_size": 8,
                "max_seq_len": 32,
                "save_every": 4,
                "log_every": 1,
                "lr": 5e-5,
            },
        }
        r = client.post("/jobs", headers=admin, json=body)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        wait_for(
            lambda: (client.get(f"/jobs/{job_id}", headers=admin).json().get("step") or 0) >= 8,
            300,
            "the fine-tune job to pass step 8",
            interval=0.5,
        )
        stack.compose("restart", "worker")
        wait_for(
            lambda: client.get(f"/jobs/{job_id}", headers=admin).json()["state"] in ("succeeded", "failed"),
            600,
            "the fine-tune job to end",
            interval=1,
        )
        record = client.get(f"/jobs/{job_id}", headers=admin).json()
        assert record["state"] == "succeeded", record
        assert record["step"] == 40
        events = [e["event"] for e in record["events"]]
        assert "handed back" in " ".join(events) and "resumed" in events, events
        r = client.post("/classify", json={"inputs": ["a great film"], "model": "reviews-clf"})
        assert r.status_code == 200 and set(r.json()[0]["scores"]) == {"negative", "positive"}, r.text
        stack.wait_healthy(("worker",), timeout=120)
    finally:
        stack.down()


def test_published_beyond_loopback_the_stack_needs_a_key(built, tmp_path):
    open_stack = Stack(tmp_path, BERT_BIND="0.0.0.0", BERT_BOOTSTRAP="false")
    try:
        result = open_stack.compose("up", "-d", check=False)
        assert result.returncode != 0, "a public stack without a key must not start"
        init = open_stack.state("init")
        assert init.get("ExitCode") == 2, init
        assert "refusing to serve" in open_stack.compose("logs", "--no-color", "init").stdout
        assert open_stack.state("api").get("Status") != "running"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{open_stack.url}/health", timeout=2)
    finally:
        open_stack.down()

    key = secrets.token_hex(16)
    keyed = Stack(tmp_path, BERT_BIND="0.0.0.0", BERT_API_KEY=key, BERT_BOOTSTRAP="false")
    try:
        keyed.compose("up", "-d")
        keyed.wait_healthy(("api",))
        r = httpx.post(f"{keyed.url}/embeddings", json={"inputs": ["hi"]}, timeout=30)
        assert r.status_code == 401, r.text
        r = httpx.post(
            f"{keyed.url}/embeddings", json={"inputs": ["hi"]}, timeout=30, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 200, r.text
    finally:
        keyed.down()
