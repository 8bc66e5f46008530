"""The embedding options of /embeddings, /v1/embeddings and /embed (app/serving/embed_pipeline.py), each equal
to a by-hand recomputation on the tiny models' own forward passes: dimensions (the first N of the
un-normalised vector, then normalised, as sentence-transformers' truncate_dim), named prompts from
config_sentence_transformers.json (= embedding the prompted text), and long_inputs "chunk" (the windows'
mean vectors averaged, weighted by their tokens); their bounds and exact 422 bodies."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from model.modeling import BertModel
from tests.app.conftest import save_tiny, serve_app, settings_for

pytestmark = pytest.mark.anyio
PROMPTS = {"query": "the cat ", "passage": "a dog "}
LONG = " ".join(["the quick brown fox jumped over the lazy dog ."] * 6)  # 60 tokens; the models take 32


def err(message: str) -> dict:
    return {"error": message, "error_type": "validation"}


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    """tiny-enc (no prompts) and tiny-st: the same weights with prompts, "query" the default."""
    root = tmp_path_factory.mktemp("embedding-options")
    save_tiny(root / "models" / "tiny-enc", BertModel, seed=3)
    shutil.copytree(root / "models" / "tiny-enc", root / "models" / "tiny-st")
    config = {"prompts": PROMPTS, "default_prompt_name": "query", "similarity_fn_name": "cosine"}
    (root / "models" / "tiny-st" / "config_sentence_transformers.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
async def client(st_dir):
    async with serve_app(settings_for(st_dir, default_model="tiny-enc", max_request_tokens=100)) as c:
        yield c


@pytest.fixture(scope="module")
def model(st_dir):
    return BertModel.from_pretrained(st_dir / "models" / "tiny-enc").eval()


def mean_vector(model, ids: list[int]) -> torch.Tensor:
    """The un-normalised mean of one row's last hidden states."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).last_hidden_state[0]
    return hidden.mean(0)


def by_hand(model, tokenizer, text: str) -> torch.Tensor:
    return mean_vector(model, tokenizer.encode(text)["input_ids"])


async def test_dimensions_keep_the_first_n_then_normalise(client, model, tokenizer):
    texts = ["the cat sat", "two big dogs ran"]
    raw = [by_hand(model, tokenizer, t) for t in texts]
    expected = [F.normalize(v[:8], dim=-1).tolist() for v in raw]
    r = await client.post("/embeddings", json={"inputs": texts, "dimensions": 8})
    assert r.status_code == 200 and np.array(r.json()) == pytest.approx(np.array(expected), abs=1e-5)
    r = await client.post("/embeddings", json={"inputs": texts[0], "dimensions": 8, "normalize": False})
    assert r.json() == pytest.approx(raw[0][:8].tolist(), abs=1e-5)
    r = await client.post("/embed", json={"inputs": texts, "dimensions": 8})
    assert np.array(r.json()) == pytest.approx(np.array(expected), abs=1e-5)
    r = await client.post("/v1/embeddings", json={"input": texts, "dimensions": 8})
    assert np.array([d["embedding"] for d in r.json()["data"]]) == pytest.approx(np.array(expected), abs=1e-5)
    whole = (await client.post("/embeddings", json={"inputs": texts[0]})).json()
    r = await client.post("/embeddings", json={"inputs": texts[0], "dimensions": 32})
    assert r.json() == pytest.approx(whole, abs=1e-6)


@pytest.mark.parametrize("dimensions", [0, 33])
async def test_dimensions_out_of_range_are_422(client, dimensions):
    message = f"dimensions must be from 1 to 32 (model 'tiny-enc' makes 32-dimensional embeddings), got {dimensions}"
    for route, body in [("/embeddings", {"inputs": "a"}), ("/embed", {"inputs": "a"})]:
        r = await client.post(route, json={**body, "dimensions": dimensions})
        assert (r.status_code, r.json()) == (422, err(message)), route
    r = await client.post("/v1/embeddings", json={"input": "a", "dimensions": dimensions})
    assert r.status_code == 422
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


