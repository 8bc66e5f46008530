"""A ColBERT served (app/serving/colbert_pipeline.py) over real ASGI: POST /embed_multi's token vectors and
/rerank by MaxSim for both imported layouts, each equal to model/late_interaction.py's one-text-at-a-time
computation (which tests/model/test_late_interaction.py holds to transformers and to PyLate), and the errors
and bounds of the other inference routes.

Models: colbert (PyLate's layout), colbert-ir (colbert-ir's, imported), tiny-pt (the default: no ColBERT) and
tiny-rerank (a cross-encoder, BERT_RERANK_MODEL)."""

from __future__ import annotations

import pytest
import torch

from model.late_interaction import maxsim
from model.model_dir import import_model
from model.modeling import BertForPreTraining, BertForSequenceClassification
from tests import hub_server as H
from tests.app.conftest import save_tiny, serve_app, settings_for
from tests.hub_server import COLBERT_DIM, tiny_colbert_dir
from tests.model.test_late_interaction import DOCUMENTS, QUERIES, encode

pytestmark = pytest.mark.anyio
LAYOUTS = {"colbert": "pylate", "colbert-ir": "colbert-ir"}


def err(kind: str, message: str) -> dict:
    return {"error": message, "error_type": kind}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("colbert")
    for name, layout in LAYOUTS.items():
        import_model(tiny_colbert_dir(root / "sources", layout), root / "models" / name)
    save_tiny(root / "models" / "tiny-pt", BertForPreTraining)
    save_tiny(root / "models" / "tiny-rerank", BertForSequenceClassification, seed=7, id2label={0: "LABEL_0"})
    return root


@pytest.fixture(scope="module")
async def client(data_dir):
    async with serve_app(settings_for(data_dir, rerank_model="tiny-rerank")) as c:
        yield c


def close(got: list, expected: torch.Tensor) -> bool:
    """One input's vectors as answered, against the model's own to 1e-5."""
    return torch.allclose(torch.tensor(got), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", LAYOUTS)
async def test_embed_multi_queries_and_documents(client, data_dir, name):
    path = data_dir / "models" / name
    for texts, is_query in ((QUERIES, True), (DOCUMENTS, False)):
        r = await client.post("/embed_multi", json={"inputs": texts, "is_query": is_query, "model": name})
        assert r.status_code == 200, r.text
        body = r.json()
        expected = encode(path, texts, is_query)
        assert len(body) == len(texts)
        for got, want in zip(body, expected):
            assert len(got) == want.shape[0] and all(len(v) == COLBERT_DIM for v in got)
            assert close(got, want)
    one = (await client.post("/embed_multi", json={"inputs": "the cat", "is_query": True, "model": name})).json()
    assert len(one) == 1 and len(one[0]) == 8  # a list even for one input; a query is query_length vectors


@pytest.mark.parametrize("name", LAYOUTS)
async def test_rerank_by_maxsim(client, data_dir, name):
    path = data_dir / "models" / name
    query, documents = encode(path, QUERIES[:1], True)[0], encode(path, DOCUMENTS, False)
    expected = [maxsim(query, d).item() for d in documents]
    r = await client.post("/rerank", json={"query": QUERIES[0], "texts": DOCUMENTS, "model": name, "return_text": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [rank["index"] for rank in body] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for rank in body:
        assert list(rank) == ["index", "text", "score"]
        assert rank["text"] == DOCUMENTS[rank["index"]]
        assert rank["score"] == pytest.approx(expected[rank["index"]], abs=1e-5)


async def test_rerank_default_stays_the_cross_encoder(client):
    r = await client.post("/rerank", json={"query": "a cat", "texts": ["the cat", "a dog"]})
    assert r.status_code == 200 and all(0 <= rank["score"] <= 1 for rank in r.json())  # a sigmoid's


async def test_errors(client):
    r = await client.post("/embed_multi", json={"inputs": ["the cat"]})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "model 'tiny-pt' is not a late-interaction (ColBERT) model: /embed_multi needs one (a PyLate or "
        "colbert-ir checkpoint)",
    )
    r = await client.post("/embed_multi", json={"inputs": ["a"] * 65, "model": "colbert"})
    assert r.status_code == 422 and r.json() == err("validation", "at most 64 inputs per request, got 65")
    r = await client.post("/embed_multi", json={"inputs": [], "model": "colbert"})
    assert r.status_code == 422
    r = await client.post("/embeddings", json={"inputs": ["the cat"], "model": "colbert"})
    assert r.status_code in (400, 422) and "/embed_multi" in r.json()["error"]


async def test_the_request_token_bound_counts_the_query_expansion(data_dir):
    async with serve_app(settings_for(data_dir, max_request_tokens=20)) as client:
        r = await client.post("/embed_multi", json={"inputs": ["a", "b", "c"], "is_query": True, "model": "colbert"})
        assert r.status_code == 422
        assert r.json() == err(
            "validation",
            "the request is 24 tokens long (all inputs together), more than the 20 that BERT_MAX_REQUEST_TOKENS allows",
        )
        r = await client.post("/embed_multi", json={"inputs": ["a", "b", "c"], "model": "colbert"})
        assert r.status_code == 200  # documents: their own tokens, 4 each


@pytest.mark.parametrize("repo", [H.COLBERT_REPO, H.COLBERT_IR_REPO])
async def test_import_by_hub_id_then_serve(hub, hub_env, tmp_path, repo):
    """Either layout imported from the (fake) Hub by its id, stored as PyLate's, answers /embed_multi as the
    checkpoint computes."""
    settings = settings_for(tmp_path / "data", default_model=None, load="lazy")
    async with serve_app(settings, wait_ready=False) as client:
        job = (await client.post("/models", json={"name": "cb", "source": repo})).json()
        client.app.state.imports.wait(timeout=60)
        done = (await client.get(f"/jobs/{job['id']}")).json()
        assert done["state"] == "succeeded", done["error"]
        stored = tmp_path / "data" / "models" / "cb" / "v1"
        assert (stored / "1_Dense" / "model.safetensors").is_file()
        r = await client.post("/embed_multi", json={"inputs": QUERIES, "is_query": True, "model": "cb"})
        assert r.status_code == 200, r.text
        for got, want in zip(r.json(), encode(stored, QUERIES, True)):
            assert close(got, want)
