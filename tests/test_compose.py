"""The Docker image and the compose stack, for real: built, started on a fresh project and volume, used
as docs/deploying.md says, and torn down. `make compose-test` runs this file.

Needs a Docker engine with compose and the base images (python:3.11-slim, redis:7-alpine); on a
machine without a registry, `../shared/docker-offline/prepare` makes them and serves the torch wheel,
whose index reaches the build through TORCH_INDEX (the Makefile reads it from docker-offline's
build-args). Without them every test here is skipped, with the reason.
"""

from __future__ import annotations

import base64
import concurrent.futures
import csv
import datetime as dt
import io
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, labelled_csv, wait_for

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "bertserve:compose-test"
BASE_IMAGES = ("python:3.11-slim", "redis:7-alpine", "haproxy:2.6")


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


STATS_PASSWORD = secrets.token_hex(8)  # the balancer's statistics page (user `stats`)


class Stack:
    """One compose project (its own name, network and volumes) with its own env file."""

    def __init__(self, tmp: Path, override: str | None = None, **env: str):
        self.project = f"bstest{secrets.token_hex(3)}"
        self.files = ["-f", str(ROOT / "docker-compose.yml")]
        if override is not None:  # a compose file merged over ours (what the test changes, in YAML)
            (tmp / f"{self.project}.override.yml").write_text(override)
            self.files += ["-f", str(tmp / f"{self.project}.override.yml")]
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
            "HAPROXY_STATS_PASSWORD": STATS_PASSWORD,
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
        argv = ["docker", "compose", *self.files, "-p", self.project, "--env-file", str(self.env_file), *args]
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}\n{self.logs()}"
            )
        return result

    def container(self, service: str) -> str:
        (cid,) = self.containers(service) or [""]
        return cid

    def containers(self, service: str) -> list[str]:
        """The ids of a service's containers (one per replica)."""
        return self.compose("ps", "-q", service).stdout.split()

    def state(self, service: str) -> dict:
        return self.container_state(self.container(service))

    def container_state(self, cid: str) -> dict:
        if not cid:
            return {}
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State}}", cid], capture_output=True, text=True, timeout=30
        )
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def health(self, service: str) -> str | None:
        """The health of a service: "healthy" when every one of its containers is."""
        states = {(self.container_state(cid).get("Health") or {}).get("Status") for cid in self.containers(service)}
        return states.pop() if len(states) == 1 else None

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
                *self.files,
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


def _bootstrap_served_then_reviews(client: httpx.Client, admin: dict) -> None:
    """Wait until the bootstrap job's model answers /fill-mask, then upload the `reviews` dataset."""
    wait_for(
        lambda: client.post("/fill-mask", json={"inputs": "paris is the [MASK] of france ."}).status_code == 200,
        300,
        "the bootstrap model to be served",
        interval=2,
    )
    r = client.post(
        "/datasets", headers=admin, files={"file": ("reviews.csv", labelled_csv(80))}, data={"name": "reviews"}
    )
    assert r.status_code == 201, r.text


def _reviews_finetune(**params) -> dict:
    """A small fine-tune of minilm on `reviews` as the job `reviews-clf`, with `params` added."""
    return {
        "kind": "finetune",
        "model_name": "reviews-clf",
        "base_model": "minilm",
        "dataset": "reviews",
        "params": {"batch_size": 8, "max_seq_len": 32, "log_every": 1, "lr": 5e-5, **params},
    }


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
        ready = client.get("/ready").json()
        making = ready["mlm_job"]  # the bootstrap job, until wiki-mlm is there to answer /fill-mask
        assert ready == {
            "status": "ready",
            "model": "minilm",
            "mlm_model": None if making else "wiki-mlm",
            "mlm_job": making,
        }
        assert making is None or making["model_name"] == "wiki-mlm"
        r = client.post("/embeddings", json={"inputs": ["a fresh stack serves at once"]})
        assert r.status_code == 200 and len(r.json()[0]) == 384
        assert client.get("/console").status_code == 200, "the console's files are in the installed package"

        # The bootstrap job: /fill-mask names it while it trains, and answers once it has published.
        (job,) = [j for j in client.get("/jobs", headers=admin).json()["jobs"] if j["model_name"] == "wiki-mlm"]
        r = client.post("/fill-mask", json={"inputs": "paris is the [MASK] of france ."})
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["job"]["id"] == job["id"]
        _bootstrap_served_then_reviews(client, admin)

        # A fine-tune job on the worker container, restarted mid-job: it resumes from its checkpoint.
        r = client.post("/jobs", headers=admin, json=_reviews_finetune(max_steps=40, save_every=4))
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


# -- replicas behind the balancer ------------------------------------------------------------------

LOAD_SECONDS, CLIENTS, KILL_AT, STOP_AT = 60, 32, 20, 40
STEPS = 20  # the fine-tune job's, which finishes during the load
# The worker as on a machine of its own: on this test's 2 cores, the load on three api replicas would
# starve the training job (cgroup CPU shares: the worker first, the replicas with what is left).
WORKER_FIRST = "services:\n  worker:\n    cpu_shares: 8192\n"


