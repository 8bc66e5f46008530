"""OpenAI's own client (the `openai` package) against a real uvicorn of this service: /v1/models lists our
models, /v1/embeddings embeds as /embeddings does, and every /v1/* failure reaches the client as OpenAI's
error shape, so it raises its own exception classes with our message."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from model.modeling import BertForPreTraining, BertModel
from tests.app.conftest import save_tiny
from tests.helpers import start_server

openai = pytest.importorskip("openai")
KEY = "openai-client-key-0123456789"
NO_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: no jobs in these tests


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, data_dir): uvicorn over `tiny` (an encoder) and `tiny-pt`, behind an API key."""
    root = tmp_path_factory.mktemp("openai-client")
    save_tiny(root / "models" / "tiny", BertModel, seed=1)
    save_tiny(root / "models" / "tiny-pt", BertForPreTraining, seed=2)
    server, url = start_server(root, NO_BROKER, root, BERT_API_KEY=KEY)
    try:
        yield url, root
    finally:
        server.stop()


def client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_models_list_and_retrieve(served):
    url, root = served
    models = client(url).models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [
        ("tiny", "model", "bertserve"),
        ("tiny-pt", "model", "bertserve"),
    ]
    assert models[0].created == int((root / "models" / "tiny").stat().st_mtime)
    assert client(url).models.retrieve("tiny-pt").id == "tiny-pt"
    with pytest.raises(openai.NotFoundError) as e:
        client(url).models.retrieve("nope")
    assert e.value.body == {
        "message": "model 'nope' not found (available: tiny, tiny-pt)",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }


def test_embeddings_equal_ours_and_errors_are_openais(served):
    url, _ = served
    texts = ["the cat sat on the mat", "a dog"]
    ours = httpx.post(
        f"{url}/embeddings",
        json={"inputs": texts, "model": "tiny", "normalize": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    floats = client(url).embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert floats.model == "tiny" and np.array([d.embedding for d in floats.data]) == pytest.approx(np.array(ours))
    packed = client(url).embeddings.create(model="tiny", input=texts)  # the client's default: base64, decoded by it
    assert np.array_equal(np.array([d.embedding for d in packed.data], np.float32), np.array(ours, np.float32))
    with pytest.raises(openai.NotFoundError) as e:
        client(url).embeddings.create(model="nope", input="x")
    assert "model 'nope' not found (available: tiny, tiny-pt)" in str(e.value) and e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, key="wrong").embeddings.create(model="tiny", input="x")
    assert (e.value.status_code, e.value.code, e.value.type) == (401, "invalid_api_key", "invalid_request_error")
    raw = httpx.post(
        f"{url}/embeddings",
        json={"inputs": texts, "model": "tiny", "normalize": False},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    cut = np.array(raw)[:, :7]
    short = client(url).embeddings.create(model="tiny", input=texts, dimensions=7)  # Matryoshka: cut, normalised
    assert np.array([d.embedding for d in short.data]) == pytest.approx(
        cut / np.linalg.norm(cut, axis=1, keepdims=True), abs=1e-6
    )
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client(url).embeddings.create(model="tiny", input="x", dimensions=33)
    assert e.value.body["message"] == (
        "dimensions must be from 1 to 32 (model 'tiny' makes 32-dimensional embeddings), got 33"
    )
