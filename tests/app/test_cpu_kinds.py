"""The service on every kind of CPU: with bf16 kernels missing (as on an AVX2 CPU), or raising on a real
request, every precision serves, no model shows a loading error, answers stay close to fp32, and
/models names the kernels and why. tests/cpu_kinds.py makes this machine look like the others."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from model.compute import kernels, onednn
from model.precision_choice import cpu_kind
from tests.app.conftest import serve_app, settings_for
from tests.app.test_server import free_port
from tests.cpu_kinds import AVX2_BF16_ERROR, SITECUSTOMIZE, RaisingOnBf16, pretend_avx2

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["the cat sat on the mat.", "a big dog ran to the river.", "paris is the capital of france ."]
pytestmark = pytest.mark.anyio


@pytest.fixture
def every_size(monkeypatch):
    monkeypatch.setattr(onednn, "_MIN_MACS", 0)  # oneDNN for the tiny models too


async def answers(client) -> dict:
    embed = await client.post("/embeddings", json={"inputs": TEXTS, "model": "tiny-enc"})
    masked = await client.post("/fill-mask", json={"inputs": "the cat [MASK] on the mat.", "top_k": 3})
    assert embed.status_code == masked.status_code == 200, (embed.text, masked.text)
    return {"embeddings": torch.tensor(embed.json()), "fill-mask": masked.json()}


async def fp32_answers(data_dir) -> dict:
    async with serve_app(settings_for(data_dir, precision="fp32")) as client:
        return await answers(client)


async def listed(client, wait: bool = True) -> dict:
    """GET /models, once every model has loaded unless not `wait` (BERT_LOAD=startup loads them one
    after another)."""
    import anyio

    with anyio.fail_after(60):
        while True:
            models = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
            if not wait or all(m["loaded"] or m["error"] for m in models.values()):
                return models
            await anyio.sleep(0.05)


async def test_bf16_on_a_cpu_without_bf16_serves_emulated(data_dir, kernel_paths, every_size, monkeypatch, caplog):
    ref = await fp32_answers(data_dir)
    pretend_avx2(monkeypatch.setattr)
    caplog.set_level(logging.INFO)
    async with serve_app(settings_for(data_dir, precision="bf16")) as client:
        got = await answers(client)
        models = await listed(client)
        info = (await client.get("/info")).json()
    assert F.cosine_similarity(got["embeddings"], ref["embeddings"]).min() > 0.99
    assert [c["token_str"] for c in got["fill-mask"]][:1] == [c["token_str"] for c in ref["fill-mask"]][:1]
    why = "cpu AVX2, no native bf16, no VNNI: bf16 weights, GEMMs in fp32, emulated and slower than fp32"
    for model in models.values():
        assert (model["loaded"], model["error"], model["precision"]) == (True, None, "bf16")
        assert model["kernels"] == "bf16-emulated (onednn-fp32)" and model["why"] == f"bf16 by BERT_PRECISION; {why}"
    assert info["cpu"].endswith(": cpu AVX2, no native bf16, no VNNI")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"bf16 is emulated on this machine, and slower than fp32: {why}"]


async def test_the_default_precision_serves_on_a_cpu_without_bf16(data_dir, kernel_paths, every_size, monkeypatch):
    ref = await fp32_answers(data_dir)
    pretend_avx2(monkeypatch.setattr)
    async with serve_app(settings_for(data_dir, precision="auto")) as client:
        got = await answers(client)
        models = await listed(client)
    torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=0)
    fp32 = "onednn-fp32" if onednn.available() else "torch-fp32"
    assert {(m["precision"], m["kernels"], m["error"]) for m in models.values()} == {("fp32", fp32, None)}
    assert {m["why"] for m in models.values()} == {
        f"fp32 by BERT_PRECISION=auto (only fp32 is native on this kind of CPU ({cpu_kind()})); "
        "cpu AVX2, no native bf16, no VNNI"
    }


async def test_bf16_kernels_that_raise_on_a_request_fall_back_for_it(data_dir, kernel_paths, every_size, monkeypatch):
    """A CPU where the bf16 probe passed, but the kernel fails on a real shape: that request is answered
    through the plain path, and the path is off from then on."""
    ref = await fp32_answers(data_dir)
    async with serve_app(settings_for(data_dir, precision="bf16", load="lazy"), wait_ready=False) as client:
        kernels.override("onednn-bf16", True)
        for name in ("_linear_pointwise", "_reorder_linear_weight"):
            monkeypatch.setattr(torch.ops.mkldnn, name, RaisingOnBf16(getattr(torch.ops.mkldnn, name)))
        got = await answers(client)
        models = await listed(client, wait=False)
    assert F.cosine_similarity(got["embeddings"], ref["embeddings"]).min() > 0.99
    assert kernels.status("onednn-bf16") == (False, f"raised RuntimeError: {AVX2_BF16_ERROR}")
    assert models["tiny-enc"]["kernels"].startswith("bf16-emulated")
    assert models["tiny-enc"]["why"].endswith(f"; onednn-bf16 off: raised RuntimeError: {AVX2_BF16_ERROR}")


def start_serve(data_dir: Path, port: int, tmp_path: Path, **env: str) -> subprocess.Popen:
    """A real `bert serve` that believes it runs on an AVX2 CPU (tests/cpu_kinds.py via sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "BERT_DATA_DIR": str(data_dir),
        "BERT_DEFAULT_MODEL": "tiny-enc",
        "BERT_DEVICE": "cpu",
        "BERT_LOAD": "startup",
        "BERT_API_KEY": "",
        "BERT_DRAIN_SECONDS": "0",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    bert = Path(sys.executable).with_name("bert")
    return subprocess.Popen(
        [str(bert), "serve", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("bert serve did not become ready")


@pytest.mark.slow
def test_bert_serve_in_bf16_as_on_an_avx2_cpu(data_dir, tmp_path):
    """BERT_PRECISION=bf16 bert serve with oneDNN's bf16 ops raising and torch saying it has no bf16."""
    port = free_port()
    proc = start_serve(data_dir, port, tmp_path, BERT_PRECISION="bf16")
    try:
        wait_ready(proc, port)
        url = f"http://127.0.0.1:{port}"
        got = httpx.post(f"{url}/embeddings", json={"inputs": TEXTS}, timeout=30)
        models = httpx.get(f"{url}/models", timeout=30).json()["models"]
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert got.status_code == 200, got.text
    # The default model is loaded (it answered); the startup loader may still be loading the others: those loaded
    # so far, the default among them, run as it does.
    loaded = [m for m in models if m["kernels"] is not None]
    assert "tiny-enc" in {m["name"] for m in loaded}
    assert {(m["error"], m["precision"], m["kernels"]) for m in loaded} == {
        (None, "bf16", "bf16-emulated (onednn-fp32)")
    }
    from tests.app.conftest import MODELS
    from tests.app.test_inference import embed_reference

    reference = MODELS["tiny-enc"].from_pretrained(data_dir / "models" / "tiny-enc")
    from model.tokenizer import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(data_dir / "models" / "tiny-enc")
    want = torch.stack([embed_reference(reference, tokenizer, t) for t in TEXTS])
    assert F.cosine_similarity(torch.tensor(got.json()), want).min() > 0.99
    assert output.count("bf16 is emulated on this machine, and slower than fp32") == 1, output
    assert "cpu: " in output and "cpu AVX2, no native bf16, no VNNI" in output
