"""Model loads charged to the key whose request causes them: BERT_MAX_LOADS_PER_MINUTE per key (and for the
requests without a key together), a 429 naming the limit with Retry-After, and the load's tokens taken
from the key's token rate (app/keys/limits.py load_tokens)."""

from __future__ import annotations

import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.keys.limits import load_tokens
from tests.app.conftest import serve_app, settings_for
from tests.app.test_engine import metric

pytestmark = pytest.mark.anyio

SECRETS = {name: new_secret() for name in ("churn", "other", "thrifty", "boss")}
KEYS = {
    "churn": Key("churn", hash_secret(SECRETS["churn"]), frozenset({"inference"})),
    "other": Key("other", hash_secret(SECRETS["other"]), frozenset({"inference"})),
    "thrifty": Key("thrifty", hash_secret(SECRETS["thrifty"]), frozenset({"inference"}), tokens_per_min=10),
    "boss": Key("boss", hash_secret(SECRETS["boss"]), frozenset({"inference", "admin", "metrics"})),
}


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def embed(model: str) -> dict:
    return {"inputs": "the cat", "model": model}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.toml"
    write_keys(path, dict(KEYS))
    return path


async def test_a_key_over_its_loads_per_minute_gets_a_429_naming_the_limit(data_dir, keys_file):
    settings = settings_for(data_dir, keys_file=keys_file, load="lazy", max_loads_per_minute=2)
    async with serve_app(settings, wait_ready=False) as c:
        for model in ("tiny-enc", "tiny-cls"):  # two loads: its limit
            assert (await c.post("/embeddings", json=embed(model), headers=auth("churn"))).status_code == 200
        r = await c.post("/embeddings", json=embed("tiny-mlm"), headers=auth("churn"))
        retry = int(r.headers["retry-after"])
        assert r.status_code == 429 and 1 <= retry <= 30  # one load comes back every 30 s
        assert r.json() == {
            "error": "key 'churn' is over BERT_MAX_LOADS_PER_MINUTE=2, the model loads a key may cause per minute; "
            f"model 'tiny-mlm' is not loaded; retry in {retry} s",
            "error_type": "overloaded",
        }
        assert c.app.state.service.registry.peek("tiny-mlm").loaded is None
        # A loaded model is no load; another key has loads of its own.
        assert (await c.post("/embeddings", json=embed("tiny-enc"), headers=auth("churn"))).status_code == 200
        assert (await c.post("/embeddings", json=embed("tiny-mlm"), headers=auth("other"))).status_code == 200
        assert (await c.post("/embeddings", json=embed("tiny-mlm"), headers=auth("churn"))).status_code == 200
        text = (await c.get("/metrics", headers=auth("boss"))).text
        assert 'bert_key_rate_limited_total{key="churn",limit="loads"} 1.0' in text


async def test_requests_without_a_key_share_one_loads_limit(data_dir):
    settings = settings_for(data_dir, load="lazy", max_loads_per_minute=1)
    async with serve_app(settings, wait_ready=False) as c:
        assert (await c.post("/embeddings", json=embed("tiny-enc"))).status_code == 200
        r = await c.post("/embeddings", json=embed("tiny-cls"))
        retry = int(r.headers["retry-after"])
        assert r.status_code == 429 and 1 <= retry <= 60
        assert r.json()["error"] == (
            "requests without a key are over BERT_MAX_LOADS_PER_MINUTE=1, the model loads they may cause per "
            f"minute; model 'tiny-cls' is not loaded; retry in {retry} s"
        )
    unlimited = settings.model_copy(update={"max_loads_per_minute": 0})
    async with serve_app(unlimited, wait_ready=False) as c:
        for model in ("tiny-enc", "tiny-cls", "tiny-mlm", "tiny-pt"):
            assert (await c.post("/embeddings", json=embed(model))).status_code == 200


async def test_a_load_is_charged_to_the_keys_token_rate(data_dir, keys_file):
    """thrifty has 10 tokens a minute, less than a load of a tiny model costs: the request that loads one
    runs the load (the bucket was above zero), then finds its own tokens refused; a second load is refused
    naming its cost, and nothing is loaded for it."""
    settings = settings_for(data_dir, keys_file=keys_file, load="lazy")
    async with serve_app(settings, wait_ready=False) as c:
        registry = c.app.state.service.registry
        cost = load_tokens(registry.peek("tiny-enc").num_parameters)
        assert cost > 10
        r = await c.post("/embeddings", json=embed("tiny-enc"), headers=auth("thrifty"))
        assert r.status_code == 429 and r.json()["error"].startswith(
            "key 'thrifty' is over its token rate of 10 tokens per minute; retry in "
        )
        assert registry.peek("tiny-enc").loaded is not None  # the load ran, and was charged
        r = await c.post("/embeddings", json=embed("tiny-cls"), headers=auth("thrifty"))
        retry = int(r.headers["retry-after"])
        assert r.status_code == 429 and r.json()["error"] == (
            f"key 'thrifty' is over its token rate of 10 tokens per minute, and loading model 'tiny-cls' costs "
            f"{cost:,}; retry in {retry} s"
        )
        assert registry.peek("tiny-cls").loaded is None
        usage = (await c.get("/usage", headers=auth("boss"))).json()["keys"]
        assert usage["thrifty"] == {"requests": 2, "tokens": cost, "rate_limited": 2, "job_seconds": 0.0}
        text = (await c.get("/metrics", headers=auth("boss"))).text
        assert metric(text, "bert_key_rate_limited_total", key="thrifty", limit="tokens") == 2
