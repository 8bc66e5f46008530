"""What a hostile client finds (issue 12's lows), each over real ASGI: lone surrogates, the key checked
before the body is read, Retry-After, no slash redirects, our words in error bodies, /metrics behind
the key, complete Allow headers, OPTIONS and deeply nested JSON. The live-socket ones (slow clients,
the connection cap, a Host header over the wire) are in test_server.py."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from app.serving.stored_models import describe_failure
from model.modeling import BertForPreTraining
from tests.app.conftest import save_tiny, serve_app, settings_for

pytestmark = pytest.mark.anyio

API_KEY, ADMIN_KEY = "inference-key-0123456789", "admin-key-0123456789abc"
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
JSON = {"content-type": "application/json"}
API_REFUSAL = {
    "error": "missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'",
    "error_type": "unauthorized",
}
ADMIN_REFUSAL = {
    "error": "missing or wrong key: send 'Authorization: Bearer <BERT_ADMIN_KEY>'",
    "error_type": "unauthorized",
}


def err(kind: str, message: str, path: str = "") -> dict:
    """Our error body; on /v1/* OpenAI's (app/errors.py)."""
    if path.startswith("/v1/"):
        code = {"validation": None, "unauthorized": "invalid_api_key"}[kind]
        return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return {"error": message, "error_type": kind}


@pytest.fixture(scope="module")
async def keyed(data_dir):
    """The app with both keys set."""
    async with serve_app(settings_for(data_dir, api_key=API_KEY, admin_key=ADMIN_KEY)) as c:
        yield c


# -- lone surrogates ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,message",
    [
        (
            "/fill-mask",
            r'{"inputs": "the \ud800 [MASK]"}',
            r"inputs is not valid Unicode: lone surrogate '\ud800' at character 4",
        ),
        (
            "/fill-mask",
            r'{"inputs": ["the [MASK]", "a \udc00 [MASK]"]}',
            r"inputs[1] is not valid Unicode: lone surrogate '\udc00' at character 2",
        ),
        (
            "/fill-mask",
            r'{"inputs": "the [MASK]", "targets": ["cat", "\ud800"]}',
            r"targets[1] is not valid Unicode: lone surrogate '\ud800' at character 0",
        ),
        (
            "/embeddings",
            r'{"inputs": "\ud800"}',
            r"inputs is not valid Unicode: lone surrogate '\ud800' at character 0",
        ),
        (
            "/v1/embeddings",
            r'{"input": ["ok", "\ud800"]}',
            r"input[1] is not valid Unicode: lone surrogate '\ud800' at character 0",
        ),
        (
            "/nsp",
            r'{"inputs": {"text_a": "a", "text_b": "\ud800"}}',
            r"inputs.text_b is not valid Unicode: lone surrogate '\ud800' at character 0",
        ),
        (
            "/classify",
            r'{"inputs": [{"text_a": "\ud800", "text_b": "b"}], "model": "tiny-cls"}',
            r"inputs[0].text_a is not valid Unicode: lone surrogate '\ud800' at character 0",
        ),
    ],
)
async def test_a_lone_surrogate_is_422_on_every_text_route(keyed, path, body, message):
    """It was a 500 (the Rust tokenizer's TypeError) on every one of them. The body is valid JSON
    (JSON may escape a lone surrogate); its text is not valid Unicode."""
    r = await keyed.post(path, content=body.encode(), headers={**API, **JSON})
    assert (r.status_code, r.json()) == (422, err("validation", message, path))


async def test_a_surrogate_pair_is_text(keyed):
    r = await keyed.post("/embeddings", content=b'{"inputs": "the cat \\ud83d\\ude00"}', headers={**API, **JSON})
    assert r.status_code == 200


# -- the key before the body ----------------------------------------------------------------------


async def _unread_body(sent: list):
    for i in range(3):
        sent.append(i)
        yield b'{"inputs": ' if i == 0 else b"[" * 100


@pytest.mark.parametrize(
    "path,key,refusal",
    [
        ("/fill-mask", API, API_REFUSAL),
        ("/embeddings", API, API_REFUSAL),
        ("/v1/embeddings", API, err("unauthorized", API_REFUSAL["error"], "/v1/embeddings")),
        ("/nsp", API, API_REFUSAL),
        ("/classify", API, API_REFUSAL),
        ("/jobs", ADMIN, ADMIN_REFUSAL),
        ("/datasets", ADMIN, ADMIN_REFUSAL),
    ],
)
async def test_anonymous_clients_get_401_whatever_the_body(keyed, path, key, refusal):
    """Malformed, nested, oversized or merely valid: 401 from the headers, and the body is never read."""
    bodies = [b"{", b"[" * 1000 + b"]" * 1000, b'{"inputs": "\\ud800"}', b'{"inputs": "the [MASK]"}']
    for body in bodies:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
            r = await keyed.post(path, content=body, headers={**headers, **JSON})
            assert (r.status_code, r.json()) == (401, refusal), (body[:20], headers)
            assert r.headers["www-authenticate"] == "Bearer"
    # A declared length far past BERT_MAX_BODY_BYTES: 401 (not 413) to a client without the key.
    r = await keyed.post(path, content=b"x", headers={**JSON, "content-length": str(10**9)})
    assert (r.status_code, r.json()) == (401, refusal)
    sent: list = []
    r = await keyed.post(path, content=_unread_body(sent), headers=JSON)
    assert (r.status_code, r.json(), sent) == (401, refusal, [])
    # The other key does not open it (the inference/admin split holds).
    other = ADMIN if key is API else API
    assert (await keyed.post(path, content=b"{", headers={**other, **JSON})).status_code == 401


async def test_with_the_key_the_body_is_judged(keyed):
    r = await keyed.post("/embeddings", content=b"{", headers={**API, **JSON})
    assert r.status_code == 422 and r.json()["error"].startswith("the body is not valid JSON")
    r = await keyed.post("/jobs", content=b"{", headers={**ADMIN, **JSON})
    assert r.status_code == 422 and r.json()["error"].startswith("the body is not valid JSON")


async def test_paths_without_a_route_need_the_key_too(keyed):
    """Nothing about the routes leaks to a client without the key: a miss is a 401 like a hit."""
    for method, path in (
        ("GET", "/nowhere"),
        ("GET", "/info/"),
        ("POST", "/embeddings/"),
        ("GET", "/fill-mask"),
        ("OPTIONS", "/embeddings"),
        ("GET", "/metrics"),
    ):
        r = await keyed.request(method, path)
        assert (r.status_code, r.json()) == (401, API_REFUSAL), (method, path)
    for path in ("/health", "/ready"):
        assert (await keyed.get(path)).status_code == 200
    assert (await keyed.get("/nowhere", headers=API)).json() == err("not_found", "no route /nowhere")


# -- Retry-After -----------------------------------------------------------------------------------


async def test_every_503_says_when_to_retry(data_dir):
    async with serve_app(settings_for(data_dir, load="lazy"), wait_ready=False) as c:
        service = c.app.state.service
        r = await c.get("/ready")
        assert (r.status_code, r.headers["retry-after"]) == (503, "5")
        await service.stop()  # the service stopped (shutting down): a 503 from the route
        try:
            r = await c.post("/embeddings", json={"inputs": "the cat"})
            assert r.json() == err("unavailable", "the service is not running")
            assert (r.status_code, r.headers["retry-after"]) == (503, "5")
        finally:
            await service.start()


# -- no redirects built from the Host header -------------------------------------------------------


async def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_hosts_name(data_dir):
    async with serve_app(settings_for(data_dir, load="lazy"), wait_ready=False) as c:
        for method, path in (("GET", "/info/"), ("GET", "/models/"), ("POST", "/embeddings/"), ("GET", "/health/")):
            r = await c.request(method, path, headers={"host": "evil.example"})
            assert (r.status_code, r.json()) == (404, err("not_found", f"no route {path}")), path
            assert "location" not in r.headers


# -- our words in error bodies ---------------------------------------------------------------------


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


async def test_error_bodies_carry_no_library_text_or_absolute_paths(tmp_path):
    models = tmp_path / "models"
    save_tiny(models / "good", BertForPreTraining)
    pickled = models / "pickled"
    save_tiny(pickled, BertForPreTraining)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(
        pickle.dumps({"bert.embeddings.word_embeddings.weight": _Payload()}, protocol=2)
    )
    save_tiny(models / "no-weights", BertForPreTraining)
    (models / "no-weights" / "model.safetensors").unlink()  # our own FileNotFoundError, with its path
    (models / "bad-json").mkdir()
    (models / "bad-json" / "config.json").write_text("{not json")
    async with serve_app(settings_for(tmp_path, default_model="good", load="lazy"), wait_ready=False) as c:
        listed = {m["name"]: m["error"] for m in (await c.get("/models")).json()["models"]}
        assert listed == {
            "good": None,
            "pickled": "pytorch_model.bin is not plain weights: loading it would unpickle code, which is refused "
            "(convert it to model.safetensors)",
            "no-weights": "no model.safetensors or pytorch_model.bin in models/no-weights",
            "bad-json": "models/bad-json/config.json is not valid JSON: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        }
        r = await c.post("/embeddings", json={"inputs": "the cat", "model": "pickled"})
        assert (r.status_code, r.json()) == (
            503,
            err("unavailable", f"model 'pickled' cannot be served: {listed['pickled']}"),
        )
        text = (await c.get("/models")).text + r.text
        assert str(tmp_path) not in text and "Weights only load failed" not in text


def test_a_library_error_is_named_by_its_type_only(tmp_path):
    try:
        json.loads("{not json")  # raised outside model/: its words are the library's
    except ValueError as e:
        assert describe_failure(e, tmp_path) == "JSONDecodeError (the service log has the details)"


async def test_ready_names_no_absolute_path(tmp_path):
    async with serve_app(settings_for(tmp_path, default_model="absent", load="lazy"), wait_ready=False) as c:
        r = await c.get("/ready")
        assert r.json() == err("unavailable", "default model 'absent' is not in DATA_DIR/models")


# -- /metrics --------------------------------------------------------------------------------------


async def test_metrics_need_the_key_unless_public(data_dir):
    async with serve_app(settings_for(data_dir, api_key=API_KEY, load="lazy"), wait_ready=False) as c:
        r = await c.get("/metrics")
        assert (r.status_code, r.json()) == (401, API_REFUSAL)
        r = await c.get("/metrics", headers=API)
        assert r.status_code == 200 and "bert_requests_total" in r.text
    async with serve_app(
        settings_for(data_dir, api_key=API_KEY, metrics_public=True, load="lazy"), wait_ready=False
    ) as c:
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/info")).status_code == 401  # only /metrics opens


# -- methods ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,key,allow",
    [
        ("PUT", "/jobs", ADMIN, "GET, OPTIONS, POST"),
        ("DELETE", "/datasets", ADMIN, "GET, OPTIONS, POST"),
        ("GET", "/embeddings", API, "OPTIONS, POST"),
        ("POST", "/models/tiny-pt", API, "DELETE, GET, OPTIONS, PATCH"),
    ],
)
async def test_405_lists_every_method_of_the_path(keyed, method, path, key, allow):
    """The router named one route's methods: PUT /jobs said `Allow: GET` (POST /jobs is another route)."""
    r = await keyed.request(method, path, headers=key)
    assert (r.status_code, r.json()) == (405, err("method_not_allowed", f"method {method} is not allowed on {path}"))
    assert r.headers["allow"] == allow


async def test_options_answers_the_allowed_methods(keyed):
    r = await keyed.options("/jobs", headers=ADMIN)
    assert (r.status_code, r.content, r.headers["allow"]) == (204, b"", "GET, OPTIONS, POST")
    r = await keyed.options("/fill-mask", headers=API)
    assert (r.status_code, r.headers["allow"]) == (204, "OPTIONS, POST")
    r = await keyed.options("/nowhere", headers=API)
    assert (r.status_code, r.json()) == (404, err("not_found", "no route /nowhere"))


# -- bodies the parser refuses ---------------------------------------------------------------------


async def test_deeply_nested_json_and_non_utf8_bodies_say_what_is_wrong(keyed):
    for body in (b"[" * 1000 + b"]" * 1000, b'{"inputs": ' + b"[" * 1000 + b"]" * 1000 + b"}"):
        r = await keyed.post("/embeddings", content=body, headers={**API, **JSON})
        assert (r.status_code, r.json()) == (
            422,
            err("validation", "the body is not valid JSON for this service: it is nested too deeply"),
        )
    r = await keyed.post("/embeddings", content=b'{"inputs": "\xff"}', headers={**API, **JSON})
    assert (r.status_code, r.json()) == (422, err("validation", "the body is not valid JSON (it must be UTF-8 text)"))
