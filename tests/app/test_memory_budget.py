"""The model memory budget: least-recently-used unloading, pinning, the 507, the listing and metrics,
concurrent first requests for more models than fit (in the registry, and against real uvicorn), the
order models are unloaded in when several keys use them, and unloaded models that requests still hold."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
import torch

from app.errors import ServiceError
from app.prometheus import Metrics
from app.serving.model_registry import RECENT_USERS_S, ModelRegistry
from app.serving.service import memory_budget
from app.settings import Settings
from model.compute import device as device_module
from model.modeling import BertModel
from model.sizing import format_bytes
from tests.app.conftest import save_tiny, serve_app, settings_for
from tests.app.test_bounds import RawRequest, Spy, until
from tests.app.test_inference import embed_reference
from tests.app.test_server import free_port, start_server

NAMES = ["m0", "m1", "m2", "m3"]
MAX_BATCH_TOKENS = 256
TEXTS = ["the cat sat on the mat", "a big red car", "paris is the capital of france", "good film", "the dog ran"]


@pytest.fixture(scope="module")
def four_models(tmp_path_factory) -> Path:
    """DATA_DIR with four tiny encoders of one size and different weights (seeds 0-3)."""
    root = tmp_path_factory.mktemp("memory")
    for seed, name in enumerate(NAMES):
        save_tiny(root / "models" / name, BertModel, seed=seed)
    return root


def registry(data_dir: Path, models: float, **kwargs) -> ModelRegistry:
    """A registry whose budget holds `models` of the tiny models' weights and one working set."""
    store = ModelRegistry(data_dir, "m0", torch.device("cpu"), max_batch_tokens=MAX_BATCH_TOKENS, **kwargs)
    store.scan()
    weights, working = store.estimate(store.peek("m0"))
    store.memory_budget = int(models * weights) + working
    return store


def loaded(store: ModelRegistry) -> list[str]:
    return [e.name for e in store.entries() if e.loaded is not None]


def counter(metrics: Metrics, name: str, model: str) -> float:
    return metrics.registry.get_sample_value(name, {"model": model}) or 0.0


async def load(store: ModelRegistry, name: str):
    return await store.ensure_loaded(store.peek(name))


pytestmark = pytest.mark.anyio


