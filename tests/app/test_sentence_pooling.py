"""The embedding routes embed as the model's own sentence-transformers modules say, against a real uvicorn:
/embeddings, /v1/embeddings and /embed answer what `SentenceTransformer(<the served directory>).encode` gives,
for the real all-MiniLM-L6-v2 (mean pooling + Normalize, imported as `bert import` does) and for tiny models
saved with CLS pooling and no Normalize, and with mean + max pooling that leaves its default prompt out. A
request's explicit pooling and normalize still override; requests pooled differently never share a work item
wrongly (a batch file mixing them), nor rows of one forward pass (run_encode on a mixed batch)."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from app.launcher.demo_data import find_asset
from app.serving.engine import Batch, WorkItem
from app.serving.forward import run_encode
from app.serving.stored_models import LoadedModel
from model.model_dir import import_model
from model.modeling import BertModel
from model.sentence_modules import Pooling, SentenceModules, read_sentence_modules, write_sentence_modules
from model.tokenizer import BertTokenizer
from tests.app.conftest import save_tiny
from tests.helpers import start_server, wait_for

pytestmark = pytest.mark.slow
TEXTS = ["A man is eating food.", "the cat sat on the mat", "Paris is the capital city of France, by the river."]
CLS = SentenceModules(Pooling(("cls",)), normalize=False)
PROMPTED = SentenceModules(Pooling(("mean", "max"), include_prompt=False), normalize=True)
PROMPTS = {"prompts": {"query": "the big dog ", "passage": "a red car "}, "default_prompt_name": "query"}
NO_BROKER = "redis://127.0.0.1:1/0"  # nothing listens there: no route here needs a worker


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, the models' directories): minilm imported from the demo asset, tiny-cls and tiny-prompted saved
    with their modules written by model.sentence_modules."""
    root = tmp_path_factory.mktemp("sentence-pooling")
    models = root / "models"
    import_model(find_asset("minilm"), models / "minilm")
    save_tiny(models / "tiny-cls", BertModel, seed=5)
    write_sentence_modules(models / "tiny-cls", CLS)
    save_tiny(models / "tiny-prompted", BertModel, seed=6)
    (models / "tiny-prompted" / "config_sentence_transformers.json").write_text(json.dumps(PROMPTS))
    write_sentence_modules(models / "tiny-prompted", PROMPTED)
    save_tiny(models / "tiny-dense", BertModel, seed=7)  # copied in by hand: no import refused it
    write_sentence_modules(models / "tiny-dense", SentenceModules())
    listed = json.loads((models / "tiny-dense" / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (models / "tiny-dense" / "modules.json").write_text(json.dumps([*listed, dense]))
    server, url = start_server(root, NO_BROKER, root)
    try:
        yield url, models
    finally:
        server.stop()


@pytest.fixture(scope="module")
def st(served):
    """SentenceTransformer of each served directory."""
    _, models = served
    return {
        name: SentenceTransformer(str(models / name), device="cpu") for name in ("minilm", "tiny-cls", "tiny-prompted")
    }


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    body = response.json()
    return np.array([d["embedding"] for d in body["data"]] if isinstance(body, dict) else body)


def close(got: np.ndarray, expected) -> bool:
    expected = np.asarray(expected)
    return got.shape == expected.shape and np.allclose(got, expected, rtol=0, atol=1e-5)


def test_minilm_answers_as_sentence_transformers_encodes_it(served, st):
    url, models = served
    assert read_sentence_modules(models / "minilm") == read_sentence_modules(find_asset("minilm"))
    expected = st["minilm"].encode(TEXTS)  # mean pooling, then its Normalize module
    original = SentenceTransformer(str(find_asset("minilm")), device="cpu").encode(TEXTS)
    assert np.allclose(expected, original, rtol=0, atol=1e-6)  # the import kept its modules
    assert close(vectors(post(url, "/embeddings", {"inputs": TEXTS, "model": "minilm"})), expected)
    assert close(vectors(post(url, "/v1/embeddings", {"input": TEXTS, "model": "minilm"})), expected)
    assert close(vectors(post(url, "/embed", {"inputs": TEXTS, "model": "minilm"})), expected)
    one = post(url, "/embeddings", {"inputs": TEXTS[0], "model": "minilm"})
    assert close(np.array([one.json()]), expected[:1])
    info = httpx.get(f"{url}/models/minilm").json()
    assert (info["pooling"], info["normalize"]) == (["mean"], True)


def test_cls_pooling_without_normalize_as_sentence_transformers(served, st):
    url, _ = served
    raw = st["tiny-cls"].encode(TEXTS)  # the [CLS] vectors, not normalised
    unit = st["tiny-cls"].encode(TEXTS, normalize_embeddings=True)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    assert close(vectors(post(url, "/embeddings", {"inputs": TEXTS, "model": "tiny-cls"})), raw)
    body = {"inputs": TEXTS, "model": "tiny-cls", "normalize": True}
    assert close(vectors(post(url, "/embeddings", body)), unit)
    # /v1/embeddings is always unit length (OpenAI's contract); TEI's /embed normalises unless told not to
    assert close(vectors(post(url, "/v1/embeddings", {"input": TEXTS, "model": "tiny-cls"})), unit)
    assert close(vectors(post(url, "/embed", {"inputs": TEXTS, "model": "tiny-cls"})), unit)
    assert close(vectors(post(url, "/embed", {"inputs": TEXTS, "model": "tiny-cls", "normalize": False})), raw)
    # an explicit pooling overrides the model's: the mean of sentence-transformers' own token vectors
    tokens = st["tiny-cls"].encode(TEXTS, output_value="token_embeddings")
    mean = np.stack([t.numpy().mean(0) for t in tokens])
    assert close(vectors(post(url, "/embeddings", {"inputs": TEXTS, "model": "tiny-cls", "pooling": "mean"})), mean)
    info = httpx.get(f"{url}/models/tiny-cls").json()
    assert (info["pooling"], info["normalize"]) == (["cls"], False)


def test_pooling_that_leaves_its_prompt_out_as_sentence_transformers(served, st):
    url, _ = served
    model = st["tiny-prompted"]
    expected = model.encode(TEXTS)  # its default prompt "query", whose tokens mean + max pooling leave out
    assert expected.shape == (3, 64)
    assert close(vectors(post(url, "/embeddings", {"inputs": TEXTS, "model": "tiny-prompted"})), expected)
    assert close(vectors(post(url, "/v1/embeddings", {"input": TEXTS, "model": "tiny-prompted"})), expected)
    passage = model.encode(TEXTS, prompt_name="passage")
    body = {"inputs": TEXTS, "model": "tiny-prompted", "prompt_name": "passage"}
    assert close(vectors(post(url, "/embed", body)), passage)
    body = {"inputs": TEXTS, "model": "tiny-prompted", "prompt": ""}
    assert close(vectors(post(url, "/embeddings", body)), model.encode(TEXTS, prompt=""))
    # dimensions count the pooled vector's 64 components; the cut is normalised, as the model normalises
    cut = model.encode(TEXTS, truncate_dim=40, normalize_embeddings=True)
    assert close(vectors(post(url, "/embeddings", {"inputs": TEXTS, "model": "tiny-prompted", "dimensions": 40})), cut)
    r = post(url, "/embeddings", {"inputs": "a", "model": "tiny-prompted", "dimensions": 65})
    assert (r.status_code, r.json()) == (
        422,
        {
            "error": "dimensions must be from 1 to 64 (model 'tiny-prompted' makes 64-dimensional embeddings), got 65",
            "error_type": "validation",
        },
    )
    r = post(url, "/embeddings", {"inputs": "a", "model": "tiny-prompted", "long_inputs": "chunk"})
    assert (r.status_code, r.json()) == (
        422,
        {
            "error": "model 'tiny-prompted' pools without its prompt's tokens (include_prompt false), and only an "
            'input\'s first window holds the prompt: send "long_inputs": "chunk" without a prompt, or another '
            "long_inputs",
            "error_type": "validation",
        },
    )


def test_a_batch_mixing_poolings_answers_each_line_as_its_route(served):
    """Lines run together only when they pool alike: each answer is the online route's."""
    url, _ = served
    bodies = [
        {"inputs": TEXTS[:2], "model": "tiny-cls"},
        {"inputs": TEXTS[:2], "model": "tiny-cls", "pooling": "mean"},
        {"inputs": TEXTS[:2], "model": "tiny-cls", "normalize": True},
        {"inputs": TEXTS[:2], "model": "tiny-cls", "pooling": "cls", "normalize": False},
        {"inputs": TEXTS[1:], "model": "tiny-prompted"},
        {"inputs": TEXTS[1:], "model": "tiny-prompted", "prompt": "the cat "},
        {"inputs": TEXTS[1:], "model": "tiny-prompted", "prompt_name": "passage"},
        {"inputs": TEXTS[1:], "model": "tiny-prompted", "pooling": "cls"},
    ]
    online = [vectors(post(url, "/embeddings", body)) for body in bodies]
    lines = b"".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/embeddings", "body": b}).encode() + b"\n"
        for i, b in enumerate(bodies)
    )
    upload = httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", io.BytesIO(lines))}, data={"purpose": "batch"})
    body = {"input_file_id": upload.json()["id"], "endpoint": "/embeddings", "completion_window": "24h"}
    batch_id = httpx.post(f"{url}/v1/batches", json=body).json()["id"]
    batch = wait_for(
        lambda: (b := httpx.get(f"{url}/v1/batches/{batch_id}").json())["status"] == "completed" and b, 60, "batch"
    )
    out = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content").content.splitlines()
    answers = {o["custom_id"]: np.array(o["response"]["body"]) for o in map(json.loads, out)}
    assert sorted(answers) == [f"r{i}" for i in range(len(bodies))]
    for i, expected in enumerate(online):
        assert np.allclose(answers[f"r{i}"], expected, rtol=0, atol=1e-6), i
    assert not np.allclose(online[0], online[1], atol=1e-3) and not np.allclose(online[4], online[5], atol=1e-3)


def test_rows_pooled_differently_share_a_forward_pass(tmp_path):
    """run_encode on one padded batch whose rows ask for different poolings, normalisations and prompt
    lengths: each row's vector is the one it gets alone."""
    save_tiny(tmp_path, BertModel, seed=6)
    model = BertModel.from_pretrained(tmp_path).eval()
    tokenizer = BertTokenizer.from_pretrained(tmp_path)
    lm = LoadedModel("m", model, tokenizer, 32, sentence_modules=PROMPTED)
    ids = [tokenizer.encode(t)["input_ids"] for t in ("the big dog the cat sat", "a red car", "the cat")]
    params = [
        {"pooling": None, "normalize": None, "prompt_length": 4},
        {"pooling": "cls", "normalize": False},
        {"pooling": None, "normalize": False},
        {"pooling": "mean", "normalize": None},
    ]
    rows = [ids[0], ids[1], ids[2], ids[0]]
    items = [WorkItem("encode", lm, [(r, [0] * len(r))], p) for r, p in zip(rows, params)]

    def batch_of(chosen: list[int]) -> Batch:
        width = max(len(rows[i]) for i in chosen)
        input_ids = torch.tensor([rows[i] + [0] * (width - len(rows[i])) for i in chosen])
        mask = torch.tensor([[1] * len(rows[i]) + [0] * (width - len(rows[i])) for i in chosen])
        tokens = int(mask.sum())
        return Batch(input_ids, torch.zeros_like(input_ids), mask, [(items[i], 0) for i in chosen], tokens)

    with torch.inference_mode():
        together = run_encode(lm, batch_of([0, 1, 2, 3]))
        alone = [run_encode(lm, batch_of([i]))[0] for i in range(4)]
    assert [len(v) for v in together] == [64, 32, 64, 32]
    for got, expected in zip(together, alone):
        assert np.allclose(got, expected, rtol=0, atol=1e-5)
    norms = [float(np.linalg.norm(v)) for v in together]
    assert norms[0] == pytest.approx(1.0) and norms[3] == pytest.approx(1.0) and norms[2] != pytest.approx(1.0)
    with torch.inference_mode():
        hidden = model(torch.tensor([rows[1]])).last_hidden_state
    assert np.allclose(together[1], hidden[0, 0].tolist(), rtol=0, atol=1e-5)  # cls: the [CLS] vector, as it is


def test_a_model_whose_modules_cannot_run_does_not_embed(served):
    url, _ = served
    message = (
        "model 'tiny-dense' cannot embed: modules.json: module 3 is sentence_transformers.models.Dense, which "
        "this service cannot run (it runs a Transformer, then a Pooling, then an optional Normalize); its "
        "embeddings would differ from sentence-transformers'"
    )
    r = post(url, "/embeddings", {"inputs": "the cat", "model": "tiny-dense"})
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})
    r = post(url, "/v1/embeddings", {"input": "the cat", "model": "tiny-dense"})
    assert (r.status_code, r.json()["error"]["message"]) == (422, message)
    info = httpx.get(f"{url}/models/tiny-dense").json()
    assert (info["pooling"], info["normalize"]) == (None, None)
