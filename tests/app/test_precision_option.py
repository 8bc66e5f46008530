"""BERT_PRECISION / BERT_MODEL_PRECISION: a model served in int8 or bf16 answers close to fp32,
/models says which precision each model runs in, and "auto" resolves per device
(on a CPU by measurement: tests/app/test_precision_auto.py)."""

from __future__ import annotations

import pytest
import torch

from app.prometheus import Metrics
from app.serving.service import Service
from model.precision_choice import cpu_kind
from tests.app.conftest import serve_app, settings_for
from tests.cpu_kinds import pretend_avx2

pytestmark = pytest.mark.anyio
TEXTS = ["the cat sat on the mat.", "a big dog ran to the river."]


async def embed(client, model):
    r = await client.post("/embeddings", json={"inputs": TEXTS, "model": model})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


async def test_per_model_precision_is_applied_and_listed(data_dir):
    settings = settings_for(data_dir, precision="fp32", model_precision={"tiny-enc": "int8", "tiny-pt": "bf16"})
    async with serve_app(settings) as client:
        listed = {m["name"]: m["precision"] for m in (await client.get("/models")).json()["models"]}
        assert listed == {"tiny-pt": "bf16", "tiny-mlm": "fp32", "tiny-enc": "int8", "tiny-cls": "fp32"}
        low = {name: await embed(client, name) for name in ("tiny-enc", "tiny-pt")}
    async with serve_app(settings_for(data_dir)) as client:
        for name, vectors in low.items():
            ref = await embed(client, name)
            cosine = torch.nn.functional.cosine_similarity(ref, vectors)
            assert cosine.min() > 0.98, (name, cosine)
            assert not torch.equal(ref, vectors), f"{name} ran in fp32 after all"


def test_unknown_precision_is_rejected():
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="int4"):
        Settings(precision="int4")


def test_auto_is_the_default():
    from app.settings import Settings

    assert Settings().precision == "auto"  # on a CPU, measured per model: tests/app/test_precision_auto.py


@pytest.mark.parametrize(
    "native_bf16, auto, gpu_auto",
    [(True, "bf16", "this GPU has native bf16"), (False, "fp32", "this GPU has no native bf16")],
)
def test_precision_settings_resolve_per_device_and_say_why(
    data_dir, monkeypatch, tf32_given_back, native_bf16, auto, gpu_auto
):
    """An explicit setting is served as given on any device; "auto" is bf16 only on a CUDA GPU with
    native bf16 (on a CPU it is measured: tests/app/test_precision_auto.py; here a CPU where only fp32 is native).
    Each choice names the setting that made it, and for auto why auto means it there. CUDA is faked (the resolver
    only asks torch.cuda these two questions)."""
    pretend_avx2(monkeypatch.setattr)
    cpu_auto = f"only fp32 is native on this kind of CPU ({cpu_kind()})"

    def resolved(device, **settings):
        service = Service(settings_for(data_dir, device=device, **{"precision": "auto", **settings}), Metrics())
        choices = {name: service.precision_choice(name) for name in ("tiny-pt", "tiny-enc")}
        assert {name: service.precision_for(name) for name in choices} == {n: c[0] for n, c in choices.items()}
        return choices

    assert resolved("cpu") == {
        "tiny-pt": ("fp32", f"fp32 by BERT_PRECISION=auto ({cpu_auto})"),
        "tiny-enc": ("fp32", f"fp32 by BERT_PRECISION=auto ({cpu_auto})"),
    }
    assert resolved("cpu", precision="bf16", model_precision={"tiny-enc": "auto"}) == {
        "tiny-pt": ("bf16", "bf16 by BERT_PRECISION"),
        "tiny-enc": ("fp32", f"fp32 by BERT_MODEL_PRECISION=auto ({cpu_auto})"),
    }
    assert resolved("cpu", model_precision={"tiny-enc": "int8"})["tiny-enc"] == ("int8", "int8 by BERT_MODEL_PRECISION")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if native_bf16 else (7, 5))
    assert resolved("cuda") == {
        "tiny-pt": (auto, f"{auto} by BERT_PRECISION=auto ({gpu_auto})"),
        "tiny-enc": (auto, f"{auto} by BERT_PRECISION=auto ({gpu_auto})"),
    }
    assert resolved("cuda", precision="fp32", model_precision={"tiny-enc": "auto"}) == {
        "tiny-pt": ("fp32", "fp32 by BERT_PRECISION"),
        "tiny-enc": (auto, f"{auto} by BERT_MODEL_PRECISION=auto ({gpu_auto})"),
    }
