"""BERT_PRECISION=auto on a CPU (app/serving/auto_precision.py): each model is served at the fastest precision its
card measured within the bounds on this kind of CPU, /models says why; BERT_MODEL_PRECISION and a fixed
BERT_PRECISION still win; a kind of CPU the card lacks is served in fp32 while it is measured in the background,
then the card has the row and the model is loaded again at the chosen precision (in process, and over a real
server). Each test works on its own copy of the models: the measurement writes their cards."""

from __future__ import annotations

import shutil
import threading
import time

import anyio
import httpx
import pytest
import torch

from app.prometheus import Metrics
from app.serving.service import Service
from datadir.cards import read_card, update_card
from model import model_card, precision_choice
from model.precision_choice import Bounds, choose, cpu_kind
from tests.app.conftest import serve_app, settings_for
from tests.helpers import start_server

pytestmark = pytest.mark.anyio
KIND = "x86 test-cpu"  # the kind of CPU these tests pretend to be, with bf16 and int8 native
TEXTS = ["the cat sat on the mat.", "a big dog ran to the river."]


@pytest.fixture
def models(data_dir, tmp_path):
    """A copy of the session's models, for a test that writes their cards."""
    root = tmp_path / "data"
    shutil.copytree(data_dir / "models", root / "models")
    return root


@pytest.fixture
def test_cpu(monkeypatch):
    monkeypatch.setattr(precision_choice, "cpu_kind", lambda info=None: KIND)
    monkeypatch.setattr(precision_choice, "native_precisions", lambda info=None: ["fp32", "bf16", "int8"])


def measured(outputs: list[str], bf16: dict, int8: dict) -> dict:
    return {"outputs": outputs, "precisions": {"fp32": {"speed": 1.0}, "bf16": bf16, "int8": int8}}


COS = {"min_cosine": 0.99991, "mean_cosine": 0.99996}
LOW_COS = {"min_cosine": 0.997, "mean_cosine": 0.998}
ROWS = {
    "tiny-enc": measured(["embeddings"], {"speed": 3.4, "embeddings": COS}, {"speed": 2.0, "embeddings": LOW_COS}),
    "tiny-pt": measured(
        ["embeddings", "fill_mask", "nsp"],
        {"speed": 3.4, "embeddings": COS, "fill_mask": {"top5_overlap": 0.978}, "nsp": {"agreement": 1.0}},
        {"speed": 2.0, "embeddings": LOW_COS, "fill_mask": {"top5_overlap": 0.96}, "nsp": {"agreement": 1.0}},
    ),
    "tiny-mlm": measured(
        ["embeddings", "fill_mask"],
        {"speed": 1.5, "embeddings": COS, "fill_mask": {"top5_overlap": 0.995}},
        {"speed": 2.0, "embeddings": COS, "fill_mask": {"top5_overlap": 0.992}},
    ),
    "tiny-cls": measured(
        ["embeddings", "classification"],
        {"speed": 3.0, "embeddings": COS, "classification": {"agreement": 1.0}},
        {"speed": 2.0, "embeddings": COS, "classification": {"agreement": 1.0}},
    ),
}


def write_rows(root, kind: str = KIND) -> None:
    for name, row in ROWS.items():
        update_card(root / "models" / name, precision={kind: row})


