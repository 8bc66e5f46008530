"""Batch jobs against the bare engine: N short texts embedded by a /v1/batches job and by the batching
engine alone, on all-MiniLM-L6-v2 (the demo model), in one process, one after the other.

  batch job    POST /v1/files + POST /v1/batches through the app (httpx over ASGI, the app's lifespan
               running), timed from the upload to status "completed": checking the file, one
               /v1/embeddings pipeline call per line (tokenising, the engine, the answer's JSON) and
               the fsynced output chunks.
  bare engine  the same texts tokenised beforehand and given to the service's engine as one work
               item, which it packs into forward passes under BERT_MAX_BATCH_TOKENS: the ceiling a
               batch job could reach on this machine.

    .venv/bin/python -m bench.batch_bench                # 20,000 texts
    .venv/bin/python -m bench.batch_bench --n 2000

Each runs twice, interleaved (bare, job, bare, job), and the best of its two counts: on a shared machine
a neighbour's burst then costs either side alike. Prints a markdown table: seconds, texts/s and the batch
job's share of the bare engine's rate.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/serve_bench.py: no spinning waits on shared cores
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from app.launcher.demo_data import ensure_minilm  # noqa: E402
from app.launcher.server import freeze_startup_heap  # noqa: E402
from app.main import create_app  # noqa: E402
from app.serving.engine import WorkItem  # noqa: E402
from app.settings import Settings  # noqa: E402
from bench.common import WIKI_JSON, machine_line  # noqa: E402


def short_texts(n: int, seed: int = 0) -> list[str]:
    """n sentences of 4-16 words from the Wikipedia leads (repeated, shuffled, when there are fewer)."""
    leads = [v.get("extract", "") for v in json.loads(WIKI_JSON.read_text()).values()]
    sentences = [s for lead in leads for s in re.split(r"(?<=\.)\s+", lead) if 4 <= len(s.split()) <= 16]
    rng = random.Random(seed)
    return [rng.choice(sentences) for _ in range(n)]


async def batch_job(client: httpx.AsyncClient, texts: list[str]) -> float:
    lines = [
        {"custom_id": f"t{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm", "input": t}}
        for i, t in enumerate(texts)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    start = time.perf_counter()
    upload = await client.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    batch = (await client.post("/v1/batches", json=body)).json()
    while (batch := (await client.get(f"/v1/batches/{batch['id']}")).json())["status"] not in (
        "completed",
        "failed",
        "cancelled",
    ):
        await asyncio.sleep(0.25)  # a client polling 4 times a second: its requests cost the job little
    seconds = time.perf_counter() - start
    counts = batch["request_counts"]
    assert batch["status"] == "completed" and counts["completed"] == len(texts), batch
    return seconds


async def bare_engine(service, texts: list[str]) -> float:
    lm = await service.loaded_model("minilm")
    rows = [(enc["input_ids"], enc["token_type_ids"]) for enc in (lm.tokenizer.encode(t) for t in texts)]
    start = time.perf_counter()
    await service.run(WorkItem("encode", lm, rows, {"pooling": "mean", "normalize": True}))
    return time.perf_counter() - start


async def main(n: int) -> None:
    texts = short_texts(n)
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        data_dir = Path(tmp)
        ensure_minilm(data_dir / "models" / "minilm")
        settings = Settings(data_dir=data_dir, default_model="minilm", load="startup", device="cpu")
        app = create_app(settings)
        freeze_startup_heap()  # as `bert serve` does before it starts the app
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
                service = app.state.service
                await bare_engine(service, texts[:256])  # warm: the model loaded, its kernels too
                bares, jobs = [], []
                for _ in range(2):  # interleaved, the best of two each: a noisy neighbour costs both sides alike
                    bares.append(await bare_engine(service, texts))
                    jobs.append(await batch_job(client, texts))
    bare, job = min(bares), min(jobs)
    print(f"# Batch job vs bare engine, {n:,} short texts, all-MiniLM-L6-v2\n\n{machine_line()}\n")
    print("| | seconds | texts/s | share of bare |")
    print("|---|---:|---:|---:|")
    print(f"| bare engine | {bare:.2f} | {n / bare:,.0f} | 100% |")
    print(f"| batch job | {job:.2f} | {n / job:,.0f} | {bare / job:.0%} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="texts (default 20,000)")
    asyncio.run(main(parser.parse_args().n))