def test_the_default_budget_is_half_of_the_ram_or_of_the_containers_limit(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    physical = device_module.memory_bytes(cpu)
    assert memory_budget(Settings(model_memory_gb=1.5), cpu) == 3 * 2**29
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(device_module, "CGROUP_MEMORY_LIMITS", (str(tmp_path / "none"), str(limit)))
    limit.write_text("max\n")  # cgroup v2 without a limit
    assert device_module.memory_bytes(cpu) == physical
    limit.write_text(f"{2**30}\n")
    assert device_module.memory_bytes(cpu) == min(physical, 2**30)
    assert memory_budget(Settings(), cpu) == min(physical, 2**30) // 2


async def test_the_least_recently_used_model_is_unloaded(four_models, tokenizer):
    metrics = Metrics()
    store = registry(four_models, 2.5, pinned=[], metrics=metrics)
    m1 = await load(store, "m1")
    await load(store, "m0")
    assert loaded(store) == ["m0", "m1"]
    await load(store, "m1")  # now m0 was used last longest ago
    await load(store, "m2")
    assert loaded(store) == ["m1", "m2"]
    await load(store, "m3")
    assert loaded(store) == ["m2", "m3"]
    weights, working = store.estimate(store.peek("m0"))
    assert store.memory_in_use() == (2 * weights, working)
    assert [counter(metrics, "bert_model_loads_total", n) for n in NAMES] == [1, 1, 1, 1]
    assert [counter(metrics, "bert_model_unloads_total", n) for n in NAMES] == [1, 1, 0, 0]
    assert metrics.registry.get_sample_value("bert_model_memory_bytes") == 2 * weights + working
    assert metrics.registry.get_sample_value("bert_models_loaded") == 2
    assert metrics.registry.get_sample_value("bert_model_load_duration_seconds_count", {"model": "m3"}) == 1
    # An unloaded model's handle (a request in flight holds one) still runs.
    expected = embed_reference(BertModel.from_pretrained(four_models / "models" / "m1"), tokenizer, "the cat")
    assert torch.allclose(embed_reference(m1.model, tokenizer, "the cat"), expected)


async def test_the_default_model_is_pinned(four_models):
    store = registry(four_models, 2.5)  # pinned: unset, so the default (m0)
    await load(store, "m0")
    await load(store, "m1")
    await load(store, "m2")  # m0 is the least recently used, but pinned: m1 goes
    assert loaded(store) == ["m0", "m2"]
    assert store.is_pinned("m0") and not store.is_pinned("m2")


async def test_a_model_larger_than_the_budget_is_a_507(four_models):
    store = registry(four_models, 0.5, pinned=[])
    weights, working = store.estimate(store.peek("m0"))
    with pytest.raises(ServiceError) as raised:
        await load(store, "m1")
    assert raised.value.status_code == 507 and raised.value.error_type == "insufficient_memory"
    assert raised.value.message == (
        f"model 'm1' needs an estimated {format_bytes(weights + working)} ({format_bytes(weights)} of fp32 weights "
        f"and {format_bytes(working)} for a forward pass of BERT_MAX_BATCH_TOKENS=256), more than the "
        f"{format_bytes(store.memory_budget)} model memory budget; raise BERT_MODEL_MEMORY_GB"
    )
    assert loaded(store) == [] and store.memory_in_use() == (0, 0)


async def test_a_model_that_fits_only_without_the_pinned_ones_is_a_507(four_models):
    store = registry(four_models, 2.5, pinned=["m0", "m1"])
    await load(store, "m0")
    await load(store, "m1")
    weights, working = store.estimate(store.peek("m0"))
    with pytest.raises(ServiceError) as raised:
        await load(store, "m2")
    assert raised.value.status_code == 507
    assert raised.value.message == (
        f"model 'm2' needs an estimated {format_bytes(weights + working)} ({format_bytes(weights)} of fp32 weights "
        f"and {format_bytes(working)} for a forward pass of BERT_MAX_BATCH_TOKENS=256), more than the "
        f"{format_bytes(store.memory_budget)} model memory budget less the {format_bytes(2 * weights)} that pinned "
        "models hold (m0, m1); raise BERT_MODEL_MEMORY_GB or pin fewer models (BERT_PINNED_MODELS)"
    )
    assert loaded(store) == ["m0", "m1"]


async def test_concurrent_first_requests_stay_within_the_budget(four_models):
    """12 first requests for 4 models at once, room for 2: each load starts with the budget kept, no model
    loads twice at a time, and every request gets its own model."""
    store = registry(four_models, 2.5, pinned=[])
    loading: set[str] = set()
    seen: list[tuple[int, int]] = []  # at each load's start: bytes counted, models loaded or loading
    original = store._load

    def recording_load(entry):
        assert entry.name not in loading  # single flight per model
        loading.add(entry.name)
        try:
            held, working = store.memory_in_use()
            seen.append((held + working, len(loading | set(loaded(store)))))
            time.sleep(0.01)  # give the others time to pile up behind the budget
            return original(entry)
        finally:
            loading.discard(entry.name)

    async def warm_up(lm):
        for _ in range(3):
            await anyio.sleep(0)

    store._load = recording_load
    store.warm_up = warm_up
    results: dict[int, str] = {}

    async def request(i: int, name: str) -> None:
        results[i] = (await load(store, name)).name

    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(request, i, NAMES[i % 4])
    assert results == {i: NAMES[i % 4] for i in range(12)}
    assert len(seen) >= 4
    assert all(total <= store.memory_budget and models <= 2 for total, models in seen), seen
    assert len(loaded(store)) <= 2


async def test_listing_and_507_over_http(four_models):
    probe = registry(four_models, 2.5)
    weights, working = probe.estimate(probe.peek("m0"))
    budget = probe.memory_budget
    settings = settings_for(
        four_models, default_model="m0", load="lazy", max_batch_tokens=MAX_BATCH_TOKENS, model_memory_gb=budget / 2**30
    )
    async with serve_app(settings, wait_ready=False) as c:
        assert (await c.post("/embeddings", json={"inputs": "the cat", "model": "m1"})).status_code == 200
        body = (await c.get("/models")).json()
        assert body["memory"] == {
            "budget_bytes": budget,
            "loaded_bytes": weights,
            "held_bytes": 0,
            "working_set_bytes": working,
        }
        listed = {m["name"]: m for m in body["models"]}
        assert [(listed[n]["loaded"], listed[n]["pinned"], listed[n]["estimated_bytes"]) for n in NAMES] == [
            (False, True, weights),
            (True, False, weights),
            (False, False, weights),
            (False, False, weights),
        ]
        detail = (await c.get("/models/m1")).json()  # the listing's fields, and the versions
        assert {k: detail[k] for k in listed["m1"]} == listed["m1"] and len(detail["versions"]) == 1

    small = settings.model_copy(update={"model_memory_gb": 4096 / 2**30})
    async with serve_app(small, wait_ready=False) as c:
        r = await c.post("/embeddings", json={"inputs": "the cat", "model": "m2"})
        assert r.status_code == 507
        assert r.json() == {
            "error": f"model 'm2' needs an estimated {format_bytes(weights + working)} ({format_bytes(weights)} of "
            f"fp32 weights and {format_bytes(working)} for a forward pass of BERT_MAX_BATCH_TOKENS=256), more than "
            "the 4.0 KB model memory budget; raise BERT_MODEL_MEMORY_GB",
            "error_type": "insufficient_memory",
        }


# About 10 s of load (the acceptance criterion names 30 s; a third keeps the suite fast and still makes
# every thread cycle through the four models many times, each cycle unloading two of them).
LOAD_SECONDS = 10.0
CLIENT_THREADS = 6


@pytest.mark.slow
def test_live_server_under_a_two_model_budget_answers_every_request_right(four_models, tokenizer):
    """Real uvicorn, room for two of four models, six client threads hitting all four for LOAD_SECONDS:
    no answer is a 5xx and every answer equals the model's own forward pass."""
    probe = registry(four_models, 2.5)
    reference = {
        n: {t: embed_reference(BertModel.from_pretrained(four_models / "models" / n), tokenizer, t) for t in TEXTS}
        for n in NAMES
    }
    port = free_port()
    proc = start_server(
        four_models,
        port,
        BERT_DEFAULT_MODEL="m0",
        BERT_PINNED_MODELS="[]",
        BERT_MAX_LOADS_PER_MINUTE="0",  # every client is the one keyless caller: its loads are what is tested here
        BERT_MAX_BATCH_TOKENS=str(MAX_BATCH_TOKENS),
        BERT_MODEL_MEMORY_GB=repr(probe.memory_budget / 2**30),
        BERT_BROKER_URL="redis://127.0.0.1:1/0",
        OMP_NUM_THREADS="1",
    )
    log: list[str] = []  # read as it comes: a full pipe would block the server's logging
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    answers: list[tuple[str, str, int, object]] = []
    deadline = time.monotonic() + LOAD_SECONDS

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            while time.monotonic() < deadline:
                name, text = NAMES[rng.randrange(4)], rng.choice(TEXTS)
                try:
                    r = http.post("/embeddings", json={"inputs": text, "model": name})
                    answers.append((name, text, r.status_code, r.json()))
                except (httpx.HTTPError, ValueError) as e:  # counted as a failure below, not lost with the thread
                    answers.append((name, text, 599, repr(e)))

    try:
        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENT_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        listing = httpx.get(f"http://127.0.0.1:{port}/models").json()
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)
    assert [a for a in answers if a[2] >= 500] == [], "".join(log)[-3000:]
    assert {a[2] for a in answers} == {200}
    for name, text, _, body in answers:
        assert body == pytest.approx(reference[name][text].tolist(), abs=1e-5), (name, text)
    assert {name for name, *_ in answers} == set(NAMES)
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line[0] != "#"}
    assert all(samples[f'bert_model_loads_total{{model="{n}"}}'] >= 1 for n in NAMES)
    assert sum(v for k, v in samples.items() if k.startswith("bert_model_unloads_total")) >= 2
    memory = listing["memory"]
    assert memory["loaded_bytes"] + memory["working_set_bytes"] <= memory["budget_bytes"] == probe.memory_budget
    assert sum(m["loaded"] for m in listing["models"]) <= 2