async def test_auto_serves_the_fastest_precision_within_every_bound(models, test_cpu):
    write_rows(models)
    settings = settings_for(models, precision="auto", model_precision={"tiny-cls": "fp32"})
    async with serve_app(settings) as client:
        with anyio.fail_after(60):  # BERT_LOAD=startup loads them one after another
            while not all(m["loaded"] for m in (await client.get("/models")).json()["models"]):
                await anyio.sleep(0.05)
        listed = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
        registry = client.app.state.service.registry
        served = {name: registry.peek(name).loaded.precision for name in listed}
        embeddings = await client.post("/embeddings", json={"inputs": TEXTS, "model": "tiny-enc"})
    assert served == {name: m["precision"] for name, m in listed.items()}
    assert served == {"tiny-enc": "bf16", "tiny-pt": "fp32", "tiny-mlm": "int8", "tiny-cls": "fp32"}
    why = {name: m["why"].split("; cpu ")[0] for name, m in listed.items()}
    assert why == {
        "tiny-enc": f"bf16 by BERT_PRECISION=auto (measured on {KIND}: embeddings min cosine 0.99991 ≥ 0.999, "
        "3.4× fp32 on this CPU)",
        # an encoder without an MLM head may serve bf16; a pretraining model keeps fp32, saying why
        "tiny-pt": f"fp32 by BERT_PRECISION=auto (measured on {KIND}: fill-mask top-5 overlap 97.8% < 99% in bf16; "
        "embeddings min cosine 0.997 < 0.999, fill-mask top-5 overlap 96% < 99% in int8)",
        "tiny-mlm": f"int8 by BERT_PRECISION=auto (measured on {KIND}: embeddings min cosine 0.99991 ≥ 0.999, "
        "fill-mask top-5 overlap 99.2% ≥ 99%, 2× fp32 on this CPU)",
        "tiny-cls": "fp32 by BERT_MODEL_PRECISION",  # the per-model setting wins over the card
    }
    assert embeddings.status_code == 200
    assert listed["tiny-enc"]["card"]["precision"] == {KIND: ROWS["tiny-enc"]}  # the card shows the table


def test_the_bounds_and_a_fixed_precision_are_settings(models, test_cpu):
    write_rows(models)

    def choices(**settings):
        service = Service(settings_for(models, **settings), Metrics())
        service.registry.scan()
        return {name: service.precision_for(name) for name in ROWS}

    assert choices(precision="auto") == {"tiny-enc": "bf16", "tiny-pt": "fp32", "tiny-mlm": "int8", "tiny-cls": "bf16"}
    # a looser fill-mask bound lets the pretraining model take bf16; a stricter cosine keeps the encoder in fp32
    assert choices(precision="auto", auto_min_top5_overlap=0.97, auto_min_cosine=0.99995) == {
        "tiny-enc": "fp32",
        "tiny-pt": "fp32",
        "tiny-mlm": "fp32",
        "tiny-cls": "fp32",
    }
    assert choices(precision="auto", auto_min_top5_overlap=0.97)["tiny-pt"] == "bf16"
    assert choices(precision="auto", auto_min_agreement=1.0)["tiny-cls"] == "bf16"
    assert set(choices(precision="int8").values()) == {"int8"}
    assert choices(precision="fp32", model_precision={"tiny-pt": "auto"})["tiny-pt"] == "fp32"
    assert choices(precision="fp32", model_precision={"tiny-enc": "auto"})["tiny-enc"] == "bf16"


def test_bounds_are_checked():
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="auto_min_cosine"):
        Settings(auto_min_cosine=1.5)