async def test_named_prompts_equal_embedding_the_prompted_text(client, model, tokenizer):
    text = "went to the store"

    def expected(prompt: str) -> list[float]:
        return F.normalize(by_hand(model, tokenizer, prompt + text), dim=-1).tolist()

    r = await client.post("/embeddings", json={"inputs": text, "model": "tiny-st", "prompt_name": "passage"})
    assert r.status_code == 200 and r.json() == pytest.approx(expected("a dog "), abs=1e-5)
    r = await client.post("/embeddings", json={"inputs": text, "model": "tiny-st"})  # its default_prompt_name
    assert r.json() == pytest.approx(expected("the cat "), abs=1e-5)
    r = await client.post("/embeddings", json={"inputs": text, "model": "tiny-st", "prompt": ""})
    assert r.json() == pytest.approx(expected(""), abs=1e-5)
    r = await client.post("/embed", json={"inputs": [text], "model": "tiny-enc", "prompt": "a dog "})
    assert r.json() == [pytest.approx(expected("a dog "), abs=1e-5)]
    r = await client.post("/v1/embeddings", json={"input": [text], "model": "tiny-st", "prompt_name": "passage"})
    assert r.json()["data"][0]["embedding"] == pytest.approx(expected("a dog "), abs=1e-5)
    prompted = len(tokenizer.encode("a dog " + text)["input_ids"])
    assert r.json()["usage"]["prompt_tokens"] == prompted  # the prompt's tokens count
    pair = ["the cat sat", "a red car"]
    vectors = (
        await client.post("/embeddings", json={"inputs": pair, "model": "tiny-st", "prompt_name": "passage"})
    ).json()
    r = await client.post(
        "/similarity",
        json={
            "inputs": {"source_sentence": pair[0], "sentences": pair[1:]},
            "parameters": {"prompt_name": "passage"},
            "model": "tiny-st",
        },
    )
    assert r.json() == pytest.approx([float(np.dot(*vectors))], abs=1e-6)
    r = await client.post("/tokenize", json={"inputs": "a", "model": "tiny-st", "prompt_name": "passage"})
    assert [t["text"] for t in r.json()[0]] == ["[CLS]", "a", "dog", "a", "[SEP]"]


async def test_prompt_errors_are_422_naming_the_prompts(client):
    for body, message in [
        (
            {"model": "tiny-st", "prompt_name": "document"},
            "prompt_name 'document' is not a prompt of model 'tiny-st'; its prompts: passage, query",
        ),
        (
            {"model": "tiny-enc", "prompt_name": "query"},
            "prompt_name 'query' is not supported: model 'tiny-enc' has no prompts; put the prompt at the start "
            "of the text instead",
        ),
        ({"model": "tiny-st", "prompt_name": "query", "prompt": "x "}, "send prompt_name or prompt, not both"),
    ]:
        r = await client.post("/embeddings", json={"inputs": "a", **body})
        assert (r.status_code, r.json()) == (422, err(message)), body


async def test_model_info_lists_its_prompts(client):
    assert (await client.get("/models/tiny-st")).json()["prompts"] == PROMPTS
    assert (await client.get("/models/tiny-enc")).json()["prompts"] is None


def windows(tokenizer, text: str) -> list[list[int]]:
    """The windows by hand: 30 content tokens each (32 positions), the next starting 23 later (overlap 7)."""
    ids = tokenizer.token_ids(text)
    starts = range(0, len(ids) - 7, 23)
    return [[tokenizer.cls_token_id, *ids[s : s + 30], tokenizer.sep_token_id] for s in starts]


