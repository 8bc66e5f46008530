"""The production files' structure. No Docker engine runs on these machines, so this reads the
Dockerfile and docker-compose.yml and checks what `docker compose up` relies on."""

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
    return [line[len(name):].strip() for line in lines if line.upper().startswith(name + " ")]


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
    mounts = {s: [v for v in compose["services"][s]["volumes"] if v.endswith(":" + data_dir)]
              for s in ("api", "worker")}
    assert len(mounts["api"]) == 1 and mounts["api"] == mounts["worker"]
    volume = mounts["api"][0].split(":")[0]
    assert volume in compose["volumes"], "a named volume, not a host path"


def test_api_and_worker_run_the_same_image_with_different_commands(compose):
    api, worker = compose["services"]["api"], compose["services"]["worker"]
    assert api["image"] == worker["image"]
    assert api["command"][:2] == ["bert", "serve"] and worker["command"][:2] == ["bert", "worker"]
    # Only the broker URL tells the embedded mode from compose: both name it the same way.
    assert "BERT_BROKER_URL" in env_of(api) and "BERT_BROKER_URL" in env_of(worker)


def test_redis_is_private_persistent_and_password_protected(compose):
    redis = compose["services"]["redis"]
    assert "ports" not in redis
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert re.search(r"--requirepass \$\{REDIS_PASSWORD:\?", command)
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_api_port_is_published_on_loopback_by_default(compose):
    api = compose["services"]["api"]
    (port,) = api["ports"]
    assert port.startswith("${BERT_BIND:-127.0.0.1}:")
    assert api["healthcheck"]["test"][0] == "CMD"


def test_secrets_come_from_env_with_required_markers(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${BERT_ADMIN_KEY:?" in text and "${REDIS_PASSWORD:?" in text
    example = (ROOT / ".env.example").read_text()
    for name in ("REDIS_PASSWORD", "BERT_ADMIN_KEY", "BERT_API_KEY"):
        assert re.search(rf"^{name}=", example, re.M), name


def test_dockerfile_is_multistage_non_root_exec_form_with_healthcheck(dockerfile):
    stages = instructions(dockerfile, "FROM")
    assert len(stages) >= 2 and any(" AS " in s.upper() for s in stages)
    users = instructions(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0")
    (cmd,) = instructions(dockerfile, "CMD")
    assert json.loads(cmd)[:2] == ["bert", "serve"], "exec form: a JSON array"
    (health,) = instructions(dockerfile, "HEALTHCHECK")
    assert "CMD [" in health
    args = " ".join(instructions(dockerfile, "ARG"))
    assert "TORCH_INDEX" in args and "whl/cpu" in args, "CPU torch by default, CUDA by build argument"
