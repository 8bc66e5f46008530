"""The batching engine: token-budget batches, concurrency, batching on and off, metrics."""

from __future__ import annotations

import re

import anyio
import pytest
import torch
import torch.nn.functional as F

from app.serving.engine import WorkItem, plan_batch
from tests.app.conftest import serve_app, settings_for
from tests.app.test_inference import embed_reference, mlm_reference

pytestmark = pytest.mark.anyio

WORDS = "the quick brown fox jumped over a lazy dog and ran to the river with five happy children".split()


def test_plan_batch_takes_shortest_rows_first_within_the_padded_budget():
    item = WorkItem("encode", lm=None, rows=[([0] * n, [0] * n) for n in (9, 3, 30, 5, 8, 4, 70)])
    passes = []
    while item.todo:
        passes.append(plan_batch([item], max_tokens=32))
    lengths = [[n for _, _, n in p] for p in passes]
    assert lengths == [[3, 4, 5, 8], [9], [30], [70]]  # 70 is over budget: it runs alone
    assert sorted(i for p in passes for _, i, _ in p) == list(range(7))


def test_plan_batch_fills_a_pass_from_later_items_in_order():
    big = WorkItem("encode", lm=None, rows=[([0] * 10, [0] * 10)] * 5)
    small = WorkItem("encode", lm=None, rows=[([0] * 3, [0] * 3)])
    planned = plan_batch([small, big], max_tokens=32)
    assert [(it is small, n) for it, _, n in planned] == [(True, 3), (False, 10), (False, 10)]  # 3 x 10 <= 32
    assert small.todo == [] and len(big.todo) == 3


def test_online_items_go_before_a_batch_jobs_in_passes_of_their_own():
    """The engine's order (Engine._take), on items queued before its thread starts: a batch job's items
    (background) wait while any online item waits, and an online item's pass takes no batch rows."""
    from types import SimpleNamespace

    from app.serving.engine import Engine

    lm = SimpleNamespace(name="m")
    engine = Engine(torch.device("cpu"), {}, max_batch_tokens=40, max_queue=10, max_wait_ms=0, batching=True)
    row = ([0] * 10, [0] * 10)
    batch_a = WorkItem("encode", lm, [row] * 3, background=True)
    other_model = WorkItem("classify", SimpleNamespace(name="n"), [row])
    batch_b = WorkItem("classify", lm, [row] * 2, background=True)
    online = WorkItem("encode", lm, [row])
    for item in (batch_a, other_model, batch_b, online):
        engine.submit(item)
    assert [it for it, _, _ in engine._take()] == [other_model]  # the oldest online item, not the batch's
    assert [it for it, _, _ in engine._take()] == [online]  # alone, though batch_a is of its model and task
    assert [it for it, _, _ in engine._take()] == [batch_a] * 3  # no online item waits: the batches' turn
    assert [it for it, _, _ in engine._take()] == [batch_b] * 2


def test_a_batch_jobs_pass_is_short_while_online_requests_come_and_whole_without_them():
    """Engine._take's budget for a pass that starts from a batch job's item: background_pass_tokens while an
    online item was queued within ONLINE_RECENT_S (the engine's own clock), max_batch_tokens otherwise."""
    from types import SimpleNamespace

    from app.serving.engine import Engine

    lm, row = SimpleNamespace(name="m"), ([0] * 10, [0] * 10)
    engine = Engine(
        torch.device("cpu"),
        {},
        max_batch_tokens=80,
        max_queue=10,
        max_wait_ms=0,
        batching=True,
        background_pass_tokens=20,
    )
    batch = WorkItem("encode", lm, [row] * 8, background=True)
    engine.submit(batch)
    assert len(engine._take()) == 8  # no online request yet: a whole pass (8 x 10 tokens)

    engine.ONLINE_RECENT_S = float("inf")  # every online item counts as recent, however slow this machine is
    batch = WorkItem("encode", lm, [row] * 8, background=True)
    online = WorkItem("classify", SimpleNamespace(name="n"), [row])
    engine.submit(batch)
    engine.submit(online)
    assert [it for it, _, _ in engine._take()] == [online]
    assert [it for it, _, _ in engine._take()] == [batch, batch]  # 2 x 10 tokens: background_pass_tokens
    assert len(batch.todo) == 6  # the rest waits for later passes

    engine.ONLINE_RECENT_S = 0.0  # the online request is long past: whole passes again
    assert len(engine._take()) == 6


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(part in m.group(1) for part in want.split(",")):
            total += float(m.group(2))
    return total