async def test_a_kind_of_cpu_the_card_lacks_is_measured_in_the_background(models, test_cpu, monkeypatch):
    """fp32 while the measurement runs (held here until the test lets it go), then the card has the row beside the
    other kind's, and the next request loads the model at the chosen precision."""
    write_rows(models, kind="x86 another-cpu")
    measuring, go = threading.Event(), threading.Event()
    real = model_card.write_precision_row

    def held(model_dir):
        measuring.set()
        go.wait(60)
        return real(model_dir)

    monkeypatch.setattr(model_card, "write_precision_row", held)
    settings = settings_for(models, precision="auto", load="lazy", default_model="tiny-enc")
    async with serve_app(settings, wait_ready=False) as client:  # lazy: ready once the model is loaded
        before = (await client.get("/models/tiny-enc")).json()
        assert (before["precision"], before["loaded"]) == ("fp32", False)
        first = await client.post("/embeddings", json={"inputs": TEXTS})
        with anyio.fail_after(30):
            while not measuring.is_set():
                await anyio.sleep(0.02)
        meanwhile = (await client.get("/models/tiny-enc")).json()
        go.set()
        card = models / "models" / "tiny-enc" / "card.json"
        with anyio.fail_after(120):
            while KIND not in read_card(card.parent).get("precision", {}):
                await anyio.sleep(0.05)
        want, why = choose(read_card(card.parent)["precision"][KIND], Bounds())
        after = await client.post("/embeddings", json={"inputs": TEXTS})
        now = (await client.get("/models/tiny-enc")).json()
        loaded = client.app.state.service.registry.peek("tiny-enc").loaded
    assert before["why"] is None  # not loaded: no kernels yet; its precision says what a load would take
    assert first.status_code == after.status_code == 200
    assert (meanwhile["precision"], meanwhile["loaded"]) == ("fp32", True)
    assert meanwhile["why"].startswith(
        f"fp32 by BERT_PRECISION=auto (its precisions are being measured on this kind of CPU ({KIND})); "
    )
    assert set(read_card(card.parent)["precision"]) == {"x86 another-cpu", KIND}
    assert (now["precision"], loaded.precision, now["loaded"]) == (want, want, True)
    assert now["why"].startswith(f"{want} by BERT_PRECISION=auto (measured on {KIND}: {why}); ")
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(first.json()), torch.tensor(after.json()))
    assert cosine.min() > 0.99


async def test_no_measurement_when_it_does_not_fit_in_the_memory_budget(models, test_cpu, monkeypatch):
    started = []
    monkeypatch.setattr(model_card, "write_precision_row", started.append)
    probe = Service(settings_for(models, precision="auto"), Metrics())
    probe.registry.scan()
    weights, working = probe.registry.estimate(probe.registry.peek("tiny-enc"))
    budget_gb = (weights + working + 1) / 2**30  # room for the model, none for a second copy
    settings = settings_for(models, precision="auto", load="lazy", default_model="tiny-enc", model_memory_gb=budget_gb)
    async with serve_app(settings, wait_ready=False) as client:
        assert (await client.post("/embeddings", json={"inputs": TEXTS})).status_code == 200
        why = (await client.get("/models/tiny-enc")).json()["why"]
    assert started == []
    assert why.startswith(
        f"fp32 by BERT_PRECISION=auto (not measured on this kind of CPU ({KIND}) yet: the measurement's "
    )
    assert "does not fit in the memory budget beside the models loaded; it is tried again at the next load); " in why


@pytest.mark.slow
def test_a_real_server_measures_a_kind_of_cpu_the_card_lacks(data_dir, tmp_path):
    """`uvicorn app.main:create_app` on this machine: the first answer in fp32, then the card's row for this kind of
    CPU, then the chosen precision."""
    root = tmp_path / "data"
    shutil.copytree(data_dir / "models" / "tiny-enc", root / "models" / "tiny")
    server, url = start_server(root, "redis://127.0.0.1:1/0", tmp_path, BERT_PRECISION="auto")
    try:
        first = httpx.post(f"{url}/embeddings", json={"inputs": TEXTS}, timeout=60)
        assert first.status_code == 200, first.text
        deadline = time.monotonic() + 240  # a hang check: the tiny model is measured in seconds on an idle machine
        while cpu_kind() not in read_card(root / "models" / "tiny").get("precision", {}):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        want, why = choose(read_card(root / "models" / "tiny")["precision"][cpu_kind()], Bounds())
        after = httpx.post(f"{url}/embeddings", json={"inputs": TEXTS}, timeout=60)
        info = httpx.get(f"{url}/models/tiny", timeout=30).json()
    finally:
        server.stop()
    assert after.status_code == 200
    assert (info["precision"], info["loaded"]) == (want, True)
    assert info["why"].startswith(f"{want} by BERT_PRECISION=auto (measured on {cpu_kind()}: {why}); ")
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(first.json()), torch.tensor(after.json()))
    assert cosine.min() > 0.99
