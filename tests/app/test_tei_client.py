"""A real TEI client against a real uvicorn of this service: huggingface_hub's InferenceClient, which
posts to the URL it is given as the model (an Inference Endpoint or a TEI server) with TEI's bodies.

What the client (huggingface_hub 2.x) sends, from its source (inference/_client.py, _providers/hf_inference.py):
  feature_extraction(text, normalize=, truncate=, truncation_direction=, prompt_name=)
      POST <url> {"inputs": text, "normalize": ..., ...}   (options at the top level: TEI's /embed)
  text_classification(text)       POST <url> {"inputs": text, "parameters": {...}}   (TEI's /predict)
  sentence_similarity(s, others)  POST <url> {"inputs": {"source_sentence", "sentences"}, "parameters": {}}
                                  (TEI's /similarity)
  health_check()                  GET <url>/health
  get_endpoint_info()             GET <url>/info   (ours answers this service's info, not TEI's Info)
with `Authorization: Bearer <token>`; given the server's bare URL, the POSTs go to TEI's POST /, which
answers by the model's type. It has no call for /rerank or /tokenize: TEI's README documents
those with curl, and tests/app/test_tei.py sends exactly those bodies; here one of each goes over real
HTTP with the key. Values are checked against transformers on the same weights.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from model.modeling import BertForSequenceClassification, BertModel
from tests.app.conftest import save_tiny
from tests.helpers import REDIS_URL, start_server

huggingface_hub = pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")
KEY = "tei-client-key-0123456789"
TEXTS = ["the quick brown fox jumped over the lazy dog", "paris is the capital of france", "a red car"]


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1 (no test reaches the real Hub); InferenceClient obeys it
    for every URL, and here it talks to our own server, not the Hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, data_dir): uvicorn over a data dir with `tiny` (an encoder, the default model), tiny-cls and
    tiny-rerank, behind an API key."""
    root = tmp_path_factory.mktemp("tei-client")
    save_tiny(root / "models" / "tiny", BertModel, seed=1)
    save_tiny(
        root / "models" / "tiny-cls", BertForSequenceClassification, seed=2, id2label={0: "negative", 1: "positive"}
    )
    save_tiny(root / "models" / "tiny-rerank", BertForSequenceClassification, seed=3, id2label={0: "LABEL_0"})
    server, url = start_server(
        root, REDIS_URL, root, BERT_API_KEY=KEY, BERT_PREDICT_MODEL="tiny-cls", BERT_RERANK_MODEL="tiny-rerank"
    )
    try:
        yield url, root
    finally:
        server.stop()


def client(url: str, path: str = "", token: str | None = KEY):
    return huggingface_hub.InferenceClient(model=url + path, token=token)


def hf_embeddings(root, texts: list[str], normalize: bool = True, **tok_kwargs) -> torch.Tensor:
    """transformers' BertModel, mean-pooled over the attention mask: what /embed answers."""
    path = root / "models" / "tiny"
    model, tok = transformers.BertModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(path)
    for key in ("truncation_side",):
        if key in tok_kwargs:
            setattr(tok, key, tok_kwargs.pop(key))
    enc = tok(texts, padding=True, return_tensors="pt", **tok_kwargs)
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def test_feature_extraction_is_teis_embed(served):
    url, root = served
    one = client(url, "/embed").feature_extraction("What is Deep Learning?")
    assert one.dtype == np.float32 and one.shape == (1, 32)
    assert one[0] == pytest.approx(hf_embeddings(root, ["what is deep learning?"])[0].numpy(), abs=1e-5)
    several = client(url, "/embed").feature_extraction(TEXTS, normalize=False)
    assert several.shape == (3, 32)
    assert several == pytest.approx(hf_embeddings(root, TEXTS, normalize=False).numpy(), abs=1e-5)


def test_feature_extraction_truncates_from_the_side_asked(served):
    url, root = served
    text = " ".join(["dog"] * 20 + ["cat"] * 20)  # 40 words; the tiny models take 32 positions
    for side in ("left", "right"):
        got = client(url, "/embed").feature_extraction(text, truncate=True, truncation_direction=side)
        expected = hf_embeddings(root, [text], truncation=True, max_length=32, truncation_side=side)
        assert got[0] == pytest.approx(expected[0].numpy(), abs=1e-5), side


def test_feature_extraction_errors_reach_the_client_with_our_body(served):
    url, _ = served
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as e:
        client(url, "/embed").feature_extraction("the cat", prompt_name="query")
    assert e.value.response.status_code == 422
    assert e.value.response.json() == {
        "error": "prompt_name 'query' is not supported: model 'tiny' has no prompts; "
        "put the prompt at the start of the text instead",
        "error_type": "validation",
    }
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as e:
        client(url, "/embed", token="wrong-key-0123456789").feature_extraction("the cat")
    assert e.value.response.status_code == 401


