"""BERT_PRECISION / BERT_MODEL_PRECISION: a model served in int8 or bf16 answers close to fp32,
and /models says which precision each model runs in."""

from __future__ import annotations

import pytest
import torch

from .conftest import serve_app, settings_for

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