# -- which model goes: the keys that use it ----------------------------------------------------------


async def test_a_model_several_keys_use_outlives_one_keys_churn(four_models):
    """Room for two models: three keys use m1, then one key alternates m2 and m3. Each of its loads unloads
    its own last model, never m1 (least recently used, so plain LRU would have unloaded it first)."""
    metrics = Metrics()
    store = registry(four_models, 2.5, pinned=[], metrics=metrics)
    for key in ("alice", "bob", "carol"):
        await store.ensure_loaded(store.peek("m1"), user=key)
    after_each = []
    for name in ["m2", "m3"] * 3:
        await store.ensure_loaded(store.peek(name), user="churn")
        after_each.append(loaded(store))
    assert after_each == [["m1", "m2"], ["m1", "m3"]] * 3
    assert [counter(metrics, "bert_model_unloads_total", n) for n in NAMES] == [0, 0, 3, 2]

    lru = registry(four_models, 2.5, pinned=[])  # the same requests without keys: least recently used first
    for name in ["m1", "m2", "m3"]:
        await load(lru, name)
    assert loaded(lru) == ["m2", "m3"]


async def test_a_keys_use_counts_for_a_minute(four_models):
    """One neighbour key on m1 keeps it against another key's churn while its use is recent
    (RECENT_USERS_S); after that, least recently used decides again."""
    store = registry(four_models, 2.5, pinned=[])
    now = [1000.0]
    store.clock = lambda: now[0]
    await store.ensure_loaded(store.peek("m1"), user="neighbour")
    await store.ensure_loaded(store.peek("m2"), user="churn")
    await store.ensure_loaded(store.peek("m3"), user="churn")
    assert loaded(store) == ["m1", "m3"]
    now[0] += RECENT_USERS_S + 1
    await store.ensure_loaded(store.peek("m2"), user="churn")
    assert loaded(store) == ["m2", "m3"]