def test_text_classification_is_teis_predict(served):
    url, root = served
    path = root / "models" / "tiny-cls"
    model = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        probs = model(**tok(["I like you. I love you"], return_tensors="pt")).logits.softmax(-1)[0].tolist()
    best = max(range(2), key=lambda i: probs[i])
    got = client(url, "/predict").text_classification("I like you. I love you")
    # TEI answers one text with a flat list of labels, best first; this client takes the first item of the
    # list it parses, so against TEI (and here) it returns the best label alone, not a list.
    assert got.label == ["negative", "positive"][best]
    assert got.score == pytest.approx(probs[best], abs=1e-5)
    raw = httpx.post(
        f"{url}/predict", json={"inputs": "I like you. I love you"}, headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert [p["label"] for p in raw] == [got.label, ["negative", "positive"][1 - best]]


def test_sentence_similarity_is_teis_similarity(served):
    url, root = served
    got = client(url, "/similarity").sentence_similarity("the cat sat on the mat", TEXTS)
    vectors = hf_embeddings(root, ["the cat sat on the mat", *TEXTS])
    assert got == pytest.approx((vectors[1:] @ vectors[0]).tolist(), abs=1e-5)
    assert len(got) == 3 and all(isinstance(x, float) for x in got)


def test_similarity_limits_options_and_errors(served):
    url, root = served
    headers = {"Authorization": f"Bearer {KEY}"}
    text = " ".join(["dog"] * 40)
    r = httpx.post(
        f"{url}/similarity",
        headers=headers,
        json={
            "inputs": {"source_sentence": text, "sentences": ["dog"]},
            "parameters": {"truncate": True, "truncation_direction": "Left", "prompt_name": None},
        },
    )
    assert r.status_code == 200
    vectors = hf_embeddings(root, [text, "dog"], truncation=True, max_length=32)
    assert r.json() == pytest.approx([(vectors[0] @ vectors[1]).item()], abs=1e-5)
    r = httpx.post(f"{url}/similarity", headers=headers, json={"inputs": {"source_sentence": text, "sentences": ["a"]}})
    assert r.status_code == 422
    assert r.json() == {
        "error": "input 0 is 42 tokens long, more than the 32 model 'tiny' takes; shorten it or send "
        '"truncate": true',
        "error_type": "validation",
    }
    r = httpx.post(f"{url}/similarity", headers=headers, json={"inputs": {"source_sentence": "a", "sentences": []}})
    assert r.status_code == 422
    assert r.json() == {
        "error": "inputs.sentences: List should have at least 1 item after validation, not 0",
        "error_type": "validation",
    }
    r = httpx.post(
        f"{url}/similarity", headers=headers, json={"inputs": {"source_sentence": "a", "sentences": ["b"] * 64}}
    )  # 65 texts in all
    assert r.status_code == 422
    assert r.json() == {"error": "at most 64 inputs per request, got 65", "error_type": "validation"}
    r = httpx.post(f"{url}/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b"]}})
    assert r.status_code == 401


def test_the_bare_url_answers_as_teis_post_root(served):
    url, root = served
    got = client(url).feature_extraction(TEXTS[:2])  # POST /: the default model `tiny` is an encoder
    assert got == pytest.approx(hf_embeddings(root, TEXTS[:2]).numpy(), abs=1e-5)
    similar = client(url).sentence_similarity("the cat sat on the mat", TEXTS)
    assert similar == pytest.approx(
        client(url, "/similarity").sentence_similarity("the cat sat on the mat", TEXTS), abs=1e-6
    )


def test_health_check_and_endpoint_info(served):
    url, _ = served
    # health_check wants the provider named (2.x defaults it to None, "auto" for the other calls).
    assert huggingface_hub.InferenceClient(model=url, provider="hf-inference").health_check() is True
    # GET /info is this service's own (name, version, settings), not TEI's Info (model_id, model_type, ...).
    info = huggingface_hub.InferenceClient(model=url, provider="hf-inference", token=KEY).get_endpoint_info()
    assert info["name"] == "bertserve" and "model_id" not in info


def test_rerank_and_tokenize_over_http_as_teis_readme(served):
    url, root = served
    headers = {"Authorization": f"Bearer {KEY}"}
    texts = ["Deep Learning is not...", "Deep learning is..."]
    r = httpx.post(f"{url}/rerank", headers=headers, json={"query": "What is Deep Learning?", "texts": texts})
    assert r.status_code == 200
    path = root / "models" / "tiny-rerank"
    model = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        scores = (
            model(**tok(["What is Deep Learning?"] * 2, texts, padding=True, return_tensors="pt"))
            .logits[:, 0]
            .sigmoid()
            .tolist()
        )
    assert r.json() == [
        {"index": i, "score": pytest.approx(scores[i], abs=1e-5)} for i in sorted(range(2), key=lambda i: -scores[i])
    ]
    r = httpx.post(f"{url}/tokenize", headers=headers, json={"inputs": "What is Deep Learning?"})
    assert r.status_code == 200
    ids = transformers.AutoTokenizer.from_pretrained(root / "models" / "tiny")("What is Deep Learning?")["input_ids"]
    assert [t["id"] for t in r.json()[0]] == ids
    assert list(r.json()[0][0]) == ["id", "text", "special", "start", "stop"]
