"""The Kubernetes manifests (deploy/kubernetes/). Read as files (fast, everywhere): the settings they
set are ones bertserve reads, the key guard refuses them without a key, the probes, grace periods and
commands are compose's. Rendered and checked (kustomize, the Kubernetes schemas, checkov) by
deploy/kubernetes/check.py with the tools `make test` installs into .tools-venv; a broken copy shows
that the check fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import AliasChoices

from app.launcher.server import exposure_refusal
from app.settings import Settings
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
TOOLS = ROOT / ".tools-venv" / "bin"
OTHER_VARIABLES = {"HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN", "OMP_NUM_THREADS", "REDIS_PASSWORD", "REDISCLI_AUTH"}
# `make test` installs the checkers first; in CI their absence is a failure, not a skip.
tools = pytest.mark.skipif(
    not (TOOLS / "checkov").exists() and not os.environ.get("CI"), reason="`make k8s-tools` installs the checkers"
)


def documents(name: str) -> dict[str, dict]:
    """The resources of a base file by kind/name (YAML anchors resolved)."""
    docs = yaml.safe_load_all((BASE / name).read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def pod(deployment: str) -> dict:
    return documents(f"{deployment}.yaml")[f"Deployment/bertserve-{deployment}"]["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def settings_variables() -> set[str]:
    """The environment variable of every service and worker setting (an alias's names for an alias)."""
    names = set()
    for model in (Settings, WorkerSettings):
        for name, field in model.model_fields.items():
            alias = field.validation_alias
            names |= set(alias.choices) if isinstance(alias, AliasChoices) else {f"BERT_{name.upper()}"}
    return names


def test_every_variable_the_manifests_set_is_read_by_bertserve():
    # pydantic-settings ignores an unknown BERT_* variable: a misspelt one would be lost without a word.
    names = set(env_file(BASE / "config.env")) | set(env_file(BASE / "keys.env.example"))
    for spec in (pod("api"), pod("worker")):
        names |= {e["name"] for c in containers(spec) for e in c.get("env", [])}
    unknown = names - settings_variables() - OTHER_VARIABLES
    assert not unknown, f"set in deploy/kubernetes but read by nothing: {sorted(unknown)}"


def test_the_key_guard_refuses_the_cluster_without_a_long_key(monkeypatch):
    for name in [n for n in os.environ if n.startswith("BERT_")]:
        monkeypatch.delenv(name)
    for name, value in env_file(BASE / "config.env").items():
        monkeypatch.setenv(name, value)
    host = "0.0.0.0"  # BERT_HOST in the image
    assert "BERT_API_KEY is not set" in exposure_refusal(Settings(), host)
    assert "shorter than 16" in exposure_refusal(Settings(api_key="short", admin_key="a" * 32), host)
    assert exposure_refusal(Settings(api_key="a" * 32, admin_key="b" * 32), host) is None
    assert "BERT_ALLOW_PUBLIC" not in "".join(p.read_text() for p in K8S.rglob("*.yaml"))


def test_the_api_is_probed_on_health_and_ready_and_drains_before_it_is_killed():
    spec = pod("api")
    (api,) = spec["containers"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert api["livenessProbe"]["httpGet"]["path"] == "/health"
    assert api["ports"] == [{"name": "http", "containerPort": Settings().port}]
    pre_stop = int(api["lifecycle"]["preStop"]["exec"]["command"][-1])
    settings = Settings()  # (config.env sets neither: the defaults apply)
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + settings.drain_seconds + settings.graceful_timeout


def test_the_worker_runs_and_is_checked_as_compose_runs_it(compose):
    spec = pod("worker")
    (worker,) = spec["containers"]
    assert worker["command"] == compose["worker"]["command"]
    assert worker["livenessProbe"]["exec"]["command"] == compose["worker"]["healthcheck"]["test"][1:]
    assert f"{spec['terminationGracePeriodSeconds']}s" == compose["worker"]["stop_grace_period"]


def test_every_pod_starts_after_bert_init_on_the_shared_volume_and_runs_locked_down():
    claims = {doc["metadata"]["name"] for doc in yaml.safe_load_all((BASE / "data-pvc.yaml").read_text())}
    for spec in (pod("api"), pod("worker")):
        assert [c["command"] for c in spec["initContainers"]] == [["bert", "init"]]
        data = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert data == ["bertserve-data"] and set(data) <= claims
        assert spec["securityContext"]["runAsNonRoot"] and spec["automountServiceAccountToken"] is False
        for container in containers(spec):
            assert {"mountPath": "/data", "name": "data"} in container["volumeMounts"]
            assert container["securityContext"]["readOnlyRootFilesystem"], container["name"]
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert env_file(BASE / "config.env")["BERT_DATA_DIR"] == "/data"


def https_rules(policy: dict) -> list[dict]:
    """The egress rules of a NetworkPolicy that let TCP 443 out (a rule without ports lets everything out)."""
    rules = policy["spec"].get("egress", [])
    return [r for r in rules if not r.get("ports") or any(p.get("port") == 443 for p in r["ports"])]


def test_no_pod_reaches_https_anywhere_unless_given_address_blocks():
    """A NetworkPolicy names addresses, not hosts: HTTPS goes out only to the blocks a user lists in
    components/https-egress, never anywhere, in the base or with the external-Redis component."""
    base = [d for d in yaml.safe_load_all((BASE / "network-policy.yaml").read_text()) if "egress" in d["spec"]]
    external = yaml.safe_load((K8S / "components" / "external-redis" / "egress.yaml").read_text())
    assert [https_rules(policy) for policy in [*base, external]] == [[]] * (len(base) + 1)
    (https,) = yaml.safe_load_all((K8S / "components" / "https-egress" / "egress-https.yaml").read_text())
    (rule,) = https_rules(https)
    assert rule["ports"] == [{"protocol": "TCP", "port": 443}]
    blocks = [to["ipBlock"]["cidr"] for to in rule["to"]]  # every destination an address block
    assert blocks and len(blocks) == len(rule["to"]) and not {"0.0.0.0/0", "::/0"} & set(blocks)
    component = yaml.safe_load((K8S / "components" / "https-egress" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and component["resources"] == ["egress-https.yaml"]


def test_the_keys_file_is_a_read_only_secret_of_the_api_and_not_on_the_workers_volume():
    """The API keys (BERT_KEYS_FILE) are not in DATA_DIR, which the workers write: a Secret mounted
    read-only into the api pods, and nowhere in the workers'."""
    spec = pod("api")
    (keys,) = [v for v in spec["volumes"] if "secret" in v]
    assert keys["secret"] == {"secretName": "bertserve-key-file", "optional": True, "defaultMode": 0o440}
    for container in containers(spec):
        (path,) = [e["value"] for e in container["env"] if e["name"] == "BERT_KEYS_FILE"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == keys["name"]]
        assert mount["readOnly"] is True and path == f"{mount['mountPath']}/keys.toml" and not path.startswith("/data")
    worker = pod("worker")
    assert not [v for v in worker["volumes"] if "secret" in v]
    assert not [e for c in containers(worker) for e in c.get("env", []) if e["name"] == "BERT_KEYS_FILE"]
    assert "BERT_KEYS_FILE" not in env_file(BASE / "config.env")  # (every container reads config.env)


def test_no_secret_value_is_committed():
    example = env_file(BASE / "keys.env.example")
    assert set(example) >= {"BERT_API_KEY", "BERT_ADMIN_KEY", "REDIS_PASSWORD"}
    assert all(value == "" for value in example.values()), "the example holds names only"
    assert "/deploy/kubernetes/base/keys.env" in (ROOT / ".gitignore").read_text().split()


# ---------------------------------------------------------------------------- rendered and checked


def check(folder: Path) -> subprocess.CompletedProcess:
    script = K8S / "check.py"
    return subprocess.run([str(TOOLS / "python"), str(script), str(folder)], capture_output=True, text=True)


def render(overlay: str) -> list[dict]:
    proc = subprocess.run([str(TOOLS / "kubectl"), "kustomize", str(overlay)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(proc.stdout))


@tools
@pytest.mark.slow
def test_the_manifests_render_validate_and_pass_checkov():
    proc = check(K8S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rendered 4 of 4 overlays" in proc.stdout and " 0 failed" in proc.stdout


@tools
@pytest.mark.slow
def test_a_broken_manifest_fails_the_check(tmp_path):
    broken = tmp_path / "kubernetes"
    shutil.copytree(K8S, broken, ignore=shutil.ignore_patterns("keys.env"))
    api = broken / "base" / "api.yaml"
    text = api.read_text()
    text = text.replace("terminationGracePeriodSeconds: 45", "terminationGracePeriod: 45")  # no such field
    text = text.replace("allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true")
    api.write_text(text)
    proc = check(broken)
    assert proc.returncode == 1
    assert "'terminationGracePeriod' was unexpected" in proc.stderr  # the schemas
    assert "checkov CKV_K8S_20 " in proc.stderr  # checkov: allowPrivilegeEscalation


@tools
def test_the_overlays_choose_the_images_and_the_external_redis_component_replaces_redis(tmp_path):
    work = tmp_path / "kubernetes"
    shutil.copytree(K8S, work, ignore=shutil.ignore_patterns("keys.env"))
    shutil.copy(work / "base" / "keys.env.example", work / "base" / "keys.env")
    images = {}
    for overlay in ("cpu", "gpu"):
        for doc in render(work / "overlays" / overlay):
            if doc["kind"] == "Deployment":
                for c in containers(doc["spec"]["template"]["spec"]):
                    images[overlay, doc["metadata"]["name"], c["name"]] = c["image"]
    assert {k: v for k, v in images.items() if k[0] == "cpu"} == {
        ("cpu", "bertserve-api", "init"): "bertserve:latest",
        ("cpu", "bertserve-api", "api"): "bertserve:latest",
        ("cpu", "bertserve-worker", "init"): "bertserve:latest",
        ("cpu", "bertserve-worker", "worker"): "bertserve:latest",
    }
    assert images["gpu", "bertserve-api", "api"] == "bertserve:latest"
    assert images["gpu", "bertserve-worker", "worker"] == images["gpu", "bertserve-worker", "init"] == "bertserve:cuda"

    external = work / "overlays" / "external"
    external.mkdir()
    (external / "kustomization.yaml").write_text("resources: [../cpu]\ncomponents: [../../components/external-redis]\n")
    docs = render(external)
    assert not [d for d in docs if "redis" in d["metadata"]["name"]], "the bundled Redis is left out"
    for doc in (d for d in docs if d["kind"] == "Deployment"):
        for c in containers(doc["spec"]["template"]["spec"]):
            (url,) = [e for e in c["env"] if e["name"] == "BERT_BROKER_URL"]
            assert url["valueFrom"]["secretKeyRef"]["key"] == "BERT_BROKER_URL" and "value" not in url
            keys_file = [e["name"] for e in c["env"]].count("BERT_KEYS_FILE")
            assert keys_file == (doc["metadata"]["name"] == "bertserve-api"), (doc["metadata"]["name"], c["name"])
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert not [name for name, policy in policies.items() if https_rules(policy)]  # no HTTPS out by default

    (work / "overlays" / "https").mkdir()
    (work / "overlays" / "https" / "kustomization.yaml").write_text(
        "resources: [../cpu]\ncomponents: [../../components/https-egress]\n"
    )
    policies = {d["metadata"]["name"]: d for d in render(work / "overlays" / "https") if d["kind"] == "NetworkPolicy"}
    assert [name for name, policy in policies.items() if https_rules(policy)] == ["bertserve-egress-https"]
    assert policies["bertserve-egress-https"]["metadata"]["namespace"] == "bertserve"