async def test_chunk_is_the_token_weighted_mean_of_window_embeddings(client, model, tokenizer):
    rows = windows(tokenizer, LONG)
    assert [len(w) for w in rows] == [32, 32, 16]
    vectors = torch.stack([mean_vector(model, w) for w in rows])
    weights = torch.tensor([float(len(w)) for w in rows])
    pooled = (vectors * weights[:, None]).sum(0) / weights.sum()
    expected = F.normalize(pooled, dim=-1)
    r = await client.post("/embeddings", json={"inputs": [LONG, "the cat"], "long_inputs": "chunk"})
    assert r.status_code == 200
    assert r.json()[0] == pytest.approx(expected.tolist(), abs=1e-5)
    short = (await client.post("/embeddings", json={"inputs": "the cat"})).json()
    assert r.json()[1] == pytest.approx(short, abs=1e-6)  # one window: as without chunking
    r = await client.post("/embed", json={"inputs": LONG, "long_inputs": "chunk", "dimensions": 4})
    assert r.json() == [pytest.approx(F.normalize(pooled[:4], dim=-1).tolist(), abs=1e-5)]
    r = await client.post("/v1/embeddings", json={"input": LONG, "long_inputs": "chunk"})
    assert r.json()["data"][0]["embedding"] == pytest.approx(expected.tolist(), abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == 80  # every window's tokens
    r = await client.post("/embeddings", json={"inputs": LONG, "long_inputs": "chunk", "normalize": False})
    assert r.json() == pytest.approx(pooled.tolist(), abs=1e-5)


async def test_chunked_windows_count_against_the_token_bound(client):
    r = await client.post("/embeddings", json={"inputs": [LONG, LONG], "long_inputs": "chunk"})
    assert (r.status_code, r.json()) == (
        422,
        err(
            "the request is 160 tokens long (every window of every input, [CLS] and [SEP] included), "
            "more than the 100 that BERT_MAX_REQUEST_TOKENS allows"
        ),
    )
    r = await client.post("/embeddings", json={"inputs": [LONG, LONG], "truncate": True})
    assert r.status_code == 200  # 2 x 32 tokens once cut


async def test_long_input_modes(client):
    r = await client.post("/embeddings", json={"inputs": LONG})
    assert (r.status_code, r.json()) == (
        422,
        err(
            "input 0 is 62 tokens long, more than the 32 model 'tiny-enc' takes; shorten it or send \"truncate\": true"
        ),
    )
    cut = (await client.post("/embeddings", json={"inputs": LONG, "truncate": True})).json()
    r = await client.post("/embeddings", json={"inputs": LONG, "long_inputs": "truncate"})
    assert r.json() == pytest.approx(cut, abs=1e-6)
    r = await client.post("/v1/embeddings", json={"input": LONG})
    assert r.status_code == 422  # OpenAI's default: an error
    r = await client.post("/embeddings", json={"inputs": LONG, "truncate": True, "long_inputs": "chunk"})
    assert (r.status_code, r.json()) == (
        422,
        err('"truncate": true and "long_inputs": "chunk" disagree; send one of them'),
    )


async def test_a_chunked_request_charges_its_key_each_token_once(st_dir, tmp_path):
    """The windows' tokens count against the token bound before any window is made, and are charged to
    the key's token rate once: /usage has the 80 tokens the request ran (its `usage` says 80 too)."""
    secrets = {"metered": new_secret(), "boss": new_secret()}
    keys_file = tmp_path / "keys.toml"
    write_keys(
        keys_file,
        {
            "metered": Key("metered", hash_secret(secrets["metered"]), frozenset({"inference"}), tokens_per_min=10_000),
            "boss": Key("boss", hash_secret(secrets["boss"]), frozenset({"admin"})),
        },
    )
    settings = settings_for(st_dir, default_model="tiny-enc", max_request_tokens=100, keys_file=keys_file)
    async with serve_app(settings) as c:
        metered = {"Authorization": f"Bearer {secrets['metered']}"}
        r = await c.post("/v1/embeddings", json={"input": LONG, "long_inputs": "chunk"}, headers=metered)
        assert (r.status_code, r.json()["usage"]["prompt_tokens"]) == (200, 80)
        usage = (await c.get("/usage", headers={"Authorization": f"Bearer {secrets['boss']}"})).json()["keys"]
    assert usage["metered"] == {"requests": 1, "tokens": 80, "rate_limited": 0, "job_seconds": 0.0}
