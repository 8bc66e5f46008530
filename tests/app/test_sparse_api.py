"""TEI's /embed_sparse, /embed_all and /decode over real ASGI: SPLADE vectors against transformers'
BertForMaskedLM logits and sentence-transformers' SparseEncoder on the same weights (several requests in
one pass, ragged and long inputs), token embeddings against BertModel's last hidden states, decode against
the tokenizer's, the dense routes' refusal of a sparse model and every bound with its exact body.

Models: tiny-splade (BertForMaskedLM saved by sentence-transformers as a SparseEncoder), tiny-mlm (a
BertForMaskedLM without sparse files), tiny-enc (BertModel), tiny-pt; tiny-splade is the default."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.app.conftest import MAX_POSITIONS, VOCAB, save_tiny, serve_app, settings_for
from tests.model.test_sparse import save_sparse_encoder

pytestmark = pytest.mark.anyio
transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

LIMIT = 1840  # BERT_MAX_ANSWER_VALUES here: 20 inputs x the 92-token vocabulary; 57 tokens x 32 floats
TEXTS = [
    "the quick brown fox jumped over the lazy dog and the cat sat on the mat in paris , france",
    "a red car",
    "she ate food",
    "the",
    "penguins can not fly but they eat fish in the sea",
]
SPARSE_ERROR = (
    "model 'tiny-splade' is a sparse (SPLADE) encoder: its embeddings hold one weight per vocabulary token (92), "
    "which POST /embed_sparse answers, not the dense embedding routes"
)


def err(message: str) -> dict:
    return {"error": message, "error_type": "validation"}


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    from model.modeling import BertForMaskedLM, BertForPreTraining, BertModel

    root = tmp_path_factory.mktemp("sparse")
    save_tiny(root / "hf-mlm", BertForMaskedLM, seed=11)
    save_sparse_encoder(root / "hf-mlm", root / "models" / "tiny-splade")
    save_tiny(root / "models" / "tiny-mlm", BertForMaskedLM, seed=12)
    save_tiny(root / "models" / "tiny-enc", BertModel, seed=13)
    save_tiny(root / "models" / "tiny-pt", BertForPreTraining, seed=14)
    return root


@pytest.fixture(scope="module")
async def client(sparse_dir):
    async with serve_app(settings_for(sparse_dir, default_model="tiny-splade", max_answer_values=LIMIT)) as c:
        yield c


def reference(path, texts: list[str]) -> list[dict[int, float]]:
    """max over the kept tokens of log(1 + relu(logit)), from transformers' BertForMaskedLM: {index: value}."""
    model = transformers.BertForMaskedLM.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    vectors = torch.log1p(torch.relu(logits)).masked_fill(batch["attention_mask"][..., None] == 0, 0).amax(1)
    return [{i: row[i].item() for i in row.nonzero().squeeze(1).tolist()} for row in vectors]


def assert_matches(answer: list[dict], expected: dict[int, float]) -> None:
    assert [e["index"] for e in answer] == sorted(expected)  # zeros dropped, by index, as TEI
    for e in answer:
        assert set(e) == {"index", "value"}
        assert e["value"] == pytest.approx(expected[e["index"]], abs=1e-5)


async def test_sparse_vectors_equal_transformers_logits_with_requests_batched_together(client, sparse_dir):
    expected = reference(sparse_dir / "models" / "tiny-splade", TEXTS)
    bodies = [{"inputs": TEXTS[:2]}, {"inputs": TEXTS[2]}, {"inputs": TEXTS[3:], "model": "tiny-splade"}]
    answers = await asyncio.gather(*(client.post("/embed_sparse", json=b) for b in bodies))
    assert [r.status_code for r in answers] == [200, 200, 200]
    vectors = [v for r in answers for v in r.json()]
    assert len(vectors) == len(TEXTS)
    for answer, want in zip(vectors, expected):
        assert_matches(answer, want)


async def test_sparse_vectors_equal_sentence_transformers_sparse_encoder(client, sparse_dir):
    encoder = sentence_transformers.SparseEncoder(str(sparse_dir / "models" / "tiny-splade"), device="cpu")
    dense = encoder.encode(TEXTS, convert_to_tensor=True).to_dense()
    r = await client.post("/embed_sparse", json={"inputs": TEXTS, "model": "tiny-splade"})
    assert r.status_code == 200
    for answer, row in zip(r.json(), dense):
        assert_matches(answer, {i: row[i].item() for i in row.nonzero().squeeze(1).tolist()})