async def test_among_models_as_many_other_keys_use_the_loading_keys_own_goes_first(four_models):
    """m1 is the neighbour's, m2 is used by keys a and b. When a loads m3, each of m1 and m2 has one other
    key; m2 is a's own, so it goes, though m1 was used longer ago."""
    store = registry(four_models, 2.5, pinned=[])
    await store.ensure_loaded(store.peek("m1"), user="neighbour")
    await store.ensure_loaded(store.peek("m2"), user="a")
    await store.ensure_loaded(store.peek("m2"), user="b")
    await store.ensure_loaded(store.peek("m3"), user="a")
    assert loaded(store) == ["m1", "m3"]


# -- memory that requests still hold -----------------------------------------------------------------


async def test_an_unloaded_model_stays_counted_until_its_last_holder_lets_go(four_models):
    """Room for 2.5 models. m1 is held by a request when m3's load unloads it: its bytes stay counted, so
    m3 waits for them, and past BERT_LOAD_WAIT_SECONDS it is a 503 with Retry-After. A request for m1
    takes the held copy back without a load; once its holders let go, m3 loads."""
    metrics = Metrics()
    store = registry(four_models, 2.5, pinned=[], metrics=metrics, load_wait_s=0.05)
    weights, working = store.estimate(store.peek("m0"))
    m1 = await store.get("m1")  # a request holds it
    await load(store, "m2")
    with pytest.raises(ServiceError) as raised:
        await load(store, "m3")
    assert raised.value.status_code == 503 and raised.value.headers == {"Retry-After": "1"}
    assert raised.value.message == (
        f"model 'm3' needs an estimated {format_bytes(weights + working)} of the "
        f"{format_bytes(store.memory_budget)} model memory budget, and after 0.05 s (BERT_LOAD_WAIT_SECONDS) "
        f"the models in use still hold {format_bytes(2 * weights)} of it ({format_bytes(weights)} of that by "
        "unloaded models that requests still run on); retry in 1 s"
    )
    assert loaded(store) == ["m2"] and m1.holders == 1
    assert store.memory_in_use() == (2 * weights, working) and store.held_bytes() == weights
    assert metrics.registry.get_sample_value("bert_model_memory_bytes") == 2 * weights + working

    again = await store.get("m1")  # the held copy, loaded again without a load
    assert again is m1 and m1.holders == 2 and loaded(store) == ["m1", "m2"] and store.held_bytes() == 0
    assert counter(metrics, "bert_model_loads_total", "m1") == 1

    store.load_wait_s = 5.0
    await load(store, "m2")  # m1 is the least recently used again
    async with anyio.create_task_group() as tg:
        tg.start_soon(load, store, "m3")  # unloads m1 again, then waits for its holders
        await until(lambda: "m1" not in loaded(store))
        assert store.peek("m3").reserved_bytes == 0 and store.held_bytes() == weights
        store.release(m1)
        assert store.held_bytes() == weights  # one holder left
        store.release(m1)
    assert loaded(store) == ["m2", "m3"] and store.held_bytes() == 0
    assert store.memory_in_use() == (2 * weights, working)


