"""bench/gpu_prepare.py: what the one GPU call carries and installs, and its CPU dry run (prepare with PyPI, install
with no network into a fresh venv beside a stand-in of the GPU image, every check at a tiny size)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tomllib

import pytest

from bench import gpu_prepare

ROOT = gpu_prepare.ROOT


def test_the_install_asks_for_pyprojects_dependencies_but_torch_and_what_no_check_imports():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {gpu_prepare.norm(d.split(">")[0].split("[")[0]) for d in gpu_prepare.requirements()}
    assert names == {gpu_prepare.norm(d.split(">")[0].split("[")[0]) for d in declared} - gpu_prepare.NOT_INSTALLED
    assert "torch" not in names and "uvicorn" in names


def test_assets_land_where_find_asset_looks_with_the_leads_unpacked(tmp_path):
    assets, purelib = tmp_path / "assets", tmp_path / "site"
    (assets / "pkg" / "data").mkdir(parents=True)
    (assets / "pkg" / "data" / "vocab.txt").write_text("[PAD]\n")
    with gzip.open(assets / "pkg" / "data" / "leads.json.gz", "wt") as f:
        json.dump({"a": {"extract": "x"}}, f)
    gpu_prepare.put_assets(assets, purelib)
    assert (purelib / "pkg" / "data" / "vocab.txt").read_text() == "[PAD]\n"
    assert json.loads((purelib / "pkg" / "data" / "leads.json").read_text()) == {"a": {"extract": "x"}}


def pypi_reachable(tmp_path) -> bool:
    """Whether pip can download here (the prepare step's wheels come from the package index)."""
    probe = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(tmp_path)]
    return subprocess.run([*probe, "vine==5.1.0"], capture_output=True, timeout=120).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_one_call_runs_whole_on_the_cpu(tmp_path):
    """bench/gpu_check --dry-run: prepare, install with no network into a fresh venv, every check passes on the
    CPU. Skipped only where pip cannot reach a package index (the prepare step downloads the wheels)."""
    if not pypi_reachable(tmp_path / "probe"):
        pytest.skip("no package index reachable: the prepare step downloads the wheels the GPU machine installs")
    out = tmp_path / "out"
    run = subprocess.run(
        [str(ROOT / "bench" / "gpu_check"), "--dry-run"],
        env={**gpu_prepare.os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=2300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["done"] and record["tiny"]
    checks = {r["check"].split()[0] for r in record["rows"]}
    assert {"parity", "inference", "training", "service", "pretraining", "head_dim"} <= checks
    assert {r["verdict"] for r in record["rows"]} <= {"PASS", "info", "n/a"}
    assert (out / "server.log").stat().st_size > 0
