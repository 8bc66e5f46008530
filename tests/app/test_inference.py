"""Answers equal the models' own forward passes; batched answers equal one-by-one answers."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.anyio


def encode(tokenizer, text, pair=None):
    enc = tokenizer.encode(text, pair)
    return {k: torch.tensor([v]) for k, v in enc.items()}


def mlm_reference(model, tokenizer, text, top_k):
    """Per [MASK]: (probabilities, ids) of the top_k tokens, from the full (1, T, V) logits."""
    enc = encode(tokenizer, text)
    with torch.no_grad():
        out = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    logits = out.logits if hasattr(out, "logits") else out.prediction_logits
    positions = (enc["input_ids"][0] == tokenizer.mask_token_id).nonzero().flatten()
    return [logits[0, p].softmax(-1).topk(top_k) for p in positions]


def embed_reference(encoder, tokenizer, text, pooling="mean", normalize=True):
    enc = encode(tokenizer, text)
    with torch.no_grad():
        hidden = encoder(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).last_hidden_state[0]
    vector = hidden.mean(0) if pooling == "mean" else hidden[0]
    return F.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("name", ["tiny-pt", "tiny-mlm"])
async def test_fill_mask_single_mask_matches_model(client, reference, tokenizer, name):
    text = "the quick brown [MASK] jumped over the lazy dog."
    r = await client.post("/fill-mask", json={"inputs": text, "top_k": 4, "model": name})
    assert r.status_code == 200
    got = r.json()
    ((values, ids),) = mlm_reference(reference[name], tokenizer, text, 4)
    assert [c["token"] for c in got] == ids.tolist()
    assert [c["score"] for c in got] == pytest.approx(values.tolist(), abs=1e-6)
    first = got[0]
    assert first["token_str"] == tokenizer.convert_ids_to_tokens(first["token"])
    assert first["sequence"] == text.replace("[MASK]", first["token_str"])


async def test_fill_mask_several_masks_and_inputs(client, reference, tokenizer):
    texts = ["the [MASK] sat on the [MASK].", "paris is the [MASK] of france."]
    r = await client.post("/fill-mask", json={"inputs": texts, "top_k": 3})
    assert r.status_code == 200
    got = r.json()
    assert len(got) == 2 and len(got[0]) == 2 and len(got[0][0]) == 3 and len(got[1]) == 3
    for per_mask, (values, ids) in zip(got[0], mlm_reference(reference["tiny-pt"], tokenizer, texts[0], 3)):
        assert [c["token"] for c in per_mask] == ids.tolist()
        assert [c["score"] for c in per_mask] == pytest.approx(values.tolist(), abs=1e-6)
    # With several masks, as transformers: the other masks and the special tokens stay in `sequence`.
    assert got[0][0][0]["sequence"] == f"[CLS] the {got[0][0][0]['token_str']} sat on the [MASK]. [SEP]"


async def test_fill_mask_targets(client, reference, tokenizer):
    text = "the [MASK] sat on the mat."
    r = await client.post("/fill-mask", json={"inputs": text, "targets": ["cat", "Dog", "fox"], "top_k": 5})
    got = r.json()
    assert r.status_code == 200 and len(got) == 3  # top_k capped at the number of targets
    enc = encode(tokenizer, text)
    with torch.no_grad():
        probs = reference["tiny-pt"](**enc).prediction_logits[0, 2].softmax(-1)
    ids = tokenizer.convert_tokens_to_ids(["cat", "dog", "fox"])  # "Dog" -> its first WordPiece, "dog"
    expected = sorted(((probs[i].item(), i) for i in ids), reverse=True)
    assert [(c["token"]) for c in got] == [i for _, i in expected]
    assert [c["score"] for c in got] == pytest.approx([p for p, _ in expected], abs=1e-6)


async def test_nsp_matches_model(client, reference, tokenizer):
    pairs = [
        {"text_a": "i went to the store.", "text_b": "i bought milk."},
        {"text_a": "the sky is blue.", "text_b": "penguins can not fly, they ran."},
    ]
    r = await client.post("/nsp", json={"inputs": pairs})
    assert r.status_code == 200
    for got, pair in zip(r.json(), pairs):
        with torch.no_grad():
            logits = reference["tiny-pt"](**encode(tokenizer, pair["text_a"], pair["text_b"])).seq_relationship_logits
        score = logits.softmax(-1)[0, 0].item()
        assert got == {"is_next": score >= 0.5, "score": pytest.approx(score, abs=1e-6)}
    single = await client.post("/nsp", json={"inputs": pairs[0]})
    assert single.json()["score"] == pytest.approx(r.json()[0]["score"], abs=1e-6)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False)])
async def test_embeddings_match_bert_model(client, reference, tokenizer, pooling, normalize):
    text = "a small red car"
    r = await client.post(
        "/embeddings", json={"inputs": text, "model": "tiny-enc", "pooling": pooling, "normalize": normalize}
    )
    assert r.status_code == 200
    expected = embed_reference(reference["tiny-enc"], tokenizer, text, pooling, normalize)
    assert r.json() == pytest.approx(expected.tolist(), abs=1e-5)


async def test_embeddings_of_a_head_model_use_its_encoder(client, reference, tokenizer):
    r = await client.post("/embeddings", json={"inputs": ["the dog ran"]})  # default model, tiny-pt
    expected = embed_reference(reference["tiny-pt"].bert, tokenizer, "the dog ran")
    assert r.json()[0] == pytest.approx(expected.tolist(), abs=1e-5)


async def test_classify_matches_model(client, reference, tokenizer):
    inputs = ["a great film", {"text_a": "a man eats food", "text_b": "a woman ate"}]
    r = await client.post("/classify", json={"inputs": inputs, "model": "tiny-cls"})
    assert r.status_code == 200
    for got, item in zip(r.json(), inputs):
        enc = encode(tokenizer, item) if isinstance(item, str) else encode(tokenizer, item["text_a"], item["text_b"])
        with torch.no_grad():
            probs = reference["tiny-cls"](**enc).logits.softmax(-1)[0].tolist()
        best = int(np.argmax(probs))
        assert got["label"] == ["negative", "positive"][best]
        assert got["score"] == pytest.approx(probs[best], abs=1e-6)
        assert got["scores"] == {
            "negative": pytest.approx(probs[0], abs=1e-6),
            "positive": pytest.approx(probs[1], abs=1e-6),
        }


async def test_openai_embeddings_format(client, reference, tokenizer):
    texts = ["the cat sat", "two big dogs"]
    r = await client.post("/v1/embeddings", json={"input": texts, "model": "tiny-enc", "encoding_format": "float"})
    assert r.status_code == 200
    body = r.json()
    tokens = sum(len(tokenizer.encode(t)["input_ids"]) for t in texts)
    assert body["object"] == "list" and body["model"] == "tiny-enc"
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"embedding"}
    for d, text in zip(body["data"], texts):
        assert d["embedding"] == pytest.approx(
            embed_reference(reference["tiny-enc"], tokenizer, text).tolist(), abs=1e-5
        )
    # OpenAI's python client asks for base64 (little-endian float32) unless told otherwise.
    r64 = await client.post(
        "/v1/embeddings", json={"input": texts[0], "model": "tiny-enc", "encoding_format": "base64"}
    )
    decoded = np.frombuffer(base64.b64decode(r64.json()["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(body["data"][0]["embedding"], abs=1e-6)


async def test_truncate_cuts_long_inputs(client, reference, tokenizer):
    long_text = " ".join(["dog"] * 60)  # 62 tokens; the tiny models take 32
    r = await client.post("/embeddings", json={"inputs": long_text, "model": "tiny-enc", "truncate": True})
    assert r.status_code == 200
    expected = embed_reference(reference["tiny-enc"], tokenizer, " ".join(["dog"] * 30))  # 30 + [CLS] + [SEP]
    assert r.json() == pytest.approx(expected.tolist(), abs=1e-5)


async def test_batched_answers_equal_one_by_one(client):
    texts = [
        "the cat",
        "a quick brown fox jumped over the lazy dog and ran to the river",
        "paris",
        "she is happy, he is sad, they are not.",
        "one two three four five",
    ]
    batch = (await client.post("/embeddings", json={"inputs": texts})).json()
    for text, vector in zip(texts, batch):
        alone = (await client.post("/embeddings", json={"inputs": text})).json()
        cosine = F.cosine_similarity(torch.tensor(alone), torch.tensor(vector), dim=0).item()
        assert cosine >= 0.9999
    masked = [t.replace(t.split()[0], "[MASK]", 1) for t in texts]
    batch = (await client.post("/fill-mask", json={"inputs": masked, "top_k": 5})).json()
    for text, got in zip(masked, batch):
        alone = (await client.post("/fill-mask", json={"inputs": text, "top_k": 5})).json()
        assert [c["token"] for c in alone] == [c["token"] for c in got]
        assert [c["score"] for c in alone] == pytest.approx([c["score"] for c in got], abs=1e-5)


async def test_answers_match_transformers_fill_mask_pipeline(client, data_dir):
    transformers = pytest.importorskip("transformers")
    pipe = transformers.pipeline("fill-mask", model=str(data_dir / "models" / "tiny-mlm"))
    for text, kwargs in [
        ("the cat [MASK] on the mat.", {}),
        ("the [MASK] sat [MASK].", {}),
        ("the [MASK] ran.", {"targets": ["cat", "Dog", "fox"]}),
    ]:
        expected = pipe(text, top_k=3, **kwargs)
        r = await client.post("/fill-mask", json={"inputs": text, "top_k": 3, "model": "tiny-mlm", **kwargs})
        assert _rounded(r.json()) == _rounded(expected)


def _rounded(x):
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return {**x, "score": round(x["score"], 5)}
