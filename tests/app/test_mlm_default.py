"""BERT_MLM_MODEL at first start (app/launcher/bootstrap.py's mlm_import): imported from the (fake) Hub as
an import job when it answers, recorded in DATA_DIR/defaults.json for /fill-mask and /nsp; the bootstrap
job's turn otherwise; BERT_DEFAULT_MLM_MODEL still wins."""

from __future__ import annotations

import pytest

from app.launcher.bootstrap import mlm_import
from datadir import JobRecords
from datadir.defaults import read_defaults
from tests import hub_server as H
from tests.app.conftest import serve_app, settings_for
from tests.helpers import free_port


def settings(tmp_path, **overrides):
    values = dict(default_model=None, load="lazy", mlm_model=H.TINY_REPO)
    return settings_for(tmp_path / "data", **{**values, **overrides})


@pytest.mark.anyio
async def test_the_hub_model_is_imported_and_serves_fill_mask(hub, hub_env, tmp_path):
    said: list[str] = []
    imported, record = mlm_import(settings(tmp_path), said.append)
    assert imported and record is not None
    assert (record["kind"], record["model_name"], record["state"]) == ("import", "bert-tiny", "queued")
    assert read_defaults(tmp_path / "data") == {"mlm": "bert-tiny"}
    assert mlm_import(settings(tmp_path), said.append) == (True, record)  # once: the same job next time
    assert said == []
    async with serve_app(settings(tmp_path, default_model="bert-tiny", load="startup"), wait_ready=False) as client:
        client.app.state.imports.wait(timeout=60)  # the API ran the queued import at start
        assert (await client.get(f"/jobs/{record['id']}")).json()["state"] == "succeeded"
        r = await client.post("/fill-mask", json={"inputs": "the [MASK] sat"})
        assert r.status_code == 200, r.text
        ready = (await client.get("/ready")).json()
        assert ready == {"status": "ready", "model": "bert-tiny", "mlm_model": "bert-tiny", "mlm_job": None}
        assert client.app.state.service.mlm_model_words() == (
            "'bert-tiny' (chosen at first start: DATA_DIR/defaults.json)"
        )
    async with serve_app(settings(tmp_path, default_mlm_model="other"), wait_ready=False) as client:
        assert client.app.state.service.mlm_model_words() == "'other' (BERT_DEFAULT_MLM_MODEL)"


@pytest.mark.parametrize("case", ["offline", "unreachable", "disabled"])
def test_without_the_hub_the_bootstrap_job_serves(hub_env, tmp_path, monkeypatch, case):
    from huggingface_hub import constants

    overrides = {}
    if case == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    elif case == "unreachable":
        dead = f"http://127.0.0.1:{free_port()}"
        monkeypatch.setattr(constants, "ENDPOINT", dead)
    else:
        overrides["mlm_model"] = ""
    said: list[str] = []
    assert mlm_import(settings(tmp_path, **overrides), said.append) == (False, None)
    assert JobRecords(tmp_path / "data").list() == []
    assert read_defaults(tmp_path / "data") == {}
    expected = {
        "offline": [
            f"not importing {H.TINY_REPO} for /fill-mask and /nsp (HF_HUB_OFFLINE is set); the next start tries again"
        ],
        "unreachable": [f"not importing {H.TINY_REPO} for /fill-mask and /nsp (cannot reach the Hub at"],
        "disabled": [],
    }[case]
    assert [s[: len(e)] for s, e in zip(said, expected)] == expected and len(said) == len(expected)
