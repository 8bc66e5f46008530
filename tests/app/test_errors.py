"""Every failure path answers its documented status and exact body."""

from __future__ import annotations

import threading

import anyio
import pytest

from tests.app.conftest import serve_app, settings_for

pytestmark = pytest.mark.anyio


def err(kind: str, message: str) -> dict:
    return {"error": message, "error_type": kind}


async def test_fill_mask_without_mask_is_422(client):
    r = await client.post("/fill-mask", json={"inputs": ["the [MASK] sat", "no mask here"]})
    assert r.status_code == 422
    assert r.json() == err("validation", "input 1 has no [MASK] token; fill-mask needs at least one")


async def test_too_long_input_is_422_unless_truncate(client):
    long_text = " ".join(["dog"] * 40)
    r = await client.post("/embeddings", json={"inputs": ["the cat", long_text]})
    assert r.status_code == 422
    assert r.json() == err(
        "validation",
        "input 1 is 42 tokens long, more than the 32 model 'tiny-pt' takes; shorten it or send \"truncate\": true",
    )
    r = await client.post("/embeddings", json={"inputs": ["the cat", long_text], "truncate": True})
    assert r.status_code == 200


async def test_unknown_model_is_404(client):
    r = await client.post("/embeddings", json={"inputs": "the cat", "model": "nope"})
    assert r.status_code == 404
    assert r.json() == err("not_found", "model 'nope' not found (available: tiny-cls, tiny-enc, tiny-mlm, tiny-pt)")
    r = await client.get("/models/nope")
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"


@pytest.mark.parametrize(
    "path,body,message",
    [
        (
            "/fill-mask",
            {"inputs": "the [MASK]", "model": "tiny-enc"},
            "model 'tiny-enc' has no masked-LM (mlm) head, which /fill-mask needs (it is a BertModel; heads: none)",
        ),
        (
            "/nsp",
            {"inputs": {"text_a": "a", "text_b": "b"}, "model": "tiny-mlm"},
            "model 'tiny-mlm' has no next-sentence (nsp) head, which /nsp needs (it is a BertForMaskedLM; heads: mlm)",
        ),
        (
            "/classify",
            {"inputs": "a", "model": "tiny-pt"},
            "model 'tiny-pt' has no classifier head, which /classify needs (it is a BertForPreTraining; heads: mlm, nsp)",
        ),
    ],
)
async def test_missing_head_is_422_naming_it(client, path, body, message):
    r = await client.post(path, json=body)
    assert r.status_code == 422
    assert r.json() == err("validation", message)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"inputs": "the [MASK]", "top_k": 0}, "top_k: Input should be greater than or equal to 1"),
        (
            {"inputs": "the [MASK]", "model": "../etc"},
            "model: String should match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'",
        ),
        ({"inputs": "the [MASK]", "topk": 3}, "topk: Extra inputs are not permitted (did you mean 'top_k'?)"),
        ({"inputs": "the [MASK]", "temperature": 3}, "temperature: Extra inputs are not permitted"),  # like nothing
        ({}, "inputs: Field required"),
        ({"inputs": "the [MASK]", "targets": []}, "targets: List should have at least 1 item after validation, not 0"),
        ({"inputs": "the [MASK]", "targets": [" "]}, "none of the targets is a token of the model's vocabulary"),
    ],
)
async def test_bad_requests_are_422(client, body, message):
    r = await client.post("/fill-mask", json=body)
    assert r.status_code == 422
    assert r.json() == err("validation", message)


@pytest.mark.parametrize(
    "path,body,message",
    [
        ("/fill-mask", {"inputs": "the [MASK]", "top_k": "5"}, "top_k: Input should be a valid integer"),
        ("/fill-mask", {"inputs": "the [MASK]", "top_k": 5.0}, "top_k: Input should be a valid integer"),
        ("/embeddings", {"inputs": "the cat", "normalize": 1}, "normalize: Input should be a valid boolean"),
        ("/embeddings", {"inputs": "the cat", "truncate": "true"}, "truncate: Input should be a valid boolean"),
        (
            "/nsp",
            {"inputs": {"text_a": "a", "text_b": "b", "label": 0}},
            "inputs.TextPair.label: Extra inputs are not "
            "permitted; inputs.list[TextPair]: Input should be a valid list",
        ),
        (
            "/nsp",
            {"inputs": [{"text_a": "a", "text_b": "b", "txt_b": "c"}]},
            "inputs.TextPair: Input should be a valid dictionary or object to extract fields from; "
            "inputs.list[TextPair].0.txt_b: "
            "Extra inputs are not permitted (did you mean 'text_b'?)",
        ),
    ],
)
async def test_json_types_must_match_exactly(client, path, body, message):
    """One strictness rule for every route (app/schemas/shared.py): no "5" for 5, no 1 for true."""
    r = await client.post(path, json=body)
    assert r.status_code == 422
    assert r.json() == err("validation", message)


