"""text-embeddings-inference's routes (/embed, /predict, /rerank, /similarity, /tokenize, POST /) over real ASGI: TEI's
shapes (the request bodies of TEI's README), values against transformers on the same weights, and
this service's errors, limits and key.

Models: tiny-pt (default), tiny-enc, tiny-cls (labels negative/positive) and tiny-rerank, a
one-label BertForSequenceClassification: a random cross-encoder.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.serving.engine import WorkItem
from app.serving.forward import run_classify
from model.modeling import BertForSequenceClassification
from tests.app.conftest import MODELS, save_tiny, serve_app, settings_for
from tests.app.test_bounds import HeldTokenizer, RawRequest, until

pytestmark = pytest.mark.anyio
transformers = pytest.importorskip("transformers")

MODEL_NAMES = {"tiny-pt": "tiny-pt", "tiny-enc": "tiny-enc", "tiny-cls": "tiny-cls"}
QUERY = "what is a quick brown fox ?"
TEXTS = [
    "the quick brown fox jumped over the lazy dog",
    "paris is the capital of france",
    "a red car",
    "the fox ran",
    "she ate food",
]


MANY_LABELS = 300  # more than BERT_MAX_LABEL_SCORES (100): answers hold the best few


def err(kind: str, message: str) -> dict:
    return {"error": message, "error_type": kind}


@pytest.fixture(scope="module")
def tei_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tei")
    for i, name in enumerate(MODEL_NAMES):
        extra = {"id2label": {0: "negative", 1: "positive"}} if name == "tiny-cls" else {}
        save_tiny(root / "models" / name, MODELS[name], seed=i, **extra)
    save_tiny(root / "models" / "tiny-rerank", BertForSequenceClassification, seed=7, id2label={0: "LABEL_0"})
    save_tiny(
        root / "models" / "tiny-many",
        BertForSequenceClassification,
        seed=8,
        id2label={i: f"class-{i}" for i in range(MANY_LABELS)},
    )
    return root


@pytest.fixture(scope="module")
async def tei(tei_dir):
    async with serve_app(settings_for(tei_dir, rerank_model="tiny-rerank", predict_model="tiny-cls")) as c:
        yield c


def hf(tei_dir, name: str, cls_name: str = "BertForSequenceClassification"):
    path = tei_dir / "models" / name
    return (
        getattr(transformers, cls_name).from_pretrained(path).eval(),
        transformers.AutoTokenizer.from_pretrained(path),
    )


def hf_logits(model, tok, texts, pairs=None, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(**tok(texts, pairs, padding=True, return_tensors="pt", **kwargs)).logits


# -- /rerank ------------------------------------------------------------------------------------


async def test_rerank_as_teis_readme_shows(tei):
    r = await tei.post(
        "/rerank", json={"query": "What is Deep Learning?", "texts": ["Deep Learning is not...", "Deep learning is..."]}
    )
    assert r.status_code == 200
    body = r.json()
    assert [sorted(rank) for rank in body] == [["index", "score"]] * 2
    assert sorted(rank["index"] for rank in body) == [0, 1]
    assert body[0]["score"] >= body[1]["score"]


async def test_rerank_scores_are_transformers_sigmoid_logits_best_first(tei, tei_dir):
    model, tok = hf(tei_dir, "tiny-rerank")
    logits = hf_logits(model, tok, [QUERY] * len(TEXTS), TEXTS)[:, 0]
    r = await tei.post("/rerank", json={"query": QUERY, "texts": TEXTS, "return_text": True})
    assert r.status_code == 200
    body = r.json()
    expected = logits.sigmoid().tolist()
    assert [rank["index"] for rank in body] == sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    for rank in body:
        assert list(rank) == ["index", "text", "score"]  # TEI's field order
        assert rank["text"] == TEXTS[rank["index"]]
        assert rank["score"] == pytest.approx(expected[rank["index"]], abs=1e-5)
    raw = (await tei.post("/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True})).json()
    assert {rank["index"]: rank["score"] for rank in raw} == pytest.approx(dict(enumerate(logits.tolist())), abs=1e-5)
    assert [rank["index"] for rank in raw] == [rank["index"] for rank in body]  # sigmoid keeps the order


async def test_rerank_charges_its_key_the_rows_it_runs_once(tei_dir, tmp_path):
    """The query and texts count against the token bound as they are tokenised; the key's token rate is
    charged once, for the (query, text) rows the model runs."""
    secrets = {"metered": new_secret(), "boss": new_secret()}
    keys = {
        "metered": Key("metered", hash_secret(secrets["metered"]), frozenset({"inference"}), tokens_per_min=10**6),
        "boss": Key("boss", hash_secret(secrets["boss"]), frozenset({"admin", "inference"})),
    }
    write_keys(tmp_path / "keys.toml", keys)
    _, tok = hf(tei_dir, "tiny-rerank")
    rows = sum(len(tok(QUERY, text)["input_ids"]) for text in TEXTS)
    settings = settings_for(tei_dir, rerank_model="tiny-rerank", keys_file=tmp_path / "keys.toml")
    async with serve_app(settings) as c:
        # the model loaded first by another key: a load is charged to the key that causes it
        assert (
            await c.post("/rerank", json={"query": QUERY, "texts": TEXTS}, headers=bearer(secrets["boss"]))
        ).status_code == 200
        r = await c.post("/rerank", json={"query": QUERY, "texts": TEXTS}, headers=bearer(secrets["metered"]))
        assert r.status_code == 200
        usage = (await c.get("/usage", headers=bearer(secrets["boss"]))).json()["keys"]
    assert usage["metered"] == {"requests": 1, "tokens": rows, "rate_limited": 0, "job_seconds": 0.0}


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


async def test_rerank_truncation_both_directions(tei, tei_dir):
    model, tok = hf(tei_dir, "tiny-rerank")
    long_text = " ".join(["dog", "cat"] * 30)  # 60 tokens; the tiny models take 32
    r = await tei.post("/rerank", json={"query": QUERY, "texts": [long_text]})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "input 0 is 70 tokens long, more than the 32 model 'tiny-rerank' takes; shorten it or send \"truncate\": true",
    )
    for direction in ("Right", "Left", "left"):
        tok.truncation_side = direction.lower()
        expected = hf_logits(model, tok, [QUERY], [long_text], truncation="longest_first", max_length=32)
        r = await tei.post(
            "/rerank",
            json={
                "query": QUERY,
                "texts": [long_text],
                "truncate": True,
                "truncation_direction": direction,
                "raw_scores": True,
            },
        )
        assert r.status_code == 200, r.json()
        assert r.json()[0]["score"] == pytest.approx(expected[0, 0].item(), abs=1e-5), direction
    scores = []
    for direction in ("Left", "Right"):  # the texts' ends differ: so do the answers
        r = await tei.post(
            "/rerank",
            json={
                "query": "dog",
                "texts": [long_text + " house"],
                "truncate": True,
                "truncation_direction": direction,
                "raw_scores": True,
            },
        )
        scores.append(r.json()[0]["score"])
    assert scores[0] != scores[1]


async def test_rerank_needs_a_one_label_classifier(tei):
    r = await tei.post("/rerank", json={"query": "q", "texts": ["a"], "model": "tiny-cls"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "model 'tiny-cls' is not a re-ranker: /rerank needs a sequence classifier "
        "with one label (a cross-encoder), and it has 2",
    )
    r = await tei.post("/rerank", json={"query": "q", "texts": ["a"], "model": "tiny-enc"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation", "model 'tiny-enc' has no classifier head, which /rerank needs (it is a BertModel; heads: none)"
    )


async def test_rerank_limits_and_empty_texts(tei):
    r = await tei.post("/rerank", json={"query": "q", "texts": []})
    assert r.status_code == 422
    assert r.json() == err("validation", "texts: List should have at least 1 item after validation, not 0")
    r = await tei.post("/rerank", json={"query": "q", "texts": ["a"] * 65})
    assert r.status_code == 422 and r.json() == err("validation", "at most 64 inputs per request, got 65")


async def test_rerank_tokens_limit(tei_dir):
    async with serve_app(settings_for(tei_dir, rerank_model="tiny-rerank", max_request_tokens=20)) as c:
        r = await c.post("/rerank", json={"query": "the fox", "texts": ["a red car", "the fox ran", "a dog"]})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "the request is 23 tokens long (all inputs together), more than the 20 that BERT_MAX_REQUEST_TOKENS allows",
    )


async def test_rerank_counts_the_untruncated_query_once_and_refuses_a_huge_one(tei_dir):
    """The reproduction, scaled to the tiny models (32 positions): a query far longer than the model takes,
    truncated per pair, used to pass the token limit (only the truncated pairs counted) while the query was
    tokenized in full once per text."""
    query = "the fox " * 30  # 60 tokens
    async with serve_app(settings_for(tei_dir, rerank_model="tiny-rerank", max_request_tokens=50)) as c:
        r = await c.post("/rerank", json={"query": query, "texts": ["b"], "truncate": True})
        assert r.status_code == 422
        assert r.json() == err(
            "validation",
            "the request is 60 tokens long (before truncation: the query once and "
            "every text), more than the 50 that BERT_MAX_REQUEST_TOKENS allows",
        )
        r = await c.post("/", json={"query": query, "texts": ["b"] * 64, "truncate": True, "model": "tiny-rerank"})
        assert r.status_code == 422 and "the request is 60 tokens long (before truncation" in r.json()["error"]
        r = await c.post("/rerank", json={"query": "the fox " * 20, "texts": ["a dog"], "truncate": True})
        assert r.status_code == 200  # 40 + 2 tokens before truncation; one 32-token pair


async def test_rerank_tokenizes_the_query_once(tei, monkeypatch):
    lm = await tei.app.state.service.loaded_model("tiny-rerank")
    seen = []
    for name in ("encode", "token_ids"):  # per pair; per text
        original = getattr(lm.tokenizer, name)
        monkeypatch.setattr(
            lm.tokenizer, name, lambda *a, _original=original, **kw: seen.append(a[0]) or _original(*a, **kw)
        )
    for truncate in (False, True):
        seen.clear()
        r = await tei.post("/rerank", json={"query": QUERY, "texts": TEXTS, "truncate": truncate})
        assert r.status_code == 200
        assert seen.count(QUERY) == 1 and sorted(set(seen) - {QUERY}) == sorted(TEXTS)


async def test_rerank_work_stops_between_texts_when_the_client_leaves(tei_dir, monkeypatch):
    settings = settings_for(tei_dir, rerank_model="tiny-rerank", tokenizer_threads=1)
    async with serve_app(settings) as c:
        service = c.app.state.service
        lm = await service.loaded_model("tiny-rerank")
        held = HeldTokenizer(lm.tokenizer.token_ids)
        monkeypatch.setattr(lm.tokenizer, "token_ids", held)
        request = RawRequest(c.app, "/rerank", {"query": QUERY, "texts": TEXTS, "truncate": True})
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(request.run)
                await until(held.entered.is_set)  # tokenizing the query
                request.leave()
                await until(request.done.is_set)
        finally:
            held.gate.set()
        await service.off_loop(lambda: None)  # after the dropped job: the pool has one thread
        assert request.sent == [] and held.texts == [QUERY]


# -- /predict -----------------------------------------------------------------------------------


async def test_predict_shapes_and_scores_as_tei(tei, tei_dir):
    model, tok = hf(tei_dir, "tiny-cls")
    single = (await tei.post("/predict", json={"inputs": "I like you. I love you"})).json()  # TEI's README
    expected = hf_logits(model, tok, ["I like you. I love you"]).softmax(-1)[0].tolist()
    assert [p["label"] for p in single] == sorted(
        ["negative", "positive"], key=lambda n: -expected[["negative", "positive"].index(n)]
    )
    assert {p["label"]: p["score"] for p in single} == pytest.approx(
        dict(zip(["negative", "positive"], expected)), abs=1e-5
    )
    pair = (await tei.post("/predict", json={"inputs": ["a man eats food", "a woman ate"]})).json()  # ONE pair
    pair_logits = hf_logits(model, tok, ["a man eats food"], ["a woman ate"])[0]
    assert isinstance(pair[0], dict)
    assert {p["label"]: p["score"] for p in pair} == pytest.approx(
        dict(zip(["negative", "positive"], pair_logits.softmax(-1).tolist())), abs=1e-5
    )
    batch = (
        await tei.post(
            "/predict", json={"inputs": [["a man eats food"], ["a man eats food", "a woman ate"]], "raw_scores": True}
        )
    ).json()
    assert len(batch) == 2 and all(isinstance(b, list) for b in batch)
    assert {p["label"]: p["score"] for p in batch[1]} == pytest.approx(
        dict(zip(["negative", "positive"], pair_logits.tolist())), abs=1e-5
    )
    assert [p["score"] for p in batch[1]] == sorted((p["score"] for p in batch[1]), reverse=True)


async def test_predict_one_label_model_is_sigmoid(tei, tei_dir):
    model, tok = hf(tei_dir, "tiny-rerank")
    r = await tei.post("/predict", json={"inputs": ["the fox", "a red car"], "model": "tiny-rerank"})
    assert r.json() == [
        {
            "score": pytest.approx(hf_logits(model, tok, ["the fox"], ["a red car"])[0, 0].sigmoid().item(), abs=1e-5),
            "label": "LABEL_0",
        }
    ]


async def test_answers_of_a_model_with_many_labels_hold_the_best_few(tei, tei_dir):
    model, tok = hf(tei_dir, "tiny-many")
    probs = hf_logits(model, tok, ["the fox"]).softmax(-1)[0]
    best = probs.argsort(descending=True).tolist()
    name = lambda i: f"class-{i}"  # noqa: E731
    classify = (await tei.post("/classify", json={"inputs": "the fox", "model": "tiny-many"})).json()
    assert list(classify["scores"]) == [name(i) for i in best[:100]]  # the default: BERT_MAX_LABEL_SCORES, best first
    assert classify["label"] == name(best[0]) and classify["score"] == pytest.approx(probs[best[0]].item(), abs=1e-5)
    three = (await tei.post("/classify", json={"inputs": ["the fox"], "model": "tiny-many", "top_k": 3})).json()
    assert three[0]["scores"] == pytest.approx({name(i): probs[i].item() for i in best[:3]}, abs=1e-5)
    predict = (await tei.post("/predict", json={"inputs": "the fox", "model": "tiny-many", "top_k": 2})).json()
    assert predict == [{"score": pytest.approx(probs[i].item(), abs=1e-5), "label": name(i)} for i in best[:2]]
    assert len((await tei.post("/predict", json={"inputs": "the fox", "model": "tiny-many"})).json()) == 100
    for path in ("/classify", "/predict"):
        r = await tei.post(path, json={"inputs": "the fox", "model": "tiny-many", "top_k": 101})
        assert (r.status_code, r.json()) == (
            422,
            err(
                "validation", "top_k: 101 label scores per input is more than the 100 that BERT_MAX_LABEL_SCORES allows"
            ),
        )
    # A model with fewer labels than top_k answers them all, in id order on /classify.
    few = (await tei.post("/classify", json={"inputs": "the fox", "model": "tiny-cls", "top_k": 1000})).json()
    assert list(few["scores"]) == ["negative", "positive"]


async def test_predict_refuses_bad_inputs_and_models(tei):
    r = await tei.post("/predict", json={"inputs": ["a", "b", "c"]})
    assert r.status_code == 422
    r = await tei.post("/predict", json={"inputs": "the cat", "model": "tiny-enc"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation", "model 'tiny-enc' has no classifier head, which /predict needs (it is a BertModel; heads: none)"
    )


# -- /embed -------------------------------------------------------------------------------------


async def test_embed_is_a_list_of_vectors_as_tei(tei):
    r = await tei.post("/embed", json={"inputs": "What is Deep Learning?"})  # TEI's README
    assert r.status_code == 200
    body = r.json()
    assert len(body) == 1 and len(body[0]) == 32
    assert sum(x * x for x in body[0]) == pytest.approx(1.0, abs=1e-5)  # normalize defaults to true
    ours = (await tei.post("/embeddings", json={"inputs": "What is Deep Learning?"})).json()
    assert body[0] == pytest.approx(ours, abs=1e-6)
    raw = (await tei.post("/embed", json={"inputs": ["the cat", "a dog"], "normalize": False, "truncate": None})).json()
    ours = (await tei.post("/embeddings", json={"inputs": ["the cat", "a dog"], "normalize": False})).json()
    assert len(raw) == 2 and all(a == pytest.approx(b, abs=1e-6) for a, b in zip(raw, ours))


async def test_embed_left_truncation_and_prompt_name(tei, tei_dir):
    model, tok = hf(tei_dir, "tiny-enc", "BertModel")
    text = " ".join(["dog"] * 20 + ["cat"] * 20)
    tok.truncation_side = "left"
    enc = tok([text], truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        expected = torch.nn.functional.normalize(model(**enc).last_hidden_state.mean(1), dim=-1)[0]
    r = await tei.post(
        "/embed", json={"inputs": text, "truncate": True, "truncation_direction": "Left", "model": "tiny-enc"}
    )
    assert r.json()[0] == pytest.approx(expected.tolist(), abs=1e-5)
    r = await tei.post("/embed", json={"inputs": "the cat", "prompt_name": "query"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "prompt_name 'query' is not supported: model 'tiny-pt' has no prompts; put "
        "the prompt at the start of the text instead",
    )


async def test_tei_requests_ignore_unknown_fields_but_not_wrong_types(tei):
    r = await tei.post("/embed", json={"inputs": "the cat", "dimensions": None, "something_new": 1})
    assert r.status_code == 200
    r = await tei.post("/embed", json={"inputs": "the cat", "normalize": "yes"})
    assert r.status_code == 422 and r.json() == err("validation", "normalize: Input should be a valid boolean")


# -- /tokenize ----------------------------------------------------------------------------------


async def test_tokenize_as_tei(tei, tei_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tei_dir / "models" / "tiny-pt")
    text = "The Quick brown fox jumped, happily!"
    r = await tei.post("/tokenize", json={"inputs": text})
    assert r.status_code == 200
    [tokens] = r.json()
    enc = tok(text, return_offsets_mapping=True)
    assert [t["id"] for t in tokens] == enc["input_ids"]
    assert tokens[0] == {"id": tok.cls_token_id, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[-1] == {"id": tok.sep_token_id, "text": "[SEP]", "special": True, "start": None, "stop": None}
    for t, (start, stop) in zip(tokens[1:-1], enc["offset_mapping"][1:-1]):
        assert t == {"id": t["id"], "text": text[start:stop], "special": False, "start": start, "stop": stop}
    assert [t["text"] for t in tokens[1:4]] == ["The", "Quick", "brown"]  # the input's characters, not lower-cased
    r = await tei.post("/tokenize", json={"inputs": ["the cat", "a dog"], "add_special_tokens": False})
    assert r.json() == [
        [
            {"id": tok.convert_tokens_to_ids("the"), "text": "the", "special": False, "start": 0, "stop": 3},
            {"id": tok.convert_tokens_to_ids("cat"), "text": "cat", "special": False, "start": 4, "stop": 7},
        ],
        [
            {"id": tok.convert_tokens_to_ids("a"), "text": "a", "special": False, "start": 0, "stop": 1},
            {"id": tok.convert_tokens_to_ids("dog"), "text": "dog", "special": False, "start": 2, "stop": 5},
        ],
    ]


async def test_tokenize_limits(tei):
    r = await tei.post("/tokenize", json={"inputs": ["a"] * 65})
    assert r.status_code == 422 and r.json() == err("validation", "at most 64 inputs per request, got 65")
    r = await tei.post("/tokenize", json={"inputs": "a", "model": "nope"})
    assert r.status_code == 404
    assert r.json() == err(
        "not_found", "model 'nope' not found (available: tiny-cls, tiny-enc, tiny-many, tiny-pt, tiny-rerank)"
    )


# -- POST / and /similarity --------------------------------------------------------------------


async def test_post_root_answers_by_the_models_type_as_tei(tei):
    body = {"inputs": "the cat"}
    assert (await tei.post("/", json={**body, "model": "tiny-enc"})).json() == (
        await tei.post("/embed", json={**body, "model": "tiny-enc"})
    ).json()
    assert (await tei.post("/", json={**body, "model": "tiny-cls"})).json() == (
        await tei.post("/predict", json={**body, "model": "tiny-cls"})
    ).json()
    pair = {"query": "the fox", "texts": ["a red car", "the fox ran"], "model": "tiny-rerank"}
    assert (await tei.post("/", json=pair)).json() == (await tei.post("/rerank", json=pair)).json()
    similar = {"inputs": {"source_sentence": "the fox", "sentences": ["a red car", "the fox ran"]}}
    assert (await tei.post("/", json=similar)).json() == (await tei.post("/similarity", json=similar)).json()
    default = (await tei.post("/", json=body)).json()  # BERT_DEFAULT_MODEL, tiny-pt: an encoder with heads
    assert default == (await tei.post("/embed", json=body)).json()


async def test_post_root_errors(tei):
    r = await tei.post("/", json={"query": "the fox", "texts": ["a"], "model": "tiny-cls"})
    assert r.status_code == 422  # a two-label classifier predicts: the body lacks `inputs`
    assert r.json() == err("validation", "inputs: Field required")
    r = await tei.post("/", json=["the cat"])
    assert r.status_code == 422
    assert r.json() == err("validation", "body: Input should be a valid dictionary")
    r = await tei.post("/", json={"inputs": "a", "model": "nope"})
    assert r.status_code == 404
    r = await tei.post("/", json={"inputs": "a", "model": "../" + "x" * 100})
    assert r.status_code == 422
    assert r.json() == err("validation", "model: String should have at most 64 characters")
    r = await tei.get("/")
    assert r.status_code == 405


async def test_similarity_is_the_cosine_of_embed_vectors(tei):
    texts = ["the quick brown fox", "a red car", "the fox ran"]
    vectors = (await tei.post("/embed", json={"inputs": texts})).json()
    r = await tei.post(
        "/similarity", json={"inputs": {"source_sentence": texts[0], "sentences": texts[1:]}, "parameters": None}
    )
    assert r.status_code == 200
    assert r.json() == pytest.approx([sum(a * b for a, b in zip(vectors[0], v)) for v in vectors[1:]], abs=1e-6)
    r = await tei.post(
        "/similarity",
        json={"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"prompt_name": "query"}},
    )
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "prompt_name 'query' is not supported: model 'tiny-pt' has no prompts; put "
        "the prompt at the start of the text instead",
    )


# -- key, engine --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/embed", {"inputs": "a"}),
        ("/predict", {"inputs": "a"}),
        ("/rerank", {"query": "a", "texts": ["b"]}),
        ("/tokenize", {"inputs": "a"}),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
        ("/", {"inputs": "a"}),
    ],
)
async def test_tei_routes_need_the_api_key(tei_dir, path, body):
    key = "tei-key-0123456789abcdef"
    async with serve_app(settings_for(tei_dir, api_key=key, rerank_model="tiny-rerank", predict_model="tiny-cls")) as c:
        r = await c.post(path, json=body)
        assert r.status_code == 401
        assert r.json() == err("unauthorized", "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'")
        assert (await c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})).status_code == 200


def test_classify_runner_gives_logits_to_rows_that_ask_in_a_mixed_batch(tei_dir, tokenizer):
    from app.serving.engine import Engine
    from app.serving.stored_models import LoadedModel

    model = BertForSequenceClassification.from_pretrained(tei_dir / "models" / "tiny-cls").eval()
    lm = LoadedModel("tiny-cls", model, tokenizer, 32)
    rows = [(ids, [0] * len(ids)) for ids in (tokenizer.encode(t)["input_ids"] for t in ("the cat", "a dog"))]
    items = [WorkItem("classify", lm, rows[:1], {"logits": True}), WorkItem("classify", lm, rows[1:], {})]
    engine = Engine(
        torch.device("cpu"),
        {"classify": run_classify},
        max_batch_tokens=4096,
        max_queue=8,
        max_wait_ms=50.0,
        batching=True,
    )
    engine.start()
    try:
        futures = [engine.submit(item) for item in items]
        raw, scored = (f.result(timeout=10)[0] for f in futures)
    finally:
        engine.stop(5.0)
    with torch.no_grad():
        expect_raw = model(torch.tensor([rows[0][0]])).logits[0]
        expect_scored = model(torch.tensor([rows[1][0]])).logits[0].softmax(-1)
    assert raw == pytest.approx(expect_raw.tolist(), abs=1e-5)
    assert scored == pytest.approx(expect_scored.tolist(), abs=1e-5)
