"""/token-classification and /question-answering served in-process (the app over ASGI, no network),
MiniLM's encoder with random task heads, CPU.

For each route: --requests requests sent one at a time (concurrency 1) and then --concurrency at a
time: requests/s, median and p90 latency, and the mean rows per forward pass (bert_batch_size:
above 1 when the engine batches the requests, or a QA request's windows, together).

  token-classification   a 25-word sentence, aggregation_strategy simple;
  question-answering     a question on a ~460-token context: 2 windows at the defaults (384, 128).

    .venv/bin/python -m bench.token_tasks_bench                 # about 20 seconds on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import torch
import transformers

from app.main import create_app
from app.settings import Settings
from bench.common import MINILM_DIR, machine_line, markdown_table, setup

transformers.logging.set_verbosity_error()  # the new heads are random by design: no load report

SENTENCE = (
    "Wolfgang Müller moved from Berlin to São Paulo in 2010 and later worked with Émilie Dupont at the "
    "museum of modern art in Köln during the summer"
)
CONTEXT = " ".join(
    [
        "Wolfgang Müller was born in Berlin in 1998 and moved to São Paulo in 2010.",
        "He studied tokenization at the university, then worked at a museum.",
        "Émilie Dupont, his colleague, lives in Köln and visits him every summer.",
    ]
    * 10
)
BODIES = {
    "/token-classification": {"inputs": SENTENCE, "model": "ner", "aggregation_strategy": "simple"},
    "/question-answering": {"question": "Where does Émilie Dupont live?", "context": CONTEXT, "model": "qa"},
}
TASKS = {"/token-classification": "token_classify", "/question-answering": "qa"}


def make_data_dir(root: Path) -> Path:
    tok = transformers.AutoTokenizer.from_pretrained(MINILM_DIR)
    labels = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
    for name, cls, extra in [
        ("ner", transformers.BertForTokenClassification, {"id2label": labels}),
        ("qa", transformers.BertForQuestionAnswering, {}),
    ]:
        torch.manual_seed(0)
        cls.from_pretrained(MINILM_DIR, **extra).save_pretrained(root / "models" / name)
        tok.save_pretrained(root / "models" / name)
    return root


def batch_rows(metrics: str, task: str) -> tuple[float, float]:
    """(passes, rows) of the task's forward passes so far."""
    values = []
    for name in ("count", "sum"):
        found = re.search(rf'bert_batch_size_{name}\{{model="\w+",task="{task}"\}} (\S+)', metrics)
        values.append(float(found.group(1)) if found else 0.0)
    return values[0], values[1]


async def load(client: httpx.AsyncClient, path: str, requests: int, concurrency: int) -> dict:
    latencies: list[float] = []
    queue = list(range(requests))

    async def worker():
        while queue:
            queue.pop()
            start = time.perf_counter()
            r = await client.post(path, json=BODIES[path])
            assert r.status_code == 200, r.text
            latencies.append(time.perf_counter() - start)

    before = batch_rows((await client.get("/metrics")).text, TASKS[path])
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    after = batch_rows((await client.get("/metrics")).text, TASKS[path])
    latencies.sort()
    return {
        "rps": requests / seconds,
        "median": statistics.median(latencies),
        "p90": latencies[int(0.9 * (len(latencies) - 1))],
        "rows_per_pass": (after[1] - before[1]) / max(after[0] - before[0], 1),
    }


async def main(args) -> None:
    setup(args.threads)
    root = make_data_dir(Path(tempfile.mkdtemp(prefix="token-tasks-bench-")))
    settings = Settings(
        data_dir=root, default_model="ner", device="cpu", load="startup", api_key=None, torch_threads=args.threads
    )
    app = create_app(settings)
    rows = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
            for path, body in BODIES.items():  # warm: load both models, one request each
                assert (await client.post(path, json=body)).status_code == 200
            for path in BODIES:
                for concurrency in (1, args.concurrency):
                    r = await load(client, path, args.requests, concurrency)
                    rows.append(
                        [
                            path,
                            concurrency,
                            f"{r['rps']:.1f}",
                            f"{r['median'] * 1e3:.0f}",
                            f"{r['p90'] * 1e3:.0f}",
                            f"{r['rows_per_pass']:.1f}",
                        ]
                    )
    print(machine_line())
    print(markdown_table(["route", "concurrency", "requests/s", "median ms", "p90 ms", "rows per pass"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
