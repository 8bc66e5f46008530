"""POST /token-classification and POST /question-answering over real ASGI: equal to transformers on
the same weights, and this service's errors, limits and key.

/token-classification is compared with transformers' own token-classification pipeline (every
aggregation strategy, offsets included). transformers 5 removed the question-answering pipeline, so
`qa_reference` below is transformers 4.x's QuestionAnsweringPipeline post-processing (preprocess's
windows and p_mask, select_starts_ends, decode_spans, get_indices), run on transformers'
BertForQuestionAnswering logits and its fast tokenizer's windows.

Models (tiny, random): tiny-ner (BertForTokenClassification, labels O B-PER I-PER B-LOC I-LOC),
tiny-qa (BertForQuestionAnswering), tiny-cls (a sequence classifier: the wrong head for both).
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from model.modeling import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from model.tokenizer import BertTokenizer
from tests.app.conftest import MAX_POSITIONS, VOCAB, save_tiny, serve_app, settings_for, tiny_config

pytestmark = pytest.mark.anyio
transformers = pytest.importorskip("transformers")

NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
TEXTS = [
    "the quick brown fox jumped over the lazy dog",
    "Paris is the capital of France!",
    "the cats and dogs went to paris",
    "Zebras ran to the big city , she said",
    "happily he bought milk",
]
STRATEGIES = ["none", "simple", "first", "average", "max"]
QUESTION = "where did the fox go ?"
LONG_CONTEXT = (
    "the quick brown fox jumped over the lazy dog and went to paris . the cat sat on the mat in the "
    "house . she bought milk from the store and the dogs ran to the big city by the river in france . "
    "a man ate food with a child"
)


def err(kind: str, message: str) -> dict:
    return {"error": message, "error_type": kind}


def save_null_favouring_qa(path) -> None:
    """A QA model whose [CLS] scores high: [CLS] is the only allowed token of segment 0, so a large
    segment-0 direction that the QA head reads makes the empty answer likely (a "no answer" model)."""
    torch.manual_seed(6)
    model = BertForQuestionAnswering(tiny_config()).eval()
    direction = torch.nn.functional.normalize(torch.randn(model.config.hidden_size), dim=0)
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight[0] = 10 * direction
        model.bert.embeddings.token_type_embeddings.weight[1] = -10 * direction
        model.qa_outputs.weight[:] = 3 * direction
    model.save_pretrained(path, tokenizer=BertTokenizer.from_vocab(VOCAB))


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    save_tiny(root / "models" / "tiny-ner", BertForTokenClassification, seed=3, id2label=NER_LABELS)
    save_tiny(root / "models" / "tiny-qa", BertForQuestionAnswering, seed=4)
    save_null_favouring_qa(root / "models" / "tiny-qa-null")
    save_tiny(
        root / "models" / "tiny-cls", BertForSequenceClassification, seed=5, id2label={0: "negative", 1: "positive"}
    )
    return root


@pytest.fixture(scope="module")
async def svc(tasks_dir):
    async with serve_app(settings_for(tasks_dir, default_model="tiny-ner")) as c:
        yield c


def hf(tasks_dir, name: str, cls_name: str):
    path = tasks_dir / "models" / name
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.model_max_length = MAX_POSITIONS  # the pipelines' windows and truncation follow it
    return getattr(transformers, cls_name).from_pretrained(path).eval(), tok


def assert_same(ours, theirs) -> None:
    """Same entries, in the same order with the same keys; scores within 1e-5."""
    assert len(ours) == len(theirs), (ours, theirs)
    for a, b in zip(ours, theirs):
        assert list(a) == list(b), (a, b)
        for key in a:
            if key == "score":
                assert a[key] == pytest.approx(float(b[key]), abs=1e-5)
            else:
                assert a[key] == b[key], (key, a, b)


# -- /token-classification ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ignore", [None, []])
async def test_token_classification_equals_transformers_pipeline(svc, tasks_dir, strategy, ignore):
    model, tok = hf(tasks_dir, "tiny-ner", "BertForTokenClassification")
    pipe = transformers.pipeline("token-classification", model=model, tokenizer=tok, aggregation_strategy=strategy)
    options = {} if ignore is None else {"ignore_labels": ignore}
    expected = pipe(TEXTS, **options)
    r = await svc.post(
        "/token-classification",
        json={"inputs": TEXTS, "model": "tiny-ner", "aggregation_strategy": strategy, **options},
    )
    assert r.status_code == 200, r.json()
    body = r.json()
    assert len(body) == len(TEXTS)
    for ours, theirs in zip(body, expected):
        assert_same(ours, theirs)
    if ignore == [] and strategy == "none":  # every token answered, sub-words and [UNK] included
        words = [e["word"] for e in body[2]] + [e["word"] for e in body[3]]
        assert "##s" in words and "Zebras" in words


async def test_token_classification_one_text_answers_one_list(svc, tasks_dir):
    model, tok = hf(tasks_dir, "tiny-ner", "BertForTokenClassification")
    pipe = transformers.pipeline("token-classification", model=model, tokenizer=tok, aggregation_strategy="simple")
    r = await svc.post(
        "/token-classification",
        json={"inputs": TEXTS[1], "model": "tiny-ner", "aggregation_strategy": "simple", "ignore_labels": []},
    )
    assert r.status_code == 200
    assert_same(r.json(), pipe(TEXTS[1], ignore_labels=[]))
    assert {e["entity_group"] for e in r.json()} - {"O", "PER", "LOC"} == set()


async def test_token_classification_long_input_422_unless_truncated(svc, tasks_dir):
    long_text = " ".join(["dog", "cat"] * 20)
    r = await svc.post("/token-classification", json={"inputs": ["a dog", long_text], "model": "tiny-ner"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "input 1 is 42 tokens long, more than the 32 model 'tiny-ner' takes; shorten it or send \"truncate\": true",
    )
    model, tok = hf(tasks_dir, "tiny-ner", "BertForTokenClassification")
    pipe = transformers.pipeline("token-classification", model=model, tokenizer=tok)
    r = await svc.post(
        "/token-classification", json={"inputs": long_text, "model": "tiny-ner", "truncate": True, "ignore_labels": []}
    )
    assert r.status_code == 200
    assert_same(r.json(), pipe(long_text, ignore_labels=[]))
    assert len(r.json()) == 30


LONG_TEXT = " ".join(
    [
        "the quick brown fox jumped over the lazy dog and went to paris . the cats sat on the mat",
        "in the house . Zebras bought milk from the store and the dogs ran to the big city by the river",
        "in france",
    ]
    * 2
)


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
@pytest.mark.parametrize("stride", [0, 5, 20])
async def test_token_classification_stride_reads_the_whole_text_as_transformers(svc, tasks_dir, strategy, stride):
    model, tok = hf(tasks_dir, "tiny-ner", "BertForTokenClassification")
    assert len(tok(LONG_TEXT)["input_ids"]) > 2 * MAX_POSITIONS  # three windows or more
    pipe = transformers.pipeline(
        "token-classification", model=model, tokenizer=tok, aggregation_strategy=strategy, stride=stride
    )
    r = await svc.post(
        "/token-classification",
        json={
            "inputs": [LONG_TEXT, "a dog"],
            "model": "tiny-ner",
            "aggregation_strategy": strategy,
            "stride": stride,
            "ignore_labels": [],
        },
    )
    assert r.status_code == 200, r.json()
    assert_same(r.json()[0], pipe(LONG_TEXT, ignore_labels=[]))
    assert_same(r.json()[1], pipe("a dog", ignore_labels=[]))
    assert r.json()[0][-1]["end"] == len(LONG_TEXT)  # read to the end


async def test_token_classification_stride_errors_and_tokens_limit(svc, tasks_dir):
    r = await svc.post("/token-classification", json={"inputs": LONG_TEXT, "model": "tiny-ner", "stride": 4})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "stride reads the whole text in windows, and their entities are merged by "
        "character span: choose an aggregation_strategy other than none",
    )
    r = await svc.post(
        "/token-classification",
        json={"inputs": LONG_TEXT, "model": "tiny-ner", "stride": 30, "aggregation_strategy": "first"},
    )
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "stride 30 must be less than the 30 tokens a window of model 'tiny-ner' holds beside [CLS] and [SEP]",
    )
    _, tok = hf(tasks_dir, "tiny-ner", "BertForTokenClassification")
    tokens = sum(
        map(len, tok(LONG_TEXT, truncation=True, max_length=32, stride=7, return_overflowing_tokens=True)["input_ids"])
    )
    body = {"inputs": LONG_TEXT, "model": "tiny-ner", "stride": 7, "aggregation_strategy": "simple"}
    for limit, status in ((tokens, 200), (tokens - 1, 422)):  # counted exactly, before the windows are made
        async with serve_app(settings_for(tasks_dir, default_model="tiny-ner", max_request_tokens=limit)) as c:
            r = await c.post("/token-classification", json=body)
        assert r.status_code == status, (limit, r.json())
    assert r.json() == err(
        "validation",
        f"the request is {tokens} tokens long (all inputs together), more than "
        f"the {tokens - 1} that BERT_MAX_REQUEST_TOKENS allows",
    )


async def test_token_classification_errors(svc):
    r = await svc.post("/token-classification", json={"inputs": "a dog", "model": "tiny-cls"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "model 'tiny-cls' has no token-classifier (token_classifier) head, which "
        "/token-classification needs (it is a BertForSequenceClassification; "
        "heads: classifier)",
    )
    r = await svc.post(
        "/token-classification", json={"inputs": "a dog", "model": "tiny-ner", "aggregation_strategy": "mean"}
    )
    assert r.status_code == 422
    assert r.json() == err(
        "validation", "aggregation_strategy: Input should be 'none', 'simple', 'first', 'average' or 'max'"
    )
    r = await svc.post("/token-classification", json={"inputs": ["a"] * 65, "model": "tiny-ner"})
    assert r.status_code == 422 and r.json() == err("validation", "at most 64 inputs per request, got 65")


async def test_models_lists_the_new_heads_and_labels(svc):
    models = {m["name"]: m for m in (await svc.get("/models")).json()["models"]}
    assert models["tiny-ner"]["heads"] == ["token_classifier"]
    assert models["tiny-ner"]["labels"] == list(NER_LABELS.values())
    assert models["tiny-qa"]["heads"] == ["qa"]


# -- /question-answering: transformers 4.x's pipeline as the reference --------------------------


def qa_reference(
    model,
    tok,
    question,
    context,
    top_k=1,
    max_answer_len=15,
    handle_impossible_answer=False,
    max_seq_len=None,
    doc_stride=None,
    align_to_words=True,
):
    """transformers 4.x QuestionAnsweringPipeline (preprocess, postprocess) for one question."""
    max_seq_len = max_seq_len or min(tok.model_max_length, 384)
    doc_stride = min(max_seq_len // 2, 128) if doc_stride is None else doc_stride
    encoded = tok(
        text=question,
        text_pair=context,
        padding="do_not_pad",
        truncation="only_second",
        max_length=max_seq_len,
        stride=doc_stride,
        return_token_type_ids=True,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    min_null_score, answers = 1000000, []
    for span in range(len(encoded["input_ids"])):
        input_ids = encoded["input_ids"][span]
        p_mask = np.asarray([tok_ != 1 for tok_ in encoded.sequence_ids(span)])
        p_mask[np.asarray(input_ids) == tok.cls_token_id] = 0
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor([input_ids]),
                token_type_ids=torch.tensor([encoded["token_type_ids"][span]]),
                attention_mask=torch.tensor([encoded["attention_mask"][span]]),
            )
        start, end = out.start_logits.numpy(), out.end_logits.numpy()  # (1, T)
        undesired_tokens = np.abs(np.array(p_mask) - 1) & np.asarray(encoded["attention_mask"][span])
        undesired_tokens_mask = undesired_tokens == 0.0
        start = np.where(undesired_tokens_mask, -10000.0, start)
        end = np.where(undesired_tokens_mask, -10000.0, end)
        start = np.exp(start - start.max(axis=-1, keepdims=True))
        start = start / start.sum()
        end = np.exp(end - end.max(axis=-1, keepdims=True))
        end = end / end.sum()
        if handle_impossible_answer:
            min_null_score = min(min_null_score, (start[0, 0] * end[0, 0]).item())
        start[0, 0] = end[0, 0] = 0.0
        outer = np.matmul(np.expand_dims(start, -1), np.expand_dims(end, 1))
        candidates = np.tril(np.triu(outer), max_answer_len - 1)
        scores_flat = candidates.flatten()
        if top_k == 1:
            idx_sort = [np.argmax(scores_flat)]
        elif len(scores_flat) < top_k:
            idx_sort = np.argsort(-scores_flat)
        else:
            idx = np.argpartition(-scores_flat, top_k)[0:top_k]
            idx_sort = idx[np.argsort(-scores_flat[idx])]
        starts, ends = np.unravel_index(idx_sort, candidates.shape)[1:]
        desired = np.isin(starts, undesired_tokens.nonzero()) & np.isin(ends, undesired_tokens.nonzero())
        starts, ends = starts[desired], ends[desired]
        scores = candidates[0, starts, ends]
        enc = encoded.encodings[span]
        for s, e, score in zip(starts, ends, scores):
            if align_to_words:
                try:
                    start_index = enc.word_to_chars(enc.token_to_word(s), sequence_index=1)[0]
                    end_index = enc.word_to_chars(enc.token_to_word(e), sequence_index=1)[1]
                except Exception:  # noqa: BLE001 (transformers 4.x catches any)
                    start_index, end_index = enc.offsets[s][0], enc.offsets[e][1]
            else:
                start_index, end_index = enc.offsets[s][0], enc.offsets[e][1]
            answers.append(
                {
                    "score": score.item(),
                    "start": start_index,
                    "end": end_index,
                    "answer": context[start_index:end_index],
                }
            )
    if handle_impossible_answer:
        answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
    answers = sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]
    return answers[0] if len(answers) == 1 else answers


def assert_answers(ours, theirs) -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), ours
        ours, theirs = [ours], [theirs]
    assert_same(ours, theirs)


QA_CASES = [
    ("short", "the fox went to paris .", {}),
    ("short top_k", "the fox went to paris .", {"top_k": 4}),
    ("long: windows", LONG_CONTEXT, {}),
    ("long top_k", LONG_CONTEXT, {"top_k": 5, "max_answer_len": 3}),
    ("long impossible", LONG_CONTEXT, {"top_k": 3, "handle_impossible_answer": True}),
    ("small windows", LONG_CONTEXT, {"max_seq_len": 16, "doc_stride": 3, "top_k": 2}),
    ("not aligned", "the cats and dogs went to paris", {"align_to_words": False, "top_k": 6}),
    ("aligned", "the cats and dogs went to paris", {"top_k": 6}),
]


@pytest.mark.parametrize("name,context,options", QA_CASES, ids=[c[0] for c in QA_CASES])
async def test_question_answering_equals_transformers_4_pipeline(svc, tasks_dir, name, context, options):
    model, tok = hf(tasks_dir, "tiny-qa", "BertForQuestionAnswering")
    expected = qa_reference(model, tok, QUESTION, context, **options)
    r = await svc.post(
        "/question-answering", json={"question": QUESTION, "context": context, "model": "tiny-qa", **options}
    )
    assert r.status_code == 200, r.json()
    assert_answers(r.json(), expected)


async def test_question_answering_long_context_has_several_windows(tasks_dir):
    _, tok = hf(tasks_dir, "tiny-qa", "BertForQuestionAnswering")
    windows = tok(
        QUESTION, LONG_CONTEXT, truncation="only_second", max_length=32, stride=16, return_overflowing_tokens=True
    )["input_ids"]
    assert len(windows) >= 4


async def test_question_answering_impossible_answer_can_win(svc, tasks_dir):
    """Where the empty answer ranks first, it is answered as the reference answers it."""
    model, tok = hf(tasks_dir, "tiny-qa-null", "BertForQuestionAnswering")
    contexts = [LONG_CONTEXT] + [" ".join(LONG_CONTEXT.split()[i : i + n]) for n in (2, 3, 5) for i in range(0, 30, 2)]
    winners = [
        c for c in contexts if qa_reference(model, tok, QUESTION, c, handle_impossible_answer=True)["answer"] == ""
    ]
    assert LONG_CONTEXT in winners and len(winners) > 10, winners  # several windows: the lowest [CLS] score
    r = await svc.post(
        "/question-answering",
        json={
            "question": [QUESTION] * len(winners),
            "context": winners,
            "model": "tiny-qa-null",
            "handle_impossible_answer": True,
        },
    )
    assert r.status_code == 200
    assert [a["answer"] for a in r.json()] == [""] * len(winners)
    for ours, context in zip(r.json(), winners):
        assert_answers(ours, qa_reference(model, tok, QUESTION, context, handle_impossible_answer=True))


async def test_question_answering_lists_answer_per_pair(svc, tasks_dir):
    model, tok = hf(tasks_dir, "tiny-qa", "BertForQuestionAnswering")
    questions, contexts = ["who ate food ?", QUESTION], ["a man ate food", LONG_CONTEXT]
    r = await svc.post(
        "/question-answering", json={"question": questions, "context": contexts, "model": "tiny-qa", "top_k": 2}
    )
    assert r.status_code == 200
    for ours, q, c in zip(r.json(), questions, contexts):
        assert_answers(ours, qa_reference(model, tok, q, c, top_k=2))


async def test_question_answering_errors(svc):
    async def post(**body):
        return await svc.post("/question-answering", json={"model": "tiny-qa", **body})

    r = await post(question="where ?", context=["a", "b"])
    assert r.status_code == 422
    assert r.json() == err("validation", "question and context must both be strings, or lists of the same length")
    r = await post(question="where ?", context="  ")
    assert r.status_code == 422 and r.json() == err("validation", "context 0 is empty")
    long_question = " ".join(["the dog"] * 15)
    r = await post(question=long_question, context=LONG_CONTEXT)
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "question 0 is 30 tokens long: with [CLS] and two [SEP] it leaves no room "
        "for the context in a window of max_seq_len 32 tokens",
    )
    r = await post(question=QUESTION, context=LONG_CONTEXT, doc_stride=24)
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "doc_stride 24 must be less than the 23 context tokens that fit in a window beside question 0 (max_seq_len 32)",
    )
    r = await post(question=QUESTION, context="the fox", doc_stride=24)  # one window: nothing to cut
    assert r.status_code == 200
    r = await post(question=QUESTION, context="the fox", max_seq_len=64)
    assert r.status_code == 422
    assert r.json() == err("validation", "max_seq_len is 64, more than the 32 tokens model 'tiny-qa' takes")
    r = await post(question=QUESTION, context="the fox", top_k=0)
    assert r.status_code == 422
    assert r.json() == err("validation", "top_k: Input should be greater than or equal to 1")
    r = await svc.post("/question-answering", json={"question": "q", "context": "c", "model": "tiny-ner"})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "model 'tiny-ner' has no question-answering (qa) head, which "
        "/question-answering needs (it is a BertForTokenClassification; heads: "
        "token_classifier)",
    )


async def test_question_answering_tokens_limit_counts_every_window(tasks_dir):
    async with serve_app(settings_for(tasks_dir, default_model="tiny-qa", max_request_tokens=64)) as c:
        r = await c.post(
            "/question-answering", json={"question": QUESTION, "context": LONG_CONTEXT, "model": "tiny-qa"}
        )
    assert r.status_code == 422
    assert r.json()["error"].startswith("the request is ")
    assert r.json()["error"].endswith(
        "tokens long (all inputs together), more than the 64 that BERT_MAX_REQUEST_TOKENS allows"
    )


# -- key ------------------------------------------------------------------------------------------


async def test_windowed_requests_charge_their_key_each_token_once(tasks_dir, tmp_path):
    """Question answering and token classification with a stride count their windows' tokens as they
    make them (the bound), and charge the key's token rate once, for the rows the model runs: the same
    count the answer's windows hold."""
    secrets = {"metered": new_secret(), "boss": new_secret()}
    keys = {
        "metered": Key("metered", hash_secret(secrets["metered"]), frozenset({"inference"}), tokens_per_min=10**6),
        "boss": Key("boss", hash_secret(secrets["boss"]), frozenset({"admin", "inference"})),
    }
    write_keys(tmp_path / "keys.toml", keys)
    qa = {"question": [QUESTION, QUESTION], "context": [LONG_CONTEXT, LONG_CONTEXT], "model": "tiny-qa"}
    ner = {"inputs": [LONG_TEXT, LONG_TEXT], "model": "tiny-ner", "stride": 7, "aggregation_strategy": "simple"}
    _, qa_tok = hf(tasks_dir, "tiny-qa", "AutoModelForQuestionAnswering")
    qa_windows = qa_tok(
        QUESTION, LONG_CONTEXT, truncation="only_second", max_length=32, stride=16, return_overflowing_tokens=True
    )["input_ids"]
    _, ner_tok = hf(tasks_dir, "tiny-ner", "AutoModelForTokenClassification")
    ner_windows = ner_tok(LONG_TEXT, truncation=True, max_length=32, stride=7, return_overflowing_tokens=True)
    settings = settings_for(tasks_dir, default_model="tiny-ner", keys_file=tmp_path / "keys.toml")
    async with serve_app(settings) as c:
        metered = {"Authorization": f"Bearer {secrets['metered']}"}
        boss = {"Authorization": f"Bearer {secrets['boss']}"}
        for path, body in (("/question-answering", qa), ("/token-classification", ner)):
            # loaded by another key first: a load is charged to the key whose request causes it
            assert (await c.post(path, json=body, headers=boss)).status_code == 200
            assert (await c.post(path, json=body, headers=metered)).status_code == 200
        usage = (await c.get("/usage", headers={"Authorization": f"Bearer {secrets['boss']}"})).json()["keys"]
    ran = 2 * sum(map(len, qa_windows)) + 2 * sum(map(len, ner_windows["input_ids"]))
    assert usage["metered"] == {"requests": 2, "tokens": ran, "rate_limited": 0, "job_seconds": 0.0}