async def test_long_inputs_truncate_at_the_window_as_asked(client, sparse_dir):
    long = " ".join(["the cat sat on the mat"] * 20)
    r = await client.post("/embed_sparse", json={"inputs": [long, "a dog"]})
    assert r.status_code == 422
    assert r.json() == err(
        "input 0 is 122 tokens long, more than the 32 model 'tiny-splade' takes; shorten it or send \"truncate\": true"
    )
    r = await client.post("/embed_sparse", json={"inputs": [long, "a dog"], "truncate": True})
    tok = transformers.AutoTokenizer.from_pretrained(sparse_dir / "models" / "tiny-splade")
    cut = tok.decode(tok(long, truncation=True, max_length=MAX_POSITIONS)["input_ids"], skip_special_tokens=True)
    for answer, want in zip(r.json(), reference(sparse_dir / "models" / "tiny-splade", [cut, "a dog"])):
        assert_matches(answer, want)
    body = {"inputs": [long + " paris", "a dog"], "truncate": True, "truncation_direction": "Left"}
    r = await client.post("/embed_sparse", json=body)
    tok.truncation_side = "left"
    cut = tok.decode(
        tok(long + " paris", truncation=True, max_length=MAX_POSITIONS)["input_ids"], skip_special_tokens=True
    )
    assert cut.endswith("mat paris")
    for answer, want in zip(r.json(), reference(sparse_dir / "models" / "tiny-splade", [cut, "a dog"])):
        assert_matches(answer, want)


async def test_threshold_top_k_and_tokens(client, sparse_dir):
    (expected,) = reference(sparse_dir / "models" / "tiny-splade", [TEXTS[0]])
    r = await client.post("/embed_sparse", json={"inputs": TEXTS[0], "threshold": 1.0})
    assert_matches(r.json()[0], {i: v for i, v in expected.items() if v > 1.0})
    r = await client.post("/embed_sparse", json={"inputs": TEXTS[0], "top_k": 5, "return_tokens": True})
    best = sorted(expected.items(), key=lambda e: (-e[1], e[0]))[:5]
    answer = r.json()[0]
    assert [e["index"] for e in answer] == [i for i, _ in best]  # largest first
    assert [e["token"] for e in answer] == [VOCAB[i] for i, _ in best]
    assert [e["value"] for e in answer] == pytest.approx([v for _, v in best], abs=1e-5)


async def test_a_masked_lm_model_pools_by_splade_when_asked(client, sparse_dir):
    r = await client.post("/embed_sparse", json={"inputs": TEXTS[:2], "model": "tiny-mlm"})
    assert r.status_code == 422
    assert r.json() == err(
        'model \'tiny-mlm\' is not a SPLADE model (/embed pools its embeddings); send "pooling": "splade" to pool '
        "its masked-LM logits so anyway"
    )
    r = await client.post("/embed_sparse", json={"inputs": TEXTS[:2], "model": "tiny-mlm", "pooling": "splade"})
    for answer, want in zip(r.json(), reference(sparse_dir / "models" / "tiny-mlm", TEXTS[:2])):
        assert_matches(answer, want)
    r = await client.post("/embed_sparse", json={"inputs": "a", "model": "tiny-enc", "pooling": "splade"})
    assert r.status_code == 422
    assert r.json() == err(
        "model 'tiny-enc' has no masked-LM (mlm) head, which /embed_sparse needs (it is a BertModel; heads: none)"
    )


async def test_the_sparse_answer_is_bounded_before_the_model_runs(client):
    r = await client.post("/embed_sparse", json={"inputs": ["a"] * 21, "model": "tiny-splade"})
    assert r.status_code == 422
    assert r.json() == err(
        "the answer may hold 1,932 entries (21 inputs x 92, the vocabulary's tokens), more than the 1,840 "
        "BERT_MAX_ANSWER_VALUES allows; send fewer inputs or a smaller top_k"
    )
    r = await client.post("/embed_sparse", json={"inputs": ["a"] * 21, "model": "tiny-splade", "top_k": 87})
    assert r.status_code == 200  # 21 x 87 = 1,827 entries at most
    assert len(r.json()) == 21 and all(len(v) <= 87 for v in r.json())


@pytest.mark.parametrize(
    ("path", "body", "answer"),
    [
        ("/embeddings", {"inputs": "a"}, err(SPARSE_ERROR)),
        ("/embed", {"inputs": "a"}, err(SPARSE_ERROR)),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, err(SPARSE_ERROR)),
        (
            "/v1/embeddings",
            {"input": "a"},
            {"error": {"message": SPARSE_ERROR, "type": "invalid_request_error", "param": None, "code": None}},
        ),
    ],
)
async def test_the_dense_routes_refuse_a_sparse_model(client, path, body, answer):
    r = await client.post(path, json={**body, "model": "tiny-splade"})
    assert r.status_code == 422
    assert r.json() == answer


async def test_post_root_of_a_sparse_model_is_embed_sparse(client):
    root = await client.post("/", json={"inputs": TEXTS[1], "model": "tiny-splade"})
    direct = await client.post("/embed_sparse", json={"inputs": TEXTS[1], "model": "tiny-splade"})
    assert root.status_code == 200
    assert root.json() == direct.json()


