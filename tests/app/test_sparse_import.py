"""SPLADE models imported from the (fake) Hub: a sentence-transformers SparseEncoder's files make a sparse
encoder by themselves; a plain BertForMaskedLM (LayerNorm.gamma/beta names) needs "pooling": "splade" (the
API) or `--pooling splade` (`bert import`). Either serves /embed_sparse at once, as transformers' logits
pooled give on the imported weights."""

from __future__ import annotations

import io
import tarfile

import pytest

from app.cli import main
from tests import hub_server as H
from tests.app.conftest import serve_app, settings_for
from tests.app.test_sparse_api import assert_matches, reference

pytestmark = pytest.mark.anyio
TEXTS = ["the cat sat on the mat", "a dog ran", "paris is the capital of france"]


def settings(tmp_path):
    return settings_for(tmp_path / "data", default_model=None, load="lazy")


async def imported(client, body: dict) -> dict:
    job = await client.post("/models", json=body)
    assert job.status_code == 202, job.text
    client.app.state.imports.wait(timeout=60)
    return (await client.get(f"/jobs/{job.json()['id']}")).json()


async def test_sparse_encoders_import_from_the_hub_and_serve_embed_sparse(hub, hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        done = await imported(client, {"name": "splade", "source": H.SPLADE_REPO})
        assert done["state"] == "succeeded", done["error"]
        done = await imported(client, {"name": "splade-pp", "source": H.SPLADE_PLAIN_REPO, "pooling": "splade"})
        assert done["state"] == "succeeded", done["error"]
        assert done["params"] == {"source": H.SPLADE_PLAIN_REPO, "revision": None, "pooling": "splade"}
        answers = {}
        for name in ("splade", "splade-pp"):
            info = (await client.get(f"/models/{name}")).json()
            assert (info["architecture"], info["pooling"], info["normalize"]) == (
                "BertForMaskedLM",
                ["splade"],
                False,
            )
            r = await client.post("/embed_sparse", json={"inputs": TEXTS, "model": name})
            assert r.status_code == 200
            version = tmp_path / "data" / "models" / name / "v1"
            for answer, want in zip(r.json(), reference(version, TEXTS)):
                assert_matches(answer, want)
            answers[name] = r.json()
        assert answers["splade"] == answers["splade-pp"]  # the same weights, gamma/beta names or not


async def test_a_plain_masked_lm_checkpoint_is_not_sparse_unless_the_import_says_so(hub, hub_env, tmp_path):
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        done = await imported(client, {"name": "plain", "source": H.SPLADE_PLAIN_REPO})
        assert done["state"] == "succeeded", done["error"]
        assert (await client.get("/models/plain")).json()["pooling"] == ["mean"]
        r = await client.post("/embed_sparse", json={"inputs": "a", "model": "plain"})
        assert r.status_code == 422
        assert r.json() == {
            "error": 'model \'plain\' is not a SPLADE model (/embed pools its embeddings); send "pooling": "splade" '
            "to pool its masked-LM logits so anyway",
            "error_type": "validation",
        }
        r = await client.post("/models", json={"name": "x", "source": H.SPLADE_PLAIN_REPO, "pooling": "max"})
        assert r.status_code == 422
        assert r.json() == {"error": "pooling: Input should be 'splade'", "error_type": "validation"}


def test_bert_import_pooling_splade(hub, hub_env, tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["import", H.SPLADE_PLAIN_REPO, "--name", "pp", "--pooling", "splade", "--data-dir", str(data)]) == 0
    from model.sentence_modules import Splade, read_sentence_modules

    assert read_sentence_modules(data / "models" / "pp" / "v1").splade == Splade()
    with pytest.raises(SystemExit):
        main(["import", H.SPLADE_PLAIN_REPO, "--name", "pp", "--pooling", "mean", "--data-dir", str(data)])
    assert "argument --pooling: invalid choice: 'mean' (choose from 'splade')" in capsys.readouterr().err


def _tar_of_dir(path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(path, arcname="model")
    return buf.getvalue()


async def test_an_archive_says_pooling_splade_in_a_form_field(hub_env, tmp_path):
    _, plain = H.splade_dirs(tmp_path / "src")
    body = _tar_of_dir(plain)
    async with serve_app(settings(tmp_path), wait_ready=False) as client:
        r = await client.post("/models", files={"file": ("pp.tar.gz", body)}, data={"name": "pp", "pooling": "max"})
        assert r.status_code == 422
        assert r.json() == {
            "error": "pooling: 'max' is not one of splade (or leave it out)",
            "error_type": "validation",
        }
        r = await client.post("/models", files={"file": ("pp.tar.gz", body)}, data={"name": "pp", "pooling": "splade"})
        assert r.status_code == 202, r.text
        client.app.state.imports.wait(timeout=60)
        done = (await client.get(f"/jobs/{r.json()['id']}")).json()
        assert done["state"] == "succeeded", done["error"]
        assert done["params"] == {"source": "pp.tar.gz", "revision": None, "pooling": "splade"}
        assert (await client.get("/models/pp")).json()["pooling"] == ["splade"]
        r = await client.post("/embed_sparse", json={"inputs": TEXTS, "model": "pp"})
        for answer, want in zip(r.json(), reference(tmp_path / "data" / "models" / "pp" / "v1", TEXTS)):
            assert_matches(answer, want)