async def test_64_concurrent_requests_are_batched_and_correct(data_dir, reference, tokenizer):
    texts = [" ".join(WORDS[i % 7 : i % 7 + 2 + i % 9]) for i in range(32)]
    masked = ["[MASK] " + t for t in texts]
    expected_vectors = [embed_reference(reference["tiny-pt"].bert, tokenizer, t) for t in texts]
    expected_top = [mlm_reference(reference["tiny-pt"], tokenizer, t, 3)[0][1].tolist() for t in masked]
    async with serve_app(settings_for(data_dir, max_wait_ms=10.0, load="lazy"), wait_ready=False) as c:
        assert (await c.post("/embeddings", json={"inputs": "warm"})).status_code == 200
        answers = {}

        async def call(kind, i):
            if kind == "embed":
                answers[kind, i] = await c.post("/embeddings", json={"inputs": texts[i]})
            else:
                answers[kind, i] = await c.post("/fill-mask", json={"inputs": masked[i], "top_k": 3})

        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(call, "embed", i)
                tg.start_soon(call, "fill", i)
        assert all(r.status_code == 200 for r in answers.values())
        for i in range(32):
            got = torch.tensor(answers["embed", i].json())
            assert F.cosine_similarity(got, expected_vectors[i], dim=0).item() >= 0.9999
            assert [c["token"] for c in answers["fill", i].json()] == expected_top[i]

        text = (await c.get("/metrics")).text
        for task in ("encode", "mlm"):
            rows = metric(text, "bert_batch_size_sum", task=task)
            passes = metric(text, "bert_batch_size_count", task=task)
            assert rows / passes > 1, (task, rows, passes)
        assert metric(text, "bert_requests_total", route="/fill-mask", status="200") == 32
        assert metric(text, "bert_tokens_processed_total", task="mlm") == sum(
            len(tokenizer.encode(t)["input_ids"]) for t in masked
        )
        assert "bert_queue_depth 0.0" in text
        assert metric(text, "bert_request_duration_seconds_count", route="/embeddings", status="200") == 33


async def test_batching_off_runs_each_request_alone(data_dir):
    settings = settings_for(data_dir, batching=False, load="lazy", default_model="tiny-enc")
    async with serve_app(settings, wait_ready=False) as c:
        statuses = []

        async def call():
            r = await c.post("/embeddings", json={"inputs": ["the cat", "the quick brown dog"]})
            statuses.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(17):
                tg.start_soon(call)
        assert statuses == [200] * 17
        text = (await c.get("/metrics")).text
        rows = metric(text, "bert_batch_size_sum", task="encode")
        passes = metric(text, "bert_batch_size_count", task="encode")
        # one pass per request (loaded by the first request, which is its first use: no warm-up passes)
        assert rows == 17 * 2 and passes == 17


async def test_warm_up_runs_a_padded_and_an_unpadded_batch(data_dir):
    """Each attention path (masked or packed, and plain) loads its own kernels on a GPU: the warm-up runs
    both before the first request, with rows as long as the model takes (up to WARM_UP_TOKENS)."""
    from app.serving.service import Service

    seen = []
    settings = settings_for(data_dir, load="lazy", default_model="tiny-enc")
    async with serve_app(settings, wait_ready=False) as c:
        assert (await c.post("/embeddings", json={"inputs": "the cat"})).status_code == 200
        service: Service = c._transport.app.state.service
        lm = service.registry.peek("tiny-enc").loaded
        original = service.run

        async def spy(item):
            seen.append(sorted(len(ids) for ids, _ in item.rows))
            return await original(item)

        service.run = spy
        await service.warm_up(lm)
    n = min(128, lm.max_length)
    assert seen == [[2, n], [n, n]]


async def test_a_lane_gives_the_engine_few_large_items_and_each_request_its_own_rows(data_dir):
    """A batch's lines (app/serving/service.py Lane): 40 concurrent requests reach the engine as a handful
    of work items; each gets the rows it asked for, equal to its answer alone; options that differ are
    never merged."""
    import asyncio

    from app.serving.service import LANE, Lane

    texts = [" ".join(WORDS[i % 5 : i % 5 + 1 + i % 11]) for i in range(40)]
    async with serve_app(settings_for(data_dir, load="startup")) as c:
        service = c.app.state.service
        lm = await service.loaded_model(None)
        rows = [(e["input_ids"], e["token_type_ids"]) for e in (lm.tokenizer.encode(t) for t in texts)]

        def item(i: int) -> WorkItem:  # two rows each: its text and the next one
            return WorkItem("encode", lm, [rows[i], rows[(i + 1) % 40]], {"pooling": "mean", "normalize": i % 2 == 0})

        alone = [await service.run(item(i)) for i in range(40)]
        submitted: list[WorkItem] = []
        submit = service.engine.submit
        service.engine.submit = lambda it: (it.lm is lm and submitted.append(it), submit(it))[1]

        async def lane_run() -> list:
            LANE.set(Lane(service, pool_slots=4))
            return await asyncio.gather(*(service.run(item(i)) for i in range(40)))

        together = await asyncio.create_task(lane_run())
        assert 2 <= len(submitted) < 10 and sum(len(it.rows) for it in submitted) == 80
        assert {it.params["normalize"] for it in submitted} == {True, False}
        for it in submitted:  # one item holds requests of one set of options only
            assert {tuple(r[0]) for r in it.rows} <= {tuple(rows[i][0]) for i in range(40)}
        for i in range(40):
            assert len(together[i]) == 2
            for got, want in zip(together[i], alone[i]):
                got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
                assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() >= 0.9999, i
                assert torch.allclose(got.norm(), want.norm(), rtol=1e-4), i  # normalised or not, as asked
        assert LANE.get() is None  # the lane was the child task's only