async def test_models_show_the_pooling(client):
    models = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
    assert (models["tiny-splade"]["pooling"], models["tiny-splade"]["normalize"]) == (["splade"], False)
    assert (models["tiny-mlm"]["pooling"], models["tiny-mlm"]["normalize"]) == (["mean"], True)


async def test_embed_all_equals_the_encoders_last_hidden_states(client, sparse_dir):
    path = sparse_dir / "models" / "tiny-enc"
    model, tok = transformers.BertModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(path)
    texts = [TEXTS[1], TEXTS[2], TEXTS[3]]
    r = await client.post("/embed_all", json={"inputs": texts, "model": "tiny-enc"})
    assert r.status_code == 200
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    for answer, row, n in zip(r.json(), hidden, batch["attention_mask"].sum(1).tolist()):
        assert len(answer) == n  # every real token, [CLS] and [SEP] included, no padding
        torch.testing.assert_close(torch.tensor(answer), row[:n], atol=1e-5, rtol=0)


async def test_embed_all_is_bounded_with_the_numbers(client):
    r = await client.post("/embed_all", json={"inputs": [TEXTS[0]] * 3, "model": "tiny-enc"})
    assert r.status_code == 422
    assert r.json() == err(
        "the answer would hold 2,112 numbers (66 tokens x 32 hidden size), more than the 1,840 "
        "BERT_MAX_ANSWER_VALUES allows; send fewer or shorter inputs"
    )
    r = await client.post("/embed_all", json={"inputs": [TEXTS[0]] * 2, "model": "tiny-enc"})
    assert r.status_code == 200  # 44 x 32 = 1,408


async def test_decode_equals_the_tokenizers_decode(client, sparse_dir):
    tok = transformers.AutoTokenizer.from_pretrained(sparse_dir / "models" / "tiny-splade")
    ids = [tok(t)["input_ids"] for t in TEXTS[:3]]
    r = await client.post("/decode", json={"ids": ids})
    assert r.status_code == 200
    assert r.json() == [tok.decode(i, skip_special_tokens=True) for i in ids]
    r = await client.post("/decode", json={"ids": ids[0], "skip_special_tokens": False})
    assert r.json() == [tok.decode(ids[0], skip_special_tokens=False)]
    r = await client.post("/decode", json={"ids": [2, 92, 3]})
    assert r.status_code == 422
    assert r.json() == err(
        "ids 0: 92 is not a token id of model 'tiny-splade', whose vocabulary has 92 tokens (ids 0 to 91)"
    )
    r = await client.post("/decode", json={"ids": [[2]] * 65})
    assert r.status_code == 422
    assert r.json() == err("at most 64 inputs per request, got 65")


def test_requests_with_different_options_share_one_pass(sparse_dir):
    """Three work items (threshold, top_k, neither), ragged, queued before the engine starts: one pass runs
    them all, and each row gets its own options, equal to transformers' logits pooled."""
    from app.serving.engine import Engine, WorkItem
    from app.serving.forward import run_sparse_encode
    from app.serving.stored_models import LoadedModel
    from model.modeling import load_model
    from model.sentence_modules import read_sentence_modules
    from model.tokenizer import BertTokenizer

    path = sparse_dir / "models" / "tiny-splade"
    tok = BertTokenizer.from_pretrained(path)
    lm = LoadedModel("tiny-splade", load_model(path).eval(), tok, MAX_POSITIONS)
    lm.sentence_modules = read_sentence_modules(path)
    rows = [(ids, [0] * len(ids)) for ids in (tok.encode(t)["input_ids"] for t in TEXTS)]
    params = [{"threshold": 1.0}, {"threshold": 0.0, "top_k": 4}, {"threshold": 0.0}]
    items = [WorkItem("sparse_encode", lm, rows[i : i + 2], p) for i, p in zip((0, 2, 4), params)]
    passes = []

    def runner(lm, batch):
        passes.append(len(batch.origin))
        return run_sparse_encode(lm, batch)

    engine = Engine(
        torch.device("cpu"),
        {"sparse_encode": runner},
        max_batch_tokens=4096,
        max_queue=8,
        max_wait_ms=50.0,
        batching=True,
    )
    futures = [engine.submit(item) for item in items]
    engine.start()
    try:
        answers = [f.result(timeout=30) for f in futures]
    finally:
        engine.stop(5.0)
    assert passes == [len(TEXTS)]
    expected = reference(path, TEXTS)
    by_threshold = [{i: v for i, v in e.items() if v > 1.0} for e in expected[:2]]
    best = [dict(sorted(e.items(), key=lambda x: (-x[1], x[0]))[:4]) for e in expected[2:4]]
    for (indices, values), want in zip([*answers[0], *answers[2]], [*by_threshold, expected[4]]):
        assert indices == sorted(want) and values == pytest.approx([want[i] for i in indices], abs=1e-5)
    for (indices, values), want in zip(answers[1], best):
        assert indices == list(want) and values == pytest.approx(list(want.values()), abs=1e-5)