@pytest.mark.parametrize(
    "path,body",
    [
        ("/token-classification", {"inputs": "a dog", "model": "tiny-ner"}),
        ("/question-answering", {"question": "a ?", "context": "a dog", "model": "tiny-qa"}),
    ],
)
async def test_routes_need_the_api_key(tasks_dir, path, body):
    key = "tasks-key-0123456789abcdef"
    async with serve_app(settings_for(tasks_dir, api_key=key, default_model="tiny-ner")) as c:
        r = await c.post(path, json=body)
        assert r.status_code == 401
        assert r.json() == err("unauthorized", "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'")
        assert (await c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})).status_code == 200


# -- the rest of every inference route: text checks, deadline, batching --------------------------


async def test_a_lone_surrogate_is_422(svc):
    r = await svc.post(
        "/token-classification",
        content=rb'{"inputs": ["ok", "a \ud800"], "model": "tiny-ner"}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert r.json() == err("validation", r"inputs[1] is not valid Unicode: lone surrogate '\ud800' at character 2")
    r = await svc.post(
        "/question-answering",
        content=rb'{"question": "q", "context": "\udc00", "model": "tiny-qa"}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert r.json() == err("validation", r"context is not valid Unicode: lone surrogate '\udc00' at character 0")


@pytest.mark.parametrize(
    "path,task,body",
    [
        ("/token-classification", "token_classify", {"inputs": "a dog", "model": "tiny-ner"}),
        ("/question-answering", "qa", {"question": "a ?", "context": "a dog", "model": "tiny-qa"}),
    ],
)
async def test_request_timeout_is_503(tasks_dir, path, task, body):
    async with serve_app(settings_for(tasks_dir, default_model="tiny-ner", request_timeout=0.5)) as c:
        engine, gate = c.app.state.service.engine, threading.Event()
        runner = engine.runners[task]
        engine.runners[task] = lambda lm, batch: (gate.wait(10), runner(lm, batch))[1]
        try:
            r = await c.post(path, json=body)
        finally:
            gate.set()
            engine.runners[task] = runner
    assert r.status_code == 503
    assert r.json() == err(
        "unavailable", "the request took longer than BERT_REQUEST_TIMEOUT (0.5 s); its work was dropped"
    )


async def test_windows_and_texts_are_batched_in_one_pass(svc):
    before = (await svc.get("/metrics")).text
    r = await svc.post("/question-answering", json={"question": QUESTION, "context": LONG_CONTEXT, "model": "tiny-qa"})
    assert r.status_code == 200
    r = await svc.post("/token-classification", json={"inputs": TEXTS, "model": "tiny-ner"})
    assert r.status_code == 200
    after = (await svc.get("/metrics")).text

    def metric(text, name, task):  # passes (count) or rows (sum) of the task's forward passes
        found = re.search(rf'bert_batch_size_{name}\{{model="tiny-\w+",task="{task}"\}} (\S+)', text)
        return 0.0 if found is None else float(found.group(1))

    def passes(text, task):
        return metric(text, "count", task)

    def rows(text, task):
        return metric(text, "sum", task)

    assert rows(after, "token_classify") - rows(before, "token_classify") == len(TEXTS)
    assert rows(after, "qa") - rows(before, "qa") >= 4  # the windows of one question
    assert passes(after, "qa") - passes(before, "qa") == 1  # ... in one forward pass


# -- MiniLM-based heads: a real vocabulary (casing, accents, sub-words, [UNK]) and long contexts ------

MINILM_TEXTS = [
    "Wolfgang Müller lives in Berlin-Köln since 1998!",
    "Dr. Émilie Dupont visited São Paulo's museums.",
    "unbelievably tokenization-heavy sentences 🙂 are fun",
    "I live in Berlin",
]
MINILM_CONTEXT = " ".join(
    [
        "Wolfgang Müller was born in Berlin in 1998 and moved to São Paulo in 2010.",
        "He studied tokenization at the university, then worked at a museum.",
        "Émilie Dupont, his colleague, lives in Köln and visits him every summer.",
    ]
    * 10
)


@pytest.fixture(scope="module")
def minilm_heads(tmp_path_factory):
    from tests.conftest import MINILM_DIR

    if not MINILM_DIR.is_dir():
        pytest.fail(f"{MINILM_DIR} is missing: run `make demo-data`")
    root = tmp_path_factory.mktemp("minilm-heads")
    tok = transformers.AutoTokenizer.from_pretrained(MINILM_DIR)
    for name, cls, extra in [
        ("minilm-ner", "BertForTokenClassification", {"id2label": NER_LABELS}),
        ("minilm-qa", "BertForQuestionAnswering", {}),
    ]:
        torch.manual_seed(0)  # the head is new: random, seeded
        model = getattr(transformers, cls).from_pretrained(MINILM_DIR, **extra).eval()
        model.save_pretrained(root / "models" / name)
        tok.save_pretrained(root / "models" / name)
    return root


@pytest.mark.slow
async def test_minilm_heads_equal_transformers(minilm_heads):
    path = minilm_heads / "models"
    ner = transformers.BertForTokenClassification.from_pretrained(path / "minilm-ner").eval()
    qa = transformers.BertForQuestionAnswering.from_pretrained(path / "minilm-qa").eval()
    tok = transformers.AutoTokenizer.from_pretrained(path / "minilm-ner")
    async with serve_app(settings_for(minilm_heads, default_model="minilm-ner")) as c:
        for strategy in STRATEGIES:
            pipe = transformers.pipeline(
                "token-classification", model=ner, tokenizer=tok, aggregation_strategy=strategy
            )
            r = await c.post(
                "/token-classification",
                json={
                    "inputs": MINILM_TEXTS,
                    "model": "minilm-ner",
                    "aggregation_strategy": strategy,
                    "ignore_labels": [],
                },
            )
            assert r.status_code == 200, r.json()
            for ours, theirs in zip(r.json(), pipe(MINILM_TEXTS, ignore_labels=[])):
                assert_same(ours, theirs)
        for options in (
            {},
            {"top_k": 3, "handle_impossible_answer": True},
            {"max_seq_len": 64, "doc_stride": 16, "top_k": 2},
        ):
            for question in ("Where does Émilie Dupont live?", "When was Wolfgang born?"):
                r = await c.post(
                    "/question-answering",
                    json={"question": question, "context": MINILM_CONTEXT, "model": "minilm-qa", **options},
                )
                assert r.status_code == 200, r.json()
                assert_answers(r.json(), qa_reference(qa, tok, question, MINILM_CONTEXT, **options))
    assert len(tok(MINILM_CONTEXT)["input_ids"]) > 384  # the default windows are several too


async def test_question_answering_refuses_too_many_windows_before_making_them(tasks_dir, monkeypatch):
    """A stride one short of the window moves it one token at a time: 10,000 windows for a 10,000-token
    context. Refused from the token counts alone, before the tokenizer makes any window."""
    from app.serving import qa_pipeline

    windowed = []

    class Recording:
        def __init__(self, tok):
            self.tok = tok

        def encode_batch(self, inputs, **kwargs):  # model.tokenizer.encode_one's call
            windowed.extend(inputs)
            return self.tok.encode_batch(inputs, **kwargs)

    truncating = qa_pipeline.truncating
    monkeypatch.setattr(qa_pipeline, "truncating", lambda *a, **k: Recording(truncating(*a, **k)))
    async with serve_app(settings_for(tasks_dir, default_model="tiny-qa", max_request_tokens=2000)) as c:
        r = await c.post(
            "/question-answering",
            json={
                "question": QUESTION,
                "context": "the dog " * 5000,
                "model": "tiny-qa",
                "max_seq_len": 16,
                "doc_stride": 6,
            },
        )
        assert r.status_code == 422
        assert r.json() == err(
            "validation",
            "the request is 159904 tokens long (all inputs together), more than "
            "the 2000 that BERT_MAX_REQUEST_TOKENS allows",
        )
        assert windowed == []
        # the count is exact (what the tokenizer's windows hold): at the limit it is answered
        body = {"question": QUESTION, "context": LONG_CONTEXT, "model": "tiny-qa", "max_seq_len": 16, "doc_stride": 3}
        _, tok = hf(tasks_dir, "tiny-qa", "BertForQuestionAnswering")
        windows = tok(
            QUESTION, LONG_CONTEXT, truncation="only_second", max_length=16, stride=3, return_overflowing_tokens=True
        )["input_ids"]
        tokens = sum(map(len, windows))
    async with serve_app(settings_for(tasks_dir, default_model="tiny-qa", max_request_tokens=tokens)) as c:
        assert (await c.post("/question-answering", json=body)).status_code == 200
        assert len(windowed) == 1
    async with serve_app(settings_for(tasks_dir, default_model="tiny-qa", max_request_tokens=tokens - 1)) as c:
        r = await c.post("/question-answering", json=body)
        assert r.status_code == 422
        assert r.json()["error"].startswith("the request is ")


async def test_tokenizer_copies_for_request_options_are_bounded(svc):
    """stride, max_seq_len and doc_stride come from requests: a copy of the tokenizer per combination
    would grow without end; the last few are kept."""
    from model.tokenizer import COPIES_PER_TOKENIZER, _copies

    for stride in range(COPIES_PER_TOKENIZER + 4):
        r = await svc.post(
            "/question-answering",
            json={"question": "a ?", "context": "a dog", "model": "tiny-qa", "doc_stride": stride},
        )
        assert r.status_code == 200
    lm = svc.app.state.service.registry.peek("tiny-qa").loaded
    assert len(_copies[lm.tokenizer]) == COPIES_PER_TOKENIZER
    assert list(_copies[lm.tokenizer])[-1] == (32, COPIES_PER_TOKENIZER + 3, "only_second", "right")