def openai_err(message: str, code: str | None, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def test_v1_errors_answer_in_openais_shape_with_the_same_status(client):
    """/v1/* is OpenAI's API: its failures answer as OpenAI's do, so its clients raise their own errors."""
    for body, status, expected in [
        (
            {"input": "the cat", "model": "nope"},
            404,
            openai_err("model 'nope' not found (available: tiny-cls, tiny-enc, tiny-mlm, tiny-pt)", "model_not_found"),
        ),
        (
            {"input": "the cat", "dimensions": "32"},
            422,
            openai_err("dimensions: Input should be a valid integer", None, "dimensions"),
        ),
        (
            {"input": []},
            422,
            openai_err(
                "input.str: Input should be a valid string; input.list[str]: List should have at least 1 item after validation, not 0",
                None,
                "input",
            ),
        ),
        (
            {"input": "the cat", "model": "tiny-enc", "dimensions": 33},
            422,
            openai_err(
                "dimensions must be from 1 to 32 (model 'tiny-enc' makes 32-dimensional embeddings), got 33", None
            ),
        ),
    ]:
        r = await client.post("/v1/embeddings", json=body)
        assert (r.status_code, r.json()) == (status, expected), body
    r = await client.get("/v1/nope")
    assert (r.status_code, r.json()) == (404, openai_err("no route /v1/nope", "unknown_url"))
    r = await client.get("/v1/embeddings")
    assert r.status_code == 405 and r.headers["allow"] == "OPTIONS, POST"
    assert r.json() == openai_err("method GET is not allowed on /v1/embeddings", "method_not_allowed")
    r = await client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # Everywhere else: our own shape.
    r = await client.post("/embeddings", json={"inputs": "the cat", "model": "nope"})
    assert r.json() == err("not_found", "model 'nope' not found (available: tiny-cls, tiny-enc, tiny-mlm, tiny-pt)")
    assert (await client.get("/v1")).json() == err("not_found", "no route /v1")


async def test_openai_embeddings_ignore_unknown_fields_only(client):
    """OpenAI's clients send options we do not implement: those are ignored (types still count: above)."""
    r = await client.post("/v1/embeddings", json={"input": "the cat", "user": "u1", "some_new_option": {"x": 1}})
    assert r.status_code == 200 and r.json()["data"][0]["index"] == 0


async def test_invalid_json_and_too_many_inputs(client):
    r = await client.post("/embeddings", content=b'{"inputs": ', headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json() == err("validation", "the body is not valid JSON: Expecting value (character 11)")
    r = await client.post("/embeddings", json={"inputs": ["a"] * 65})
    assert r.status_code == 422
    assert r.json() == err("validation", "at most 64 inputs per request, got 65")


async def test_a_body_without_a_json_content_type_names_the_header(client):
    """curl -d sends a form's Content-Type: the 422 says which header to send (and on /v1/*, in OpenAI's shape)."""
    body, form = b'{"inputs": "the cat"}', {"content-type": "application/x-www-form-urlencoded"}
    message = (
        "the body must be a JSON object sent with the header 'Content-Type: application/json' (this request's "
        "Content-Type: application/x-www-form-urlencoded; with curl, add -H 'Content-Type: application/json')"
    )
    r = await client.post("/embeddings", content=body, headers=form)
    assert (r.status_code, r.json()) == (422, err("validation", message))
    r = await client.post("/v1/embeddings", content=b'{"input": "the cat"}', headers=form)
    assert (r.status_code, r.json()["error"]["message"]) == (422, message)
    r = await client.post("/embeddings", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200  # the same body, with the header


async def test_routing_errors(client):
    r = await client.get("/nowhere")
    assert r.status_code == 404 and r.json() == err("not_found", "no route /nowhere")
    r = await client.get("/fill-mask")
    assert r.status_code == 405 and r.json() == err("method_not_allowed", "method GET is not allowed on /fill-mask")
    assert r.headers["allow"] == "OPTIONS, POST"


async def test_api_key(data_dir):
    async with serve_app(settings_for(data_dir, api_key="s3cret", load="lazy"), wait_ready=False) as c:
        body = {"inputs": "the cat"}
        missing = err("unauthorized", "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = await c.post("/embeddings", json=body, headers=headers)
            assert r.status_code == 401 and r.json() == missing
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/models", "/info", "/docs", "/openapi.json"):
            assert (await c.get(path)).status_code == 401, path
        ok = {"Authorization": "Bearer s3cret"}
        assert (await c.post("/embeddings", json=body, headers=ok)).status_code == 200
        assert (await c.get("/openapi.json", headers=ok)).status_code == 200
        info = (await c.get("/info", headers=ok)).json()
        assert info["settings"]["api_key_set"] is True and "s3cret" not in str(info)
        for path in ("/health", "/ready"):  # open to probes
            assert (await c.get(path)).status_code == 200, path


async def test_body_limit(data_dir):
    async with serve_app(settings_for(data_dir, max_body_bytes=200, load="lazy"), wait_ready=False) as c:
        too_large = err("too_large", "request body is larger than the limit of 200 bytes")
        r = await c.post("/embeddings", json={"inputs": "dog " * 100})  # Content-Length: 400+
        assert r.status_code == 413 and r.json() == too_large

        sent = []

        async def chunks():  # no Content-Length: the limit must count streamed bytes
            for i in range(100):
                sent.append(i)
                yield b'{"inputs": "' if i == 0 else b"dog " * 25

        r = await c.post("/embeddings", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json() == too_large
        assert len(sent) < 10  # refused early, not read whole
        assert (await c.post("/embeddings", json={"inputs": "the cat"})).status_code == 200


async def test_full_queue_is_429(data_dir):
    settings = settings_for(data_dir, max_queue=1, default_model="tiny-enc", load="lazy")
    async with serve_app(settings, wait_ready=False) as c:
        assert (await c.post("/embeddings", json={"inputs": "warm up"})).status_code == 200  # nothing else loads
        engine = c.app.state.service.engine
        gate, entered, original = threading.Event(), threading.Event(), engine.runners["encode"]

        def blocked(lm, batch):
            entered.set()
            gate.wait(10)
            return original(lm, batch)

        engine.runners["encode"] = blocked
        results = {}

        async def call(key):
            results[key] = await c.post("/embeddings", json={"inputs": "the cat"})

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "running")
                with anyio.fail_after(5):
                    while not entered.is_set():
                        await anyio.sleep(0.005)
                tg.start_soon(call, "queued")
                with anyio.fail_after(5):
                    while engine.depth < 1:
                        await anyio.sleep(0.005)
                r = await c.post("/embeddings", json={"inputs": "the cat"})
                assert r.status_code == 429
                assert r.json() == err("overloaded", "the inference queue is full (1 requests waiting); retry later")
                assert r.headers["retry-after"] == "1"
                gate.set()
        finally:
            gate.set()
        assert results["running"].status_code == 200 and results["queued"].status_code == 200


async def test_ready_is_503_until_the_default_model_is_warm(data_dir):
    async with serve_app(settings_for(data_dir, load="lazy"), wait_ready=False) as c:
        r = await c.get("/ready")
        assert r.status_code == 503
        assert r.json() == err("unavailable", "default model 'tiny-pt' is not loaded and warmed up yet")
        assert r.headers["retry-after"] == "5"
        models = {m["name"]: m["loaded"] for m in (await c.get("/models")).json()["models"]}
        assert not any(models.values())
        assert (await c.post("/embeddings", json={"inputs": "the cat"})).status_code == 200  # loads it
        assert (await c.get("/ready")).json() == {
            "status": "ready",
            "model": "tiny-pt",
            "mlm_model": "tiny-pt",  # no default MLM model: the default model has the head
            "mlm_job": None,
        }


async def test_no_default_model(data_dir):
    async with serve_app(settings_for(data_dir, load="lazy", default_model=None), wait_ready=False) as c:
        r = await c.get("/ready")
        assert r.status_code == 503
        assert r.json() == err("unavailable", "no default model: set BERT_DEFAULT_MODEL (or store exactly one model)")
        r = await c.post("/embeddings", json={"inputs": "the cat"})
        assert r.status_code == 404
        assert r.json() == err(
            "not_found", "no model named in the request and no default model (set BERT_DEFAULT_MODEL)"
        )
