"""deploy/monitoring/: the Prometheus alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`), the Grafana dashboard's queries parse as PromQL, and every metric the rules and the
dashboard name is one a live server's /metrics has. promtool tests skip where promtool is not installed
(Debian's `prometheus` package has it; .ci/run installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import make_data_dir, start_server

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt install prometheus)"
)
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$instance": ".*"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def rule_queries() -> list[str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_the_alert_rules_are_valid_and_pass_their_unit_tests():
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = promtool("test", "rules", "alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


@needs_promtool
def test_every_dashboard_query_is_promql(tmp_path):
    """promtool parses each query as a recording rule's expression (Grafana's variables given values)."""
    queries = dashboard_queries()
    for name, value in GRAFANA_VARIABLES.items():
        queries = [q.replace(name, value) for q in queries]
    rules = {
        "groups": [{"name": "dashboard", "rules": [{"record": f"q{i}", "expr": q} for i, q in enumerate(queries)]}]
    }
    (tmp_path / "dashboard-rules.yml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", "dashboard-rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_metric_the_rules_and_dashboard_use_is_served(tmp_path):
    data_dir = make_data_dir(tmp_path / "data")
    server, url = start_server(data_dir, "redis://127.0.0.1:1/0", tmp_path, BERT_METRICS_PUBLIC="true")
    try:
        assert httpx.post(f"{url}/embeddings", json={"inputs": "good day"}, timeout=60).status_code == 200
        exposition = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        server.stop()
    families = set(re.findall(r"^# TYPE (\w+) ", exposition, re.M))
    samples = set(re.findall(r"^(\w+)[{ ]", exposition, re.M))
    used = {name for q in dashboard_queries() + rule_queries() for name in re.findall(r"\bbert_\w+", q)}
    assert len(used) >= 15
    missing = sorted(
        name for name in used if name not in samples and re.sub(r"_(bucket|sum|count)$", "", name) not in families
    )
    assert missing == []
    assert "bert_ready 1.0" in exposition  # the replica was ready when it was scraped
