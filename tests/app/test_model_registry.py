"""the model registry: listing, models added or replaced while the service runs, broken directories."""

from __future__ import annotations

import shutil

import anyio
import pytest

from datadir.cards import read_card
from model.model_card import write_card
from model.modeling import BertForMaskedLM, BertForPreTraining, BertModel
from tests.app.conftest import MODELS, VOCAB, save_tiny, serve_app, settings_for, tiny_config

pytestmark = pytest.mark.anyio


async def test_models_listing(client, reference):
    with anyio.fail_after(10):  # BERT_LOAD=startup: the others load after the default, in the background
        while True:
            body = (await client.get("/models")).json()
            if all(m["loaded"] for m in body["models"]):
                break
            await anyio.sleep(0.02)
    assert body["default"] == "tiny-pt"
    listed = {m["name"]: m for m in body["models"]}
    assert list(listed) == sorted(MODELS)
    for name, cls in MODELS.items():
        m = listed[name]
        assert m["architecture"] == cls.__name__
        assert m["num_parameters"] == reference[name].num_parameters()
        assert m["default"] is (name == "tiny-pt") and m["loaded"] is True and m["error"] is None
    assert listed["tiny-pt"]["heads"] == ["mlm", "nsp"] and listed["tiny-enc"]["heads"] == []
    assert listed["tiny-cls"]["labels"] == ["negative", "positive"]
    detail = (await client.get("/models/tiny-cls")).json()
    versions = detail.pop("versions")
    assert detail == listed["tiny-cls"]  # a flat directory: one version, 1, promoted
    assert (listed["tiny-cls"]["version"], listed["tiny-cls"]["num_versions"]) == (1, 1)
    assert [(v["version"], v["promoted"], v["made_by"], v["card"]) for v in versions] == [(1, True, None, {})]
    assert versions[0]["disk_bytes"] == listed["tiny-cls"]["disk_bytes"] > 0


async def test_models_added_and_replaced_while_running(tmp_path):
    save_tiny(tmp_path / "models" / "first", BertModel)
    async with serve_app(settings_for(tmp_path, default_model="first")) as c:
        # Temp and hidden directories (what an atomic save writes first) are never models.
        for junk in (".tmp-new-1234", "tmp-upload", ".hidden"):
            save_tiny(tmp_path / "models" / junk, BertModel)
        assert [m["name"] for m in (await c.get("/models")).json()["models"]] == ["first"]

        save_tiny(tmp_path / "models" / "second", BertForMaskedLM, seed=1)
        r = await c.post("/fill-mask", json={"inputs": "the [MASK]", "model": "second"})  # unknown -> rescan
        assert r.status_code == 200
        before = r.json()
        assert [m["name"] for m in (await c.get("/models")).json()["models"]] == ["first", "second"]

        # Replaced (atomically, as save_pretrained does): the next request uses the new weights.
        save_tiny(tmp_path / "models" / "second", BertForPreTraining, seed=2)
        r = await c.post("/fill-mask", json={"inputs": "the [MASK]", "model": "second"})
        assert r.status_code == 200 and r.json() != before
        second = (await c.get("/models/second")).json()
        assert second["architecture"] == "BertForPreTraining" and second["heads"] == ["mlm", "nsp"]

        shutil.rmtree(tmp_path / "models" / "second")
        r = await c.post("/embeddings", json={"inputs": "the cat", "model": "second"})
        assert r.status_code == 404
        assert r.json() == {"error": "model 'second' not found (available: first)", "error_type": "not_found"}


async def test_broken_model_is_listed_with_its_reason(tmp_path):
    save_tiny(tmp_path / "models" / "good", BertModel)
    broken = tmp_path / "models" / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"hidden_size": 30, "num_attention_heads": 4}')
    async with serve_app(settings_for(tmp_path, default_model="good")) as c:
        listed = {m["name"]: m for m in (await c.get("/models")).json()["models"]}
        reason = "hidden_size (30) is not a multiple of num_attention_heads (4)"
        assert listed["broken"]["error"] == reason and listed["good"]["error"] is None
        r = await c.post("/embeddings", json={"inputs": "a", "model": "broken"})
        assert r.status_code == 503
        assert r.json() == {"error": f"model 'broken' cannot be served: {reason}", "error_type": "unavailable"}
        assert (await c.get("/ready")).status_code == 200

        # Weights without a tokenizer: described fine, fails to load, and says why from then on.
        BertModel(tiny_config()).save_pretrained(tmp_path / "models" / "no-vocab")
        for _ in range(2):
            r = await c.post("/embeddings", json={"inputs": "a", "model": "no-vocab"})
            assert r.status_code == 503
            assert r.json()["error"] == (
                "model 'no-vocab' cannot be served: loading failed: no tokenizer.json or vocab.txt in models/no-vocab"
            )  # relative to DATA_DIR
        listed = {m["name"]: m for m in (await c.get("/models")).json()["models"]}
        assert listed["no-vocab"]["error"] == "loading failed: no tokenizer.json or vocab.txt in models/no-vocab"


async def test_invalid_model_names_never_reach_the_filesystem(client):
    for name in ("..", ".hidden", "a/b", "x" * 65):
        r = await client.post("/embeddings", json={"inputs": "a", "model": name})
        assert r.status_code == 422, name
    r = await client.get("/models/.hidden")
    assert r.status_code == 422


async def test_a_tokenizer_larger_than_the_embeddings_is_refused_at_load(tmp_path):
    """An id past the embedding table is a device-side assert on CUDA that poisons every later batch:
    such a model is refused when it loads, with the reason, and remembered."""
    save_tiny(tmp_path / "models" / "good", BertModel)
    save_tiny(tmp_path / "models" / "short", BertModel, vocab_size=len(VOCAB) - 3)
    reason = (
        f"its tokenizer has {len(VOCAB)} tokens but the model's embeddings only {len(VOCAB) - 3} rows "
        "(config.json's vocab_size)"
    )
    async with serve_app(settings_for(tmp_path, default_model="good")) as c:
        for _ in range(2):
            r = await c.post("/embeddings", json={"inputs": "a", "model": "short"})
            assert (r.status_code, r.json()) == (
                503,
                {"error": f"model 'short' cannot be served: {reason}", "error_type": "unavailable"},
            )
        listed = {m["name"]: m for m in (await c.get("/models")).json()["models"]}
        assert listed["short"]["error"] == reason and listed["good"]["error"] is None


async def test_a_model_shows_its_card(tmp_path):
    save_tiny(tmp_path / "models" / "measured", BertForPreTraining)
    save_tiny(tmp_path / "models" / "plain", BertModel)
    card = write_card(tmp_path / "models" / "measured", source={"kind": "directory"})
    assert card["evaluation"]["sequences"] == 128 and card["evaluation"]["nsp_accuracy"] is not None
    async with serve_app(settings_for(tmp_path, default_model="plain")) as c:
        r = await c.get("/models/measured")
        assert r.status_code == 200 and r.json()["card"] == card == read_card(tmp_path / "models" / "measured")
        assert (await c.get("/models/plain")).json()["card"] is None
        listed = {m["name"]: m["card"] for m in (await c.get("/models")).json()["models"]}
        assert listed == {"measured": card, "plain": None}