def _requests(admin: dict) -> list[tuple[str, str, dict | None, dict]]:
    """The mixed load: (method, path, json, headers), inference and reads, taken in turn."""
    texts = ["a fresh stack serves at once", "the cat sat on the mat", "replicas agree", "paris is a city"]
    return [
        ("POST", "/embeddings", {"inputs": texts[:2]}, {}),
        ("POST", "/v1/embeddings", {"input": texts[2], "model": "minilm"}, {}),
        ("POST", "/fill-mask", {"inputs": "paris is the [MASK] of france ."}, {}),
        ("POST", "/nsp", {"inputs": [{"text_a": texts[1], "text_b": texts[3]}]}, {}),
        ("POST", "/embed", {"inputs": texts[3]}, {}),
        ("GET", "/models", None, {}),
        ("GET", "/jobs", None, admin),
    ]


class Load:
    """CLIENTS threads, each with its own keep-alive connection to the balancer, sending the mixed
    requests for `seconds`; every request's start, end and outcome kept."""

    def __init__(self, url: str, admin: dict, seconds: float):
        self.url, self.admin, self.seconds = url, admin, seconds
        self.results: list[tuple[float, float, str, str]] = []  # (start, end, path, "ok" or why not)
        self.lock = threading.Lock()

    def run(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(self.client, range(CLIENTS)))

    def client(self, n: int) -> None:
        requests = _requests(self.admin)
        end = time.time() + self.seconds
        with httpx.Client(base_url=self.url, timeout=120) as client:
            i = n
            while time.time() < end:
                method, path, body, headers = requests[i % len(requests)]
                i += 1
                start = time.time()
                try:
                    r = client.request(method, path, json=body, headers=headers)
                    outcome = "ok" if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    outcome = f"{type(e).__name__}: {e}"
                with self.lock:
                    self.results.append((start, time.time(), path, outcome))


class Events:
    """A client of GET /jobs/{id}/events through the balancer that reconnects (Last-Event-ID) when its
    stream breaks (its replica killed or stopping), until the `end` event."""

    def __init__(self, url: str, admin: dict, job_id: str):
        self.url, self.admin, self.job_id = url, admin, job_id
        self.steps: set[int] = set()
        self.end: dict | None = None
        self.connections = 0
        self.last_id: str | None = None

    def run(self) -> None:
        deadline = time.time() + 600
        while self.end is None and time.time() < deadline:
            headers = {**self.admin, **({"Last-Event-ID": self.last_id} if self.last_id else {})}
            self.connections += 1
            try:
                with httpx.stream("GET", f"{self.url}/jobs/{self.job_id}/events", headers=headers, timeout=60) as r:
                    if r.status_code != 200:
                        time.sleep(1)
                        continue
                    event, data, event_id = None, None, None
                    for line in r.iter_lines():
                        if line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: "):
                            data = json.loads(line[6:])
                        elif line.startswith("id: "):
                            event_id = line[4:]
                        elif line == "" and event is not None:
                            if event == "metrics" and data.get("type") == "train":
                                self.steps.add(data["step"])
                            if event_id is not None:
                                self.last_id = event_id
                            if event == "end":
                                self.end = data
                                return
                            event, data, event_id = None, None, None
            except httpx.HTTPError:
                time.sleep(0.5)


