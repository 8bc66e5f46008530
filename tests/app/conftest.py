"""Fixtures: tiny random models saved into a temporary DATA_DIR, and apps served over real ASGI.

Models (hidden 32, 2 layers, 4 heads, 100-token vocabulary, 32 positions):
  tiny-pt   BertForPreTraining (MLM + NSP heads): the default
  tiny-mlm  BertForMaskedLM
  tiny-enc  BertModel (no heads)
  tiny-cls  BertForSequenceClassification, labels negative/positive
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
import torch

from app.main import create_app
from app.settings import Settings
from model.config import BertConfig
from model.modeling import BertForMaskedLM, BertForPreTraining, BertForSequenceClassification, BertModel
from model.tokenizer import BertTokenizer

WORDS = (
    "the a an of to in is was it that he she they we you i and or but not for with on at by from "
    "cat dog mat sat ran fox quick brown lazy jumped over paris france capital city river "
    "house car red blue green big small good bad happy sad film movie great awful one two three "
    "four five man woman child ate eats food milk store bought went sky penguins fly can ##s ##ing "
    "##ed ##er ##ly . , ! ? ' -"
).split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
MAX_POSITIONS = 32

MODELS = {
    "tiny-pt": BertForPreTraining,
    "tiny-mlm": BertForMaskedLM,
    "tiny-enc": BertModel,
    "tiny-cls": BertForSequenceClassification,
}


def tiny_config(**overrides) -> BertConfig:
    values = dict(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=MAX_POSITIONS,
    )
    return BertConfig(**{**values, **overrides})


def save_tiny(path: Path, cls, seed: int = 0, **config_overrides):
    torch.manual_seed(seed)
    model = cls(tiny_config(**config_overrides)).eval()
    model.save_pretrained(path, tokenizer=BertTokenizer.from_vocab(VOCAB))
    return model


@pytest.fixture(scope="session")
def tokenizer() -> BertTokenizer:
    return BertTokenizer.from_vocab(VOCAB)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for i, (name, cls) in enumerate(MODELS.items()):
        extra = {"id2label": {0: "negative", 1: "positive"}} if name == "tiny-cls" else {}
        save_tiny(root / "models" / name, cls, seed=i, **extra)
    return root


@pytest.fixture(scope="session")
def reference(data_dir):
    """The models as loaded straight from disk: what the service's answers must equal."""
    return {name: cls.from_pretrained(data_dir / "models" / name) for name, cls in MODELS.items()}


def settings_for(data_dir: Path, **overrides) -> Settings:
    # broker: nothing listens on port 1; the default, 127.0.0.1:6379, may be a user's Redis
    values = dict(
        data_dir=data_dir,
        default_model="tiny-pt",
        device="cpu",
        # answers are compared with fp32 references; auto measures each model and may serve bf16 (and write its
        # card into this shared data dir): tests/app/test_precision_auto.py asks for it
        precision="fp32",
        load="startup",
        max_wait_ms=2.0,
        api_key=None,
        max_inputs=64,
        max_batch_tokens=4096,
        batching=True,
        broker_url="redis://127.0.0.1:1/0",
    )
    return Settings(**{**values, **overrides})


@contextlib.asynccontextmanager
async def serve_app(settings: Settings, wait_ready: bool = True):
    """The app with its lifespan running, and an httpx client speaking real HTTP to it over ASGI."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            if wait_ready:
                await wait_until_ready(client)
            client.app = app
            yield client


async def wait_until_ready(client: httpx.AsyncClient, timeout: float = 20.0) -> None:
    import anyio

    with anyio.fail_after(timeout):
        while (await client.get("/ready")).status_code != 200:
            await anyio.sleep(0.02)


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def client(data_dir):
    async with serve_app(settings_for(data_dir)) as c:
        yield c


@pytest.fixture
def tf32_given_back():
    """A Service on a faked GPU turns TF32 on for the process (model.compute.precision.use_tf32): set back after."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    yield
    matmul.fp32_precision = before