async def test_a_pass_still_running_on_an_unloaded_model_holds_it(four_models):
    """Over HTTP: a request on m1 whose client leaves while its pass runs lets go of m1, but its work item
    does not. m2 and then m3 are asked for (/tokenize loads without a pass); m3's load unloads m1 and
    waits for the pass, a 503 with Retry-After; /models shows the held bytes; when the pass ends, m3 loads."""
    probe = registry(four_models, 2.5)
    weights, working = probe.estimate(probe.peek("m0"))
    settings = settings_for(
        four_models,
        default_model="m0",
        load="lazy",
        pinned_models=[],
        max_batch_tokens=MAX_BATCH_TOKENS,
        model_memory_gb=probe.memory_budget / 2**30,
        load_wait_seconds=0.2,
    )
    async with serve_app(settings, wait_ready=False) as c:
        service = c.app.state.service
        spy = Spy(service.engine, "encode", hold=True)
        try:
            async with anyio.create_task_group() as tg:
                running = RawRequest(c.app, "/embeddings", {"inputs": "the cat", "model": "m1"})
                tg.start_soon(running.run)
                await until(spy.entered.is_set)  # its pass is in the runner
                running.leave()
                await until(running.done.is_set)
                assert (await c.post("/tokenize", json={"inputs": "the cat", "model": "m2"})).status_code == 200
                r = await c.post("/tokenize", json={"inputs": "the cat", "model": "m3"})
                assert (r.status_code, r.headers["retry-after"], r.json()["error_type"]) == (503, "1", "unavailable")
                assert "0.2 s (BERT_LOAD_WAIT_SECONDS)" in r.json()["error"]
                memory = (await c.get("/models")).json()["memory"]
                assert memory == {
                    "budget_bytes": probe.memory_budget,
                    "loaded_bytes": weights,
                    "held_bytes": weights,
                    "working_set_bytes": working,
                }
                spy.gate.set()
            await until(lambda: service.registry.held_bytes() == 0)
        finally:
            spy.restore()
        assert (await c.post("/tokenize", json={"inputs": "the cat", "model": "m3"})).status_code == 200
        listed = {m["name"]: m["loaded"] for m in (await c.get("/models")).json()["models"]}
        assert listed == {"m0": False, "m1": False, "m2": True, "m3": True}
