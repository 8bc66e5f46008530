"""Bounded work per request: cost limits decided before inference, bounded and cancellable pools,
a deadline, and a large request that cannot hold a small one for more than a forward pass."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading

import anyio
import pytest

from app.serving.embed_pipeline import EmbedPlan
from tests.app.conftest import serve_app, settings_for
from tests.app.test_engine import metric

pytestmark = pytest.mark.anyio


def err(kind: str, message: str) -> dict:
    return {"error": message, "error_type": kind}


class Spy:
    """Wraps one engine runner: records each forward pass (its rows, per work item) and can hold
    passes at a gate until the test lets them go."""

    def __init__(self, engine, task: str, hold: bool = False):
        self.engine, self.task, self.original = engine, task, engine.runners[task]
        self.passes: list[list[int]] = []  # per pass: the row count of the work item of each row
        self.entered = threading.Event()
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        engine.runners[task] = self

    def __call__(self, lm, batch):
        self.passes.append([len(item.rows) for item, _ in batch.origin])
        self.entered.set()
        self.gate.wait(10)
        return self.original(lm, batch)

    def restore(self):
        self.gate.set()
        self.engine.runners[self.task] = self.original


@contextlib.asynccontextmanager
async def warm(data_dir, **overrides):
    """A served app whose default model (tiny-enc) is loaded and warmed up, and no other: no
    background warm-up pass can reach a spy."""
    settings = settings_for(data_dir, default_model="tiny-enc", load="lazy", **overrides)
    async with serve_app(settings, wait_ready=False) as c:
        assert (await c.post("/embeddings", json={"inputs": "warm up"})).status_code == 200
        yield c


async def until(condition, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.005)


# -- cost limits, checked after tokenising and before the engine -------------------------------


async def test_too_many_masks_is_422_before_any_inference(data_dir):
    # The request ("[MASK] " * 510, top_k 100), scaled to the tiny model's 32 positions.
    text = "[MASK] " * 30
    async with serve_app(settings_for(data_dir, max_masks_per_input=8)) as c:
        spy = Spy(c.app.state.service.engine, "mlm")
        too_many = err(
            "validation", "input 0 has 30 [MASK] tokens, more than the 8 per input that BERT_MAX_MASKS_PER_INPUT allows"
        )
        r = await c.post("/fill-mask", json={"inputs": text, "top_k": 100})
        assert r.status_code == 422 and r.json() == too_many
        r = await c.post("/fill-mask", json={"inputs": [text] * 64, "top_k": 100})  # 64 copies in one request
        assert r.status_code == 422 and r.json() == too_many
        r = await c.post("/fill-mask", json={"inputs": ["a [MASK]", "[MASK] " * 9], "top_k": 1})
        assert r.status_code == 422 and r.json()["error"].startswith("input 1 has 9 [MASK] tokens")
        assert spy.passes == []
        assert (await c.post("/fill-mask", json={"inputs": "[MASK] " * 8, "top_k": 1})).status_code == 200


async def test_too_many_candidates_is_422_naming_the_limit(data_dir):
    async with serve_app(settings_for(data_dir, max_fill_mask_candidates=20)) as c:
        spy = Spy(c.app.state.service.engine, "mlm")
        r = await c.post("/fill-mask", json={"inputs": ["the [MASK] sat"] * 3 + ["a [MASK] and a [MASK]"], "top_k": 5})
        assert r.status_code == 422
        assert r.json() == err(
            "validation",
            "the request asks for 25 candidates (5 [MASK] tokens x top_k), more "
            "than the 20 per request that BERT_MAX_FILL_MASK_CANDIDATES allows",
        )
        assert spy.passes == []
        ok = {"inputs": ["the [MASK] sat"] * 5, "top_k": 4}  # 20: at the limit
        assert (await c.post("/fill-mask", json=ok)).status_code == 200
        # top_k counts as the number of targets when there are fewer of them
        r = await c.post(
            "/fill-mask", json={"inputs": ["the [MASK] sat"] * 10, "top_k": 100, "targets": ["cat", "dog"]}
        )
        assert r.status_code == 200 and len(r.json()) == 10 and len(r.json()[0]) == 2


async def test_too_many_tokens_is_422_on_every_route(data_dir):
    async with serve_app(settings_for(data_dir, max_request_tokens=12)) as c:
        message = err(
            "validation",
            "the request is 14 tokens long (all inputs together), more than the 12 that BERT_MAX_REQUEST_TOKENS allows",
        )
        texts = ["the cat sat on the mat", "a dog"]  # 8 + 4 tokens... with [CLS]/[SEP]: 8 + 4 = 12
        assert (await c.post("/embeddings", json={"inputs": texts})).status_code == 200
        texts = ["the cat sat on the mat .", "a big dog"]  # 9 + 5 = 14
        for path, body in [
            ("/embeddings", {"inputs": texts}),
            ("/v1/embeddings", {"input": texts}),
            ("/classify", {"inputs": texts, "model": "tiny-cls"}),
            ("/fill-mask", {"inputs": [t + " [MASK]" for t in texts]}),
            ("/nsp", {"inputs": {"text_a": texts[0], "text_b": texts[1]}}),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 422, path
            tokens = 14 + 2 * (path == "/fill-mask") - (path == "/nsp")  # a pair shares one [CLS]
            text = message["error"].replace("14", str(tokens))
            if path.startswith("/v1/"):  # OpenAI's error shape there (app/errors.py)
                assert r.json()["error"] == {
                    "message": text,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            else:
                assert r.json() == err("validation", text), path


# -- the tokeniser pool: bounded, and work of a request that went away is dropped ---------------


async def test_full_tokenizer_queue_is_429_with_retry_after(data_dir):
    settings = settings_for(data_dir, tokenizer_threads=1, max_tokenizer_queue=2)
    async with serve_app(settings) as c:
        service, gate = c.app.state.service, threading.Event()
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(service.off_loop, gate.wait, 10)
                await until(lambda: service._pool_jobs == 2)
                r = await c.post("/embeddings", json={"inputs": "the cat"})
                assert r.status_code == 429
                assert r.json() == err("overloaded", "the tokeniser queue is full (2 jobs waiting); retry later")
                assert r.headers["retry-after"] == "1"
                gate.set()
        finally:
            gate.set()
        assert (await c.post("/embeddings", json={"inputs": "the cat"})).status_code == 200


async def test_full_inference_queue_429_has_retry_after(data_dir):
    async with warm(data_dir, max_queue=1) as c:
        spy = Spy(c.app.state.service.engine, "encode", hold=True)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(c.post, "/embeddings", json={"inputs": "running"}))
                await until(spy.entered.is_set)
                tg.start_soon(functools.partial(c.post, "/embeddings", json={"inputs": "queued"}))
                await until(lambda: c.app.state.service.engine.depth == 1)
                r = await c.post("/embeddings", json={"inputs": "the cat"})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                spy.gate.set()
        finally:
            spy.restore()


# -- a request that goes away: raw ASGI calls whose client disconnects ---------------------------


class RawRequest:
    """One POST straight into the ASGI app; `leave()` makes its client disconnect."""

    def __init__(self, app, path: str, body: dict):
        self.app, self.body = app, json.dumps(body).encode()
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "client": ("127.0.0.1", 5000),
            "server": ("test", 80),
            "headers": [
                (b"host", b"test"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()),
            ],
        }
        self.sent: list[dict] = []
        self.gone = asyncio.Event()
        self.done = asyncio.Event()
        self._body_sent = False

    async def receive(self):
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)

    async def run(self):
        try:
            await self.app(self.scope, self.receive, self.send)
        finally:
            self.done.set()

    def leave(self):
        self.gone.set()


async def test_disconnected_clients_work_is_dropped_queued_or_between_passes(data_dir, monkeypatch):
    # max_batch_tokens 8: one 5-token row per pass, so a 3-input request takes 3 passes.
    async with warm(data_dir, max_batch_tokens=8, tokenizer_threads=1) as c:
        service = c.app.state.service
        tokenised = []
        original_prepare = EmbedPlan.prepare

        def counting_prepare(plan, lm, items):
            tokenised.append(items)
            return original_prepare(plan, lm, items)

        monkeypatch.setattr(EmbedPlan, "prepare", counting_prepare)
        spy = Spy(service.engine, "encode", hold=True)
        pool_gate = threading.Event()
        try:
            async with anyio.create_task_group() as tg:
                running = RawRequest(c.app, "/embeddings", {"inputs": ["the cat sat"] * 3})
                tg.start_soon(running.run)
                await until(spy.entered.is_set)  # its first pass is in the runner
                queued = RawRequest(c.app, "/embeddings", {"inputs": "the dog sat"})
                tg.start_soon(queued.run)
                await until(lambda: service.engine.depth == 2)  # the rest of `running`, and `queued`
                tg.start_soon(service.off_loop, pool_gate.wait, 10)  # the one tokeniser thread is busy
                untokenised = RawRequest(c.app, "/embeddings", {"inputs": "a red car"})
                tg.start_soon(untokenised.run)
                await until(lambda: service._pool_jobs == 2)
                for request in (running, queued, untokenised):
                    request.leave()
                    await until(request.done.is_set)
                    assert request.sent == []  # nothing to answer: the client is gone
                spy.gate.set()
                pool_gate.set()
            await until(lambda: not service.engine.busy and service.engine.depth == 0)
            assert spy.passes == [[3]]  # `running` stopped after the pass under way; `queued` never ran
            assert tokenised == [["the cat sat"] * 3, ["the dog sat"]]  # `untokenised` dropped unrun
            assert (await c.post("/embeddings", json={"inputs": "the cat"})).status_code == 200
            text = (await c.get("/metrics")).text
            assert metric(text, "bert_requests_total", route="/embeddings", status="499") == 3
            assert metric(text, "bert_requests_total", route="/embeddings", status="500") == 0
        finally:
            spy.restore()
            pool_gate.set()


class HeldTokenizer:
    """Stands for one tokenizer method: records the text of each call, and holds the first at a gate (a
    tokeniser job running when its request goes away)."""

    def __init__(self, method):
        self.method, self.texts = method, []
        self.entered, self.gate = threading.Event(), threading.Event()

    def __call__(self, text, *args, **kwargs):
        self.texts.append(text)
        if len(self.texts) == 1:
            self.entered.set()
            self.gate.wait(10)
        return self.method(text, *args, **kwargs)


def hold_tokenizer(lm, path: str, monkeypatch) -> HeldTokenizer:
    """Hold what `path` tokenizes each input with: BertTokenizer.encode, or the Rust tokenizer's (/tokenize:
    encode_batch of one input, as model.tokenizer.encode_one calls it)."""
    if path != "/tokenize":
        held = HeldTokenizer(lm.tokenizer.encode)
        monkeypatch.setattr(lm.tokenizer, "encode", held)
        return held
    backend = lm.tokenizer.backend_tokenizer
    held = HeldTokenizer(lambda text, *args, **kwargs: backend.encode_batch([text], *args, **kwargs))
    proxy = type(
        "Backend",
        (),
        {
            "encode_batch": staticmethod(lambda inputs, *args, **kwargs: held(*inputs, *args, **kwargs)),
            "__getattr__": lambda self, name: getattr(backend, name),
        },
    )
    monkeypatch.setattr(type(lm.tokenizer), "backend_tokenizer", property(lambda self: proxy()))
    return held


@pytest.mark.parametrize("path", ["/embeddings", "/tokenize"])
async def test_a_running_tokeniser_job_stops_between_inputs_when_its_client_leaves(data_dir, monkeypatch, path):
    async with warm(data_dir, tokenizer_threads=1) as c:
        service = c.app.state.service
        held = hold_tokenizer(await service.loaded_model("tiny-enc"), path, monkeypatch)
        request = RawRequest(c.app, path, {"inputs": ["one", "two", "three"]})
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(request.run)
                await until(held.entered.is_set)
                request.leave()
                await until(request.done.is_set)
        finally:
            held.gate.set()
        await service.off_loop(lambda: None)  # after the dropped job: the pool has one thread
        assert request.sent == [] and held.texts == ["one"]
        text = (await c.get("/metrics")).text
        assert metric(text, "bert_requests_total", route=path, status="499") == 1


async def test_tokenize_has_the_deadline_of_the_other_routes(data_dir, monkeypatch):
    async with warm(data_dir, request_timeout=0.5, tokenizer_threads=1) as c:
        service = c.app.state.service
        held = hold_tokenizer(await service.loaded_model("tiny-enc"), "/tokenize", monkeypatch)
        try:
            r = await c.post("/tokenize", json={"inputs": ["one", "two"]})
        finally:
            held.gate.set()
        assert r.status_code == 503
        assert r.json() == err(
            "unavailable", "the request took longer than BERT_REQUEST_TIMEOUT (0.5 s); its work was dropped"
        )
        await service.off_loop(lambda: None)
        assert held.texts == ["one"]


async def test_request_timeout_is_503_and_drops_the_work(data_dir):
    async with warm(data_dir, request_timeout=0.5) as c:
        spy = Spy(c.app.state.service.engine, "encode", hold=True)
        answers = {}

        async def call(key, text):
            answers[key] = await c.post("/embeddings", json={"inputs": text})

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "running", "the cat")
                await until(spy.entered.is_set)
                tg.start_soon(call, "queued", "the dog")
                await until(lambda: "queued" in answers and "running" in answers)
                spy.gate.set()
        finally:
            spy.restore()
        late = err("unavailable", "the request took longer than BERT_REQUEST_TIMEOUT (0.5 s); its work was dropped")
        for key in ("running", "queued"):
            assert answers[key].status_code == 503 and answers[key].json() == late
        await until(lambda: not c.app.state.service.engine.busy and c.app.state.service.engine.depth == 0)
        assert spy.passes == [[1]]  # the queued request never ran
        assert (await c.post("/embeddings", json={"inputs": "the cat"})).status_code == 200


# -- scheduling: a large request cannot hold a small one for more than a pass --------------------


async def test_a_small_request_runs_in_the_pass_after_a_large_ones_current_pass(data_dir):
    async with warm(data_dir, max_batch_tokens=12, max_wait_ms=0) as c:
        engine = c.app.state.service.engine
        spy = Spy(engine, "encode", hold=True)
        answers = {}

        async def call(key, inputs):
            answers[key] = await c.post("/embeddings", json={"inputs": inputs})

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "large", ["the cat sat on the mat"] * 10)  # 8 tokens: one row per pass
                await until(spy.entered.is_set)
                tg.start_soon(call, "small", "dog")
                await until(lambda: engine.depth == 2)
                spy.gate.set()
        finally:
            spy.restore()
        assert answers["large"].status_code == 200 and answers["small"].status_code == 200
        assert spy.passes == [[10], [1]] + [[10]] * 9