def _in_flight(stack: Stack, via: str, victim: str) -> int:
    """HAProxy's count of the requests the victim replica holds now (its stats, read from a replica)."""
    address = json.loads(
        subprocess.run(
            ["docker", "inspect", "--format", "{{json .NetworkSettings.Networks}}", victim],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    )
    ips = {n["IPAddress"] for n in address.values()}
    login = base64.b64encode(f"stats:{STATS_PASSWORD}".encode()).decode()  # the page wants its login
    read = (
        "import urllib.request; "
        f"r = urllib.request.Request('http://lb:8404/stats;csv', headers={{'Authorization': 'Basic {login}'}}); "
        "print(urllib.request.urlopen(r, timeout=5).read().decode())"
    )
    csv_text = subprocess.run(
        ["docker", "exec", via, "python", "-c", read], capture_output=True, text=True, timeout=30
    ).stdout
    rows = list(csv.DictReader(io.StringIO(csv_text.lstrip("# "))))
    row = next(r for r in rows if r["pxname"] == "api" and r.get("addr", "").split(":")[0] in ips)
    return int(row["scur"])


def _serving_poller(cid: str, model: str) -> subprocess.Popen:
    """In one replica's container: ask it (not the balancer) for `model` until it serves it, then print
    the wall-clock time (the containers share the host's clock)."""
    code = (
        "import json, time, urllib.request\n"
        f"body = json.dumps({{'inputs': ['a great film'], 'model': {model!r}}}).encode()\n"
        "while True:\n"
        "    try:\n"
        "        req = urllib.request.Request('http://127.0.0.1:8000/classify', body, {'Content-Type': 'application/json'})\n"
        "        urllib.request.urlopen(req, timeout=30)\n"
        "        print(time.time(), flush=True)\n"
        "        break\n"
        "    except OSError:\n"  # a 404 (not there yet), or the replica stopping
        "        time.sleep(0.2)\n"
    )
    return subprocess.Popen(["docker", "exec", cid, "python", "-c", code], stdout=subprocess.PIPE, text=True)


def test_three_replicas_behind_the_balancer_agree_and_survive_a_kill_and_a_stop(built, tmp_path):
    stack = Stack(tmp_path, override=WORKER_FIRST, BERT_BOOTSTRAP_STEPS="6")
    try:
        stack.compose("up", "-d", "--scale", "api=3")
        took = stack.wait_healthy(("redis", "api", "worker"), timeout=600)
        replicas = stack.containers("api")
        assert len(replicas) == 3
        client = httpx.Client(base_url=stack.url, timeout=60)
        admin = {"Authorization": f"Bearer {stack.admin_key}"}
        wait_for(lambda: client.get("/ready").status_code == 200, 60, "the balancer to route to a replica")

        # Three replicas started at once on a fresh volume: one first start (init), one bootstrap job,
        # one minilm (one version).
        jobs = client.get("/jobs", headers=admin).json()["jobs"]
        assert [j["model_name"] for j in jobs] == ["wiki-mlm"], jobs
        assert [m["name"] for m in client.get("/models").json()["models"]].count("minilm") == 1
        assert [v["version"] for v in client.get("/models/minilm").json()["versions"]] == [1]
        _bootstrap_served_then_reviews(client, admin)

        load = Load(stack.url, admin, LOAD_SECONDS)
        started = time.time()
        loader = threading.Thread(target=load.run)
        loader.start()
        r = client.post("/jobs", headers=admin, json=_reviews_finetune(max_steps=STEPS))
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        events = Events(stack.url, admin, job_id)
        follower = threading.Thread(target=events.run)
        follower.start()
        pollers = {cid: _serving_poller(cid, "reviews-clf") for cid in replicas}

        victim, stopped, survivor = replicas
        time.sleep(max(0.0, started + KILL_AT - time.time()))
        held = _in_flight(stack, survivor, victim)
        subprocess.run(["docker", "kill", victim], check=True, capture_output=True, timeout=60)
        killed_at = time.time()
        time.sleep(max(0.0, started + STOP_AT - time.time()))
        stopper = threading.Thread(
            target=subprocess.run, args=(["docker", "stop", "-t", "40", stopped],), kwargs={"capture_output": True}
        )
        stopped_at = time.time()
        stopper.start()
        loader.join()
        stopper.join(120)
        follower.join(600)

        record = client.get(f"/jobs/{job_id}", headers=admin).json()
        assert record["state"] == "succeeded", record
        finished = dt.datetime.fromisoformat(record["finished_at"].replace("Z", "+00:00")).timestamp()
        # Every replica running when the job published its model served it within 5 s (asked directly).
        served = {}
        for cid, poller in pollers.items():
            if cid == victim or (cid == stopped and finished >= stopped_at):
                poller.kill()
                continue
            out, _ = poller.communicate(timeout=60)
            served[cid[:12]] = float(out.split()[-1]) - finished
        assert finished <= started + LOAD_SECONDS, "the fine-tune job did not finish during the load"
        assert len(served) >= 2 and all(s <= 5 for s in served.values()), (served, finished - started)
        assert client.post("/classify", json={"inputs": ["a great film"], "model": "reviews-clf"}).status_code == 200

        # The event stream, through the balancer and across replicas, to the end.
        assert events.end == {"state": "succeeded"}, (events.end, events.connections)
        assert events.steps == set(range(1, STEPS + 1)), events.steps

        failed = [r for r in load.results if r[3] != "ok"]
        unusual = [  # the balancer's log: requests that were retried or ended abnormally
            line
            for line in stack.compose("logs", "--no-color", "lb").stdout.splitlines()
            if '"' in line and (" ---- " not in line or "/+" in line)
        ]
        print("\n".join(unusual[:20]))
        around_kill = [r for r in failed if r[0] <= killed_at <= r[1] + 1]
        around_stop = [r for r in failed if r[1] >= stopped_at]
        print(
            f"stack healthy in {took:.0f} s; {len(load.results)} requests from {CLIENTS} clients in "
            f"{LOAD_SECONDS} s; SIGKILL at {KILL_AT} s with {held} in flight on that replica: "
            f"{len(around_kill)} failed; SIGTERM at {STOP_AT} s: {len(around_stop)} failed; "
            f"fine-tune finished {finished - started:.0f} s into the load, served by every replica "
            f"{max(served.values()):.1f} s after ({len(served)} replicas); event stream: "
            f"{events.connections} connection(s); failed: {[(r[2], r[3][:80]) for r in failed]}"
        )
        assert len(failed) <= held and failed == around_kill, failed[:10]
        assert not around_stop, around_stop[:10]
    finally:
        stack.down()
