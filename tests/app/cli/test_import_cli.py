"""`bert import SOURCE --name NAME` as a user runs it: a subprocess whose huggingface_hub reads HF_ENDPOINT
(the fake Hub of tests/hub_server.py), HF_HOME and HF_HUB_OFFLINE at import, as it would anywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from datadir.cards import read_card
from tests import hub_server as H
from tests.helpers import ROOT, free_port
from tests.model.test_sources import MODEL_INSTEAD

pytestmark = pytest.mark.slow  # the bert command in subprocesses


def bert(env: dict, *args) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], capture_output=True, text=True, env=full)


def test_import_by_id_then_offline(hub, hub_env, tmp_path):
    data = tmp_path / "data"
    proc = bert(hub_env, "import", H.TINY_REPO, "--name", "tiny", "--revision", "v2", "--data-dir", data)
    assert proc.returncode == 0, proc.stderr
    version = data / "models" / "tiny"
    assert proc.stdout.startswith(f"imported {H.TINY_REPO} at v2 as model 'tiny' -> {data / 'models'}")
    assert "architecture: BertForPreTraining (2 layers, hidden 32, 4 heads" in proc.stdout
    expected = load_file(H.tiny_model_dir(tmp_path, 1) / "model.safetensors")
    got = load_file(next(version.rglob("model.safetensors")))
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert read_card(next(version.rglob("card.json")).parent)["source"]["sha"] == hub.repos[H.TINY_REPO].refs["v2"]

    offline = {**hub_env, "HF_HUB_OFFLINE": "1"}
    proc = bert(offline, "import", H.BIN_REPO, "--name", "bin", "--data-dir", data)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"bert import: error: HF_HUB_OFFLINE is set and {H.BIN_REPO} is not in the Hugging Face cache (HF_HOME); "
        f"{MODEL_INSTEAD}, or unset HF_HUB_OFFLINE to download it\n"
    )
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = bert({**hub_env, "HF_ENDPOINT": dead}, "import", H.BIN_REPO, "--name", "bin", "--data-dir", data)
    assert (proc.returncode, proc.stderr) == (
        2,
        f"bert import: error: cannot reach the Hub at {dead} for {H.BIN_REPO}: ConnectError: [Errno 111] Connection "
        f"refused; {MODEL_INSTEAD}, or set HF_ENDPOINT to a Hub mirror this machine can reach\n",
    )


def test_gated_repo_names_hf_token(hub, hub_env, tmp_path):
    proc = bert(hub_env, "import", H.GATED_REPO, "--name", "g", "--data-dir", tmp_path / "data")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"bert import: error: {H.GATED_REPO} is a gated repo: accept its terms on the Hub, "
        "then set HF_TOKEN to a token with access\n"
    )


def test_needs_a_name(tmp_path):
    proc = bert({}, "import", H.TINY_REPO)
    assert proc.returncode == 2
    assert proc.stderr == (
        "bert import: error: name the model: bert import SOURCE --name NAME (or give a destination directory: SRC DST)\n"
    )