async def test_a_lane_cuts_its_oldest_requests_first_and_lets_a_trickle_wait_for_company(data_dir):
    """cut_rows: a cut sorts and cuts the rows of the oldest requests only, up to that many rows, and the
    rest wait for the next cut. While one of the lane's passes runs, rows that come a few at a time are not
    cut into passes of their own: they wait for that pass to end (or for MIN_CUT passes' worth)."""
    import asyncio

    from app.serving.service import LANE, Lane

    texts = [" ".join(WORDS[i % 7 : i % 7 + 2 + i % 13]) for i in range(40)]
    async with serve_app(settings_for(data_dir, load="startup")) as c:
        service = c.app.state.service
        lm = await service.loaded_model(None)
        rows = [(e["input_ids"], e["token_type_ids"]) for e in (lm.tokenizer.encode(t) for t in texts)]
        owner = {tuple(row[0]): i for i, row in enumerate(rows)}
        assert len(owner) == 40
        submitted: list[WorkItem] = []
        submit = service.engine.submit
        service.engine.submit = lambda it: (it.lm is lm and submitted.append(it), submit(it))[1]

        def item(i: int) -> WorkItem:
            return WorkItem("encode", lm, [rows[i]], {"pooling": "mean", "normalize": True})

        async def cut_in_tens() -> list:
            LANE.set(Lane(service, pool_slots=4, cut_rows=10))
            return await asyncio.gather(*(service.run(item(i)) for i in range(40)))

        together = await asyncio.create_task(cut_in_tens())
        assert [len(r) for r in together] == [1] * 40
        blocks = [{owner[tuple(row[0])] // 10 for row in it.rows} for it in submitted]
        assert all(len(b) == 1 for b in blocks), blocks  # a pass holds rows of one cut: ten requests in order
        assert [min(b) for b in blocks] == sorted(min(b) for b in blocks)  # the oldest requests' cut first

        submitted.clear()

        async def trickle() -> list:
            lane = Lane(service, pool_slots=4)
            LANE.set(lane)
            lane._in_flight = 1  # one of the lane's passes is running
            later = []
            for i in range(40):  # one request at a time, each past the lane's delay_s
                later.append(asyncio.ensure_future(service.run(item(i))))
                await asyncio.sleep(0.005)
            assert not submitted, "a trickle under MIN_CUT passes' worth was cut while the lane's pass ran"
            lane._in_flight = 0  # that pass ends
            lane._fill()
            return await asyncio.gather(*later)

        alone = await asyncio.create_task(trickle())
        assert [len(r) for r in alone] == [1] * 40
        assert len(submitted) == 1 and len(submitted[0].rows) == 40  # cut together: one pass, sorted by length


async def test_a_lane_whose_requests_all_went_away_drops_its_passes(data_dir):
    """Requests cancelled while the lane holds their rows: the pass under way is cancelled, the passes not
    yet queued never reach the engine."""
    import asyncio

    from app.serving.service import LANE, Lane

    async with serve_app(settings_for(data_dir, load="startup", max_batch_tokens=256)) as c:
        service = c.app.state.service
        lm = await service.loaded_model(None)
        row = ([lm.tokenizer.cls_token_id] + [7] * 30 + [lm.tokenizer.sep_token_id], [0] * 32)  # 8 rows a pass:
        # 750 passes, far more than run before the requests go away
        submitted: list[WorkItem] = []  # this model's: others are still being warmed up
        submit = service.engine.submit
        service.engine.submit = lambda item: (item.lm is lm and submitted.append(item), submit(item))[1]

        async def lane_run() -> None:
            LANE.set(Lane(service, pool_slots=4))
            tasks = [
                asyncio.create_task(
                    service.run(WorkItem("encode", lm, [row] * 2000, {"pooling": "mean", "normalize": True}))
                )
                for _ in range(3)
            ]
            with anyio.fail_after(10):
                while not submitted:
                    await asyncio.sleep(0.001)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            queued.append(len(submitted))
            await asyncio.sleep(0.1)  # the lane's ticks go on: nothing more is queued

        queued: list[int] = []
        await asyncio.create_task(lane_run())
        assert len(submitted) == queued[0], "passes were queued after their requests went away"
        assert all(len(item.rows) <= 8 for item in submitted)  # one pass each
        assert 1 <= sum(len(item.rows) for item in submitted) < 3000  # of 6000 rows
        assert all(item.future.done() for item in submitted)
