"""Bounded work per request (issue 12, acceptance 1 and 2), measured against a live `bert serve`.

1. Oversized fill-mask: the issue's `{"inputs": "[MASK] " * 510, "top_k": 100}` and 64 copies of it in
   one request, each sent 3 times: status, seconds, and how far the server's RSS moved (target: 422
   in under a second, RSS within 20 MB). Beside them, the largest fill-mask request the limits allow.
2. Starvation: a one-word /embeddings request, sent again and again, idle and while 4 clients keep
   sending the largest requests the limits allow (2 x /embeddings of BERT_MAX_INPUTS inputs of 512
   tokens = BERT_MAX_REQUEST_TOKENS; 2 x /fill-mask of 64 such inputs, one mask each, top_k 16 =
   BERT_MAX_FILL_MASK_CANDIDATES): its median and p90 latency, and loaded / idle (target: median
   under 1 s).

3. Hostile data (issue 26, items 3-6), each reproduction sent while a one-word /embeddings probe runs
   beside it: its status, seconds and answer size, the server's RSS before -> after, and the probe's
   median against its idle median from the same run (target: refused fast or bounded, and the probe
   within 5x of idle). Labels: a 16 MB CSV with 1 M distinct labels and a CoNLL file with 500 k tags
   (422), GET /datasets with a 10 k-label dataset stored, /classify and /predict on a 100 k-label
   classifier; event streams: 30 clients on a job with a 200 k-line curve (the per-job cap answers
   429); uploads: a .txt starting with <mediawiki holding an 8 MB element, a 100 MB single-line
   corpus. Beside the server: `bert corpus build` on a 16 KB .bz2 holding one 300 MiB line (peak RSS
   of the build process) and an entity-expansion .xml (refused). `--skip-hostile` leaves it out.

4. Reranking: `{"query": "a " * 240000, "texts": ["b"] * 64, "truncate": true}` to /rerank (a one-label
   classifier of the same shape), sent `--rerank-runs` times one after another while the one-word
   /embeddings probe runs beside it: status, seconds, and the probe's median and p90 against its idle
   median from the same run (target: a 4xx in about a second, the probe within 5x of idle).
   `--only-rerank` runs this part alone.

5. Model thrash (`--only-thrash`, its own server): a budget of `--thrash-models` (2.5) models and one
   working set (BERT_MODEL_MEMORY_GB), no pinned model, models loaded on first use (BERT_LOAD=lazy),
   keys. A neighbour key sends one-word /embeddings on its own model (`bench`), one a second, idle and
   while another key alternates two other models (`enc-0`, `enc-1`), back to back and then at 2
   requests/s (its rps): the neighbour's p50 and p90 against idle (target: within 5x), the other key's
   statuses, the loads, and the server's peak RSS against the budget plus its RSS before any model
   loaded. Then six concurrent requests of 32 x 128 tokens, each on its own model (`enc-0` ...
   `enc-5`): their statuses, the most GET /models counted (loaded, held and working set) and the peak
   RSS.

6. Batches beside online traffic (`--only-batches`, its own server, default settings): the one-word /embeddings
   probe idle, then while three batches of `--batch-lines` (50,000) /v1/embeddings lines of 128 tokens each,
   uploaded through /v1/files, run (BERT_BATCH_MAX_RUNNING of them at once, the rest queued): the probe's
   p50 and p90 against idle (target: within 3x), its refusals, the lines each batch finished meanwhile and the
   server's RSS, before the uploads and at its peak. The batches are cancelled at the end.

The server is bench/live.py's (4 layers, hidden 256, 512 positions, CPU), with default settings.
`--root DIR` runs the server from another checkout (e.g. the commit before, for a before/after);
`--skip-oversize` leaves part 1 out (do so for a checkout without the limits: there the 64-copy
request grows the server by gigabytes).

    .venv/bin/python bench/bounds_bench.py                    # about 8 minutes (part 3: about 6)
    .venv/bin/python bench/bounds_bench.py --only-hostile     # part 3 alone
    .venv/bin/python bench/bounds_bench.py --only-rerank --seconds 10
    .venv/bin/python bench/bounds_bench.py --only-thrash --seconds 30   # part 5 alone, about 2 minutes
    .venv/bin/python bench/bounds_bench.py --only-batches --seconds 30  # part 6 alone, about 3 minutes
    .venv/bin/python bench/bounds_bench.py --seconds 10 --skip-oversize --root /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bz2
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from live import ROOT, Client, rss_mb, save_models, start_server, stop_server, text_of


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- 1. oversized fill-mask --------------------------------------------------------------------


async def oversize(port: int, pid: int, tokenizer) -> list[str]:
    client = Client(port)
    text = text_of(tokenizer, 512)
    words = text.split()
    largest = [" ".join(["[MASK]"] + words[1:])] * 64  # 64 inputs x 1 mask x top_k 16 = 1024 candidates
    cases = [
        ('`"[MASK] " * 510`, top_k 100', {"inputs": "[MASK] " * 510, "top_k": 100}),
        ("64 copies of it in one request", {"inputs": ["[MASK] " * 510] * 64, "top_k": 100}),
        ("largest allowed: 64 x 512 tokens, 1 mask, top_k 16", {"inputs": largest, "top_k": 16}),
    ]
    for _ in range(3):  # warm-up: a normal request of each route
        await client.request("POST", "/fill-mask", json.dumps({"inputs": "paris is the [MASK] of france."}).encode())
    lines = [
        "| request | body | status | seconds (max of 3) | answer bytes | server RSS before -> after, MB |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, body in cases:
        payload = json.dumps(body).encode()
        before = rss_mb(pid)
        statuses, seconds = Counter(), []
        for _ in range(3):
            start = time.perf_counter()
            status, answer = await client.request("POST", "/fill-mask", payload)
            seconds.append(time.perf_counter() - start)
            statuses[status] += 1
        after = rss_mb(pid)
        shown = ", ".join(f"{s} x{n}" for s, n in statuses.items())
        lines.append(
            f"| {label} | {len(payload) / 1024:.1f} KB | {shown} | {max(seconds):.3f} | {len(answer)} | "
            f"{before:.0f} -> {after:.0f} ({after - before:+.1f}) |"
        )
        if status != 200:
            lines.append(f"| | | `{answer.decode()[:160]}` | | | |")
    client.close()
    return lines


# -- 2. starvation -----------------------------------------------------------------------------


async def probe(port: int, seconds: float, pause: float = 0.1) -> list[float]:
    """One-word /embeddings, one at a time, for `seconds`: each latency."""
    client, body, out = Client(port), json.dumps({"inputs": "hello"}).encode(), []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        start = time.perf_counter()
        status, answer = await client.request("POST", "/embeddings", body)
        assert status == 200, answer
        out.append(time.perf_counter() - start)
        await asyncio.sleep(pause)
    client.close()
    return out


async def heavy_client(
    port: int, path: str, body: bytes, stop: asyncio.Event, statuses: Counter, seconds: list[float]
) -> None:
    client = Client(port)
    while not stop.is_set():
        start = time.perf_counter()
        status, _ = await client.request("POST", path, body)
        seconds.append(time.perf_counter() - start)
        statuses[path, status] += 1
    client.close()


async def forward_totals(port: int) -> dict[str, tuple[float, float]]:
    """Per task: (forward passes, seconds in them) so far, from the server's /metrics."""
    _, text = await Client(port).request("GET", "/metrics")
    totals: dict[str, list[float]] = {}
    for line in text.decode().splitlines():
        m = re.match(r'bert_forward_duration_seconds_(count|sum)\{.*task="(\w+)".*\} (\S+)$', line)
        if m:
            totals.setdefault(m.group(2), [0.0, 0.0])[m.group(1) == "sum"] += float(m.group(3))
    return {task: (count, total) for task, (count, total) in totals.items()}


async def starvation(port: int, tokenizer, seconds: float) -> list[str]:
    text = text_of(tokenizer, 512)
    masked = " ".join(["[MASK]"] + text.split()[1:])
    heavy = [("/embeddings", json.dumps({"inputs": [text] * 64}).encode())] * 2
    heavy += [("/fill-mask", json.dumps({"inputs": [masked] * 64, "top_k": 16}).encode())] * 2
    await probe(port, 1.0)  # warm-up
    idle = await probe(port, seconds)
    stop, statuses, heavy_seconds = asyncio.Event(), Counter(), []
    clients = [asyncio.create_task(heavy_client(port, p, b, stop, statuses, heavy_seconds)) for p, b in heavy]
    await asyncio.sleep(2.0)  # the heavy requests are in the queue and running
    before = await forward_totals(port)
    loaded = await probe(port, seconds)
    after = await forward_totals(port)
    stop.set()
    await asyncio.gather(*clients)
    passes = {t: (after[t][0] - before.get(t, (0, 0))[0], after[t][1] - before.get(t, (0, 0))[1]) for t in after}
    ratio = statistics.median(loaded) / statistics.median(idle)
    med = statistics.median
    heavy_counts = ", ".join(f"{p} {s} x{n}" for (p, s), n in sorted(statuses.items()))
    pass_times = ", ".join(f"{t} {n:.0f} x {1000 * sec / n:.0f} ms on average" for t, (n, sec) in passes.items() if n)
    return [
        "| one-word /embeddings | requests | median ms | p90 ms | max ms |",
        "|---|---:|---:|---:|---:|",
        (f"| idle | {len(idle)} | {1000 * med(idle):.1f} | {1000 * pct(idle, 0.9):.1f} | {1000 * max(idle):.1f} |"),
        (
            f"| beside 4 clients sending the largest requests | {len(loaded)} | {1000 * med(loaded):.1f} | "
            f"{1000 * pct(loaded, 0.9):.1f} | {1000 * max(loaded):.1f} |"
        ),
        "",
        f"- loaded / idle median: {ratio:.1f}x; loaded median {med(loaded):.3f} s (target < 1 s)",
        f"- the 4 heavy clients: {heavy_counts}; their median {med(heavy_seconds):.1f} s per request",
        (
            "- forward passes while probing (a probe waits for the one under way and the first pass of any "
            f"request ahead of it): {pass_times}"
        ),
    ]


# -- 3. hostile data ---------------------------------------------------------------------------

BOUNDARY = "benchboundary"


def multipart(filename: str, data: bytes, **fields: str) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    parts.append(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n".encode()
        + data
        + b"\r\n"
    )
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def save_many_label_classifier(data_dir: Path, tokenizer, labels: int) -> None:
    import torch

    from model.config import BertConfig
    from model.modeling import BertForSequenceClassification

    shape = {
        "vocab_size": 30522,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
    }
    torch.manual_seed(0)
    config = BertConfig(**shape, id2label={i: f"label-{i}" for i in range(labels)})
    BertForSequenceClassification(config).eval().save_pretrained(data_dir / "models" / "many", tokenizer=tokenizer)


def write_long_curve(data_dir: Path, lines: int) -> str:
    sys.path.insert(0, str(ROOT))
    from datadir import JobRecords

    store = JobRecords(data_dir)
    spec = {
        "kind": "finetune",
        "model_name": "curve",
        "base_model": "bench",
        "dataset": "d",
        "params": {"task": "sequence-classification", "max_steps": lines},
        "estimate": {},
    }
    job_id = store.create(spec)["id"]
    with open(store.job_dir(job_id) / "metrics.jsonl", "w") as f:
        for step in range(1, lines + 1):
            f.write(
                json.dumps(
                    {
                        "type": "train",
                        "step": step,
                        "loss": 1.0 / step,
                        "lr": 1e-4,
                        "tokens_per_s": 1e4,
                        "epoch": step / lines,
                    }
                )
                + "\n"
            )
    store.update(job_id, lambda r: r.update(state="running"))
    return job_id


async def hold_stream(port: int, path: str, seconds: float) -> tuple[int, int]:
    """GET an event stream, read it for `seconds` (or to its end): (status, bytes read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**24)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    status, total, stop = 0, 0, time.perf_counter() + seconds
    try:
        status = int((await reader.readline()).split()[1])
        while (left := stop - time.perf_counter()) > 0:
            chunk = await asyncio.wait_for(reader.read(1 << 16), left)
            if not chunk:
                break
            total += len(chunk)
    except (TimeoutError, ConnectionError):
        pass
    writer.close()
    return status, total


async def beside_probe(port: int, pid: int, label: str, work, min_seconds: float = 3.0) -> tuple[list[str], float]:
    """Run `work()` (-> (status text, answer bytes)) again and again for at least `min_seconds`, with the
    /embeddings probe beside it: a table row (the slowest run's seconds) and the probe's median."""
    before, latencies, runs = rss_mb(pid), [], []
    task = asyncio.create_task(probe_into(port, latencies))
    await asyncio.sleep(0.5)
    latencies.clear()
    start = time.perf_counter()
    while not runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        status, size = await work()
        runs.append(time.perf_counter() - t0)
    task.cancel()
    after = rss_mb(pid)
    median = statistics.median(latencies)
    return [
        f"| {label} | {status} | {len(runs)} | {max(runs):.2f} | {size} | {before:.0f} -> {after:.0f} | "
        f"{len(latencies)} | {1000 * median:.1f} |"
    ], median


async def probe_into(port: int, out: list[float]) -> None:
    client, body = Client(port), json.dumps({"inputs": "hello"}).encode()
    while True:
        start = time.perf_counter()
        status, _ = await client.request("POST", "/embeddings", body)
        out.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)


async def hostile(port: int, pid: int, data_dir: Path, curve_job: str, seconds: float) -> list[str]:
    client = Client(port)
    idle = await probe(port, seconds)
    idle_median = statistics.median(idle)

    names = iter(range(10**6))

    def upload(filename: str, data: bytes, **fields):
        async def go():
            body = multipart(filename, data, name=f"{Path(filename).stem}-{next(names)}", **fields)
            status, answer = await client.request(
                "POST", "/datasets", body, f"multipart/form-data; boundary={BOUNDARY}"
            )
            return f"{status} `{answer.decode()[:90]}`" if status >= 400 else str(status), len(answer)

        return go

    def post(path: str, body: dict):
        async def go():
            status, answer = await client.request("POST", path, json.dumps(body).encode())
            return f"{status} `{answer.decode()[:90]}`" if status >= 400 else str(status), len(answer)

        return go

    async def get_datasets():
        status, answer = await client.request("GET", "/datasets")
        return str(status), len(answer)

    async def streams():
        results = await asyncio.gather(*(hold_stream(port, f"/jobs/{curve_job}/events", 10) for _ in range(30)))
        counts = Counter(status for status, _ in results)
        return ", ".join(f"{s} x{n}" for s, n in sorted(counts.items())), sum(size for _, size in results)

    labels_csv = ("text,label\n" + "".join(f"t{i},l{i}\n" for i in range(1_000_000))).encode()
    tags = "".join(f"w B-T{i}\n\n" for i in range(500_000)).encode()
    ten_k = ("text,label\n" + "".join(f"text {i},label-{i}\n" for i in range(10_000))).encode()
    dump = (
        b"<mediawiki>\n<page><title>A</title><revision><text>"
        + b"word " * ((8 << 20) // 5)
        + b"</text></revision></page>\n</mediawiki>\n"
    )
    one_line = b"word " * (100 * 10**6 // 5)
    cases = [
        ("16 MB CSV, 1 M distinct labels", upload("labels.csv", labels_csv)),
        ("CoNLL, 500 k tags", upload("tags.conll", tags)),
        ("CSV, 10 k labels (the limit)", upload("tenk.csv", ten_k)),
        ("GET /datasets with it stored", get_datasets),
        ("/classify, 100 k-label model", post("/classify", {"inputs": ["a short text"] * 8, "model": "many"})),
        ("/predict, 100 k-label model", post("/predict", {"inputs": [["a short text"]] * 8, "model": "many"})),
        ("30 event streams, 200 k-line curve (10 s)", streams),
        (".txt starting <mediawiki, 8 MB element", upload("dump.txt", dump, kind="corpus")),
        ("100 MB single-line corpus .txt", upload("line.txt", one_line, kind="corpus")),
    ]
    lines = [
        "| reproduction | status | runs | seconds (slowest) | answer bytes | server RSS MB | probes | "
        "probe median ms |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    ratios = []
    for label, work in cases:
        row, median = await beside_probe(port, pid, label, work)
        lines += row
        ratios.append((label, median / idle_median))
    client.close()
    lines += [
        "",
        f"- idle probe median {1000 * idle_median:.1f} ms; probe median / idle, per reproduction: "
        + "; ".join(f"{label} {r:.1f}x" for label, r in ratios),
    ]
    return lines


# `bert ARGS...` in this process, then its peak RSS (VmHWM, KiB: ru_maxrss would include the parent's,
# inherited at fork) on stdout's last line, whatever the outcome.
BUILD_AND_REPORT_RSS = """
import sys
from pathlib import Path
from app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM")))
sys.exit(code)
"""


def corpus_build_rss(work: Path) -> list[str]:
    """`bert corpus build` on a 16 KB .bz2 holding one 300 MiB line, and on an XML bomb, in subprocesses."""
    line = work / "one-line.txt.bz2"
    with bz2.open(line, "wb") as f:
        for _ in range(300):
            f.write(b"word " * ((1 << 20) // 5) + b"word ")
    bomb = work / "bomb.xml"
    bomb.write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE mediawiki [<!ENTITY a "'
        + "a" * 1000
        + '">'
        + "".join(f'<!ENTITY e{i} "' + f"&e{i - 1};" * 10 + '">' if i else '<!ENTITY e0 "&a;&a;">' for i in range(8))
        + "]>\n<mediawiki><page><title>&e7;</title></page></mediawiki>\n"
    )
    out = ["| `bert corpus build` input | seconds | outcome | peak RSS of the build, MB |", "|---|---:|---|---:|"]
    for path, label in (
        (line, f"{line.stat().st_size / 1024:.0f} KB .bz2, one 300 MiB line"),
        (bomb, "entity-expansion .xml (10^8 x 1 KB)"),
    ):
        start = time.perf_counter()
        argv = [
            "corpus",
            "build",
            str(path),
            "--out",
            str(work / f"store-{path.stem}"),
            "--tokenizer",
            str(work / "models" / "bench"),
        ]
        run = subprocess.run(
            [sys.executable, "-c", BUILD_AND_REPORT_RSS, *argv], capture_output=True, text=True, cwd=ROOT
        )
        seconds = time.perf_counter() - start
        peak = int(run.stdout.strip().splitlines()[-1]) / 1024
        outcome = "built" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1][:100]
        out.append(f"| {label} | {seconds:.1f} | {outcome} | {peak:.0f} |")
    return out


# -- 4. reranking ------------------------------------------------------------------------------

RERANK_MODEL = "bench-rerank"


def save_reranker(data_dir: Path, tokenizer) -> None:
    """A cross-encoder for /rerank: live.py's shape, one label, random weights."""
    import torch

    from model.config import BertConfig
    from model.modeling import BertForSequenceClassification

    shape = {
        "vocab_size": 30522,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
    }
    torch.manual_seed(0)
    config = BertConfig(**shape, id2label={0: "LABEL_0"})
    BertForSequenceClassification(config).eval().save_pretrained(
        data_dir / "models" / RERANK_MODEL, tokenizer=tokenizer
    )


async def probe_until(port: int, stop: asyncio.Event, out: list[float]) -> None:
    """One-word /embeddings, one at a time, until `stop`: each latency (a probe left waiting counts)."""
    client, body = Client(port), json.dumps({"inputs": "hello"}).encode()
    while not stop.is_set():
        start = time.perf_counter()
        await client.request("POST", "/embeddings", body)
        out.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)
    client.close()


async def rerank(port: int, seconds: float, runs: int) -> list[str]:
    body = json.dumps({"query": "a " * 240000, "texts": ["b"] * 64, "truncate": True, "model": RERANK_MODEL}).encode()
    await probe(port, 1.0)  # warm-up
    idle = await probe(port, seconds)
    client, stop, beside, outcomes = Client(port), asyncio.Event(), [], []
    prober = asyncio.create_task(probe_until(port, stop, beside))
    await asyncio.sleep(0.5)
    beside.clear()
    for _ in range(runs):
        start = time.perf_counter()
        status, answer = await client.request("POST", "/rerank", body)
        outcomes.append((status, time.perf_counter() - start, answer))
    await asyncio.sleep(1.0)  # what the server still does for it shows in the probes after the answer
    stop.set()
    await prober
    client.close()
    med = statistics.median
    statuses = Counter(status for status, _, _ in outcomes)
    status, _, answer = outcomes[-1]
    return [
        f"| /rerank reproduction | body | status | seconds (max of {runs}) | probes beside | probe median ms | "
        "probe p90 ms | probe median / idle |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        (
            f'| `"a " * 240000` x 64 texts, truncate | {len(body) / 1024:.0f} KB | '
            f"{', '.join(f'{s} x{n}' for s, n in statuses.items())} | {max(t for _, t, _ in outcomes):.2f} | "
            f"{len(beside)} | {1000 * med(beside):.1f} | {1000 * pct(beside, 0.9):.1f} | "
            f"{med(beside) / med(idle):.1f}x |"
        ),
        "",
        f"- idle probe median {1000 * med(idle):.1f} ms over {len(idle)} requests",
        f"- answer: `{answer.decode()[:200]}`" if status != 200 else "- answer: 200",
    ]


# -- 5. model thrash ----------------------------------------------------------------------------

THRASH_MODELS = [f"enc-{i}" for i in range(6)]  # unpinned encoders of live.py's shape
NEIGHBOUR_PAUSE_S = 1.0  # a modest neighbour: one request a second, so recency alone does not keep its model
THRASH_KEYS = {  # name -> (scopes, limits)
    "neighbour": (["inference"], {}),
    "thrash": (["inference"], {}),
    "limited": (["inference"], {"rps": 2.0}),
    "burst": (["inference"], {}),
    "ops": (["inference", "metrics"], {}),
}


def save_encoders(data_dir: Path, tokenizer) -> None:
    import torch

    from model.config import BertConfig
    from model.modeling import BertModel

    shape = {
        "vocab_size": 30522,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
    }
    for seed, name in enumerate(THRASH_MODELS, 1):
        torch.manual_seed(seed)
        BertModel(BertConfig(**shape)).eval().save_pretrained(data_dir / "models" / name, tokenizer=tokenizer)


def write_thrash_keys(data_dir: Path) -> dict[str, str]:
    """DATA_DIR/keys.toml with THRASH_KEYS; their secrets by name."""
    sys.path.insert(0, str(ROOT))
    from app.keys.keyfile import Key, hash_secret, new_secret, write_keys

    secrets = {name: new_secret() for name in THRASH_KEYS}
    keys = {
        name: Key(name, hash_secret(secrets[name]), frozenset(scopes), **limits)
        for name, (scopes, limits) in THRASH_KEYS.items()
    }
    write_keys(data_dir / "keys.toml", keys)
    return secrets


def thrash_budget_gb(data_dir: Path, models: float) -> float:
    """A budget that holds the neighbour's model, `models` - 1 of the thrashed encoders and one working set at the
    default BERT_MAX_BATCH_TOKENS, each model counted in fp32 as the registry counts it (model/sizing.py: its
    weights, and oneDNN's reordered copies of its dense weights where oneDNN runs)."""
    import torch

    from model.compute import kernels
    from model.config import BertConfig
    from model.modeling import BertForPreTraining, BertModel
    from model.sizing import engine_working_bytes, inference_weight_bytes, packed_weight_bytes

    def counted(name: str, cls) -> int:
        config = BertConfig.from_json_file(data_dir / "models" / name / "config.json")
        with torch.device("meta"):
            parameters = cls(config).num_parameters()
        packed = packed_weight_bytes(config, cls.__name__, "fp32") if kernels.expected("onednn-fp32") else 0
        return inference_weight_bytes(config, parameters, "fp32") + packed

    config = BertConfig.from_json_file(data_dir / "models" / "bench" / "config.json")
    total = counted("bench", BertForPreTraining) + (models - 1) * counted(THRASH_MODELS[0], BertModel)
    return (total + engine_working_bytes(config, 4096, "fp32")) / 2**30


class PeakRss:
    """The server's RSS, read every 10 ms in a thread: the peak since the last reset."""

    def __init__(self, pid: int):
        import threading

        self.pid, self.peak, self.stopped = pid, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(0.01):
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except (FileNotFoundError, RuntimeError):
                return

    def reset(self) -> None:
        self.peak = rss_mb(self.pid)

    def stop(self) -> None:
        self.stopped.set()


async def probe_model(port: int, key: str, model: str, seconds: float, failed: Counter | None = None) -> list[float]:
    """The neighbour: one-word /embeddings on its own model, one a second, for `seconds`: each latency (a
    refusal's too, its status counted in `failed`)."""
    client, body, out = Client(port, key), json.dumps({"inputs": "hello", "model": model}).encode(), []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        start = time.perf_counter()
        status, _ = await client.request("POST", "/embeddings", body)
        out.append(time.perf_counter() - start)
        if status != 200 and failed is not None:
            failed[status] += 1
        await asyncio.sleep(NEIGHBOUR_PAUSE_S)
    client.close()
    return out


async def alternate(
    port: int, key: str, models: list[str], stop: asyncio.Event, statuses: Counter, pace: float
) -> None:
    """The thrasher: one-word /embeddings naming each of `models` in turn, back to back (`pace`: at least
    that many seconds apart), 50 ms of rest after a refusal."""
    client = Client(port, key)
    bodies = [json.dumps({"inputs": "hello", "model": m}).encode() for m in models]
    i = 0
    while not stop.is_set():
        start = time.perf_counter()
        status, _ = await client.request("POST", "/embeddings", bodies[i % len(bodies)])
        statuses[status] += 1
        i += 1
        await asyncio.sleep(max(pace - (time.perf_counter() - start), 0.05 if status != 200 else 0.0))
    client.close()


async def model_loads(port: int, key: str) -> float:
    _, text = await Client(port, key).request("GET", "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.decode().splitlines()
        if line.startswith("bert_model_loads_total{")
    )


async def counted_memory(port: int, key: str, stop: asyncio.Event, peak: list[float]) -> None:
    """Poll GET /models every 50 ms: the most its memory section counted (loaded, held and working set), MB."""
    client = Client(port, key)
    while not stop.is_set():
        _, answer = await client.request("GET", "/models")
        memory = json.loads(answer)["memory"]
        counted = memory["loaded_bytes"] + memory.get("held_bytes", 0) + memory["working_set_bytes"]
        peak[0] = max(peak[0], counted / 2**20)
        await asyncio.sleep(0.05)
    client.close()


async def thrash(
    port: int, pid: int, secrets: dict[str, str], tokenizer, seconds: float, budget_mb: float
) -> list[str]:
    rss = PeakRss(pid)
    base = rss_mb(pid)  # no model loaded yet (BERT_LOAD=lazy)
    neighbour, ops = secrets["neighbour"], secrets["ops"]
    await probe_model(port, neighbour, "bench", 1.0)  # loads the neighbour's model and warms it
    idle = await probe_model(port, neighbour, "bench", seconds)
    idle_p50 = statistics.median(idle)
    lines = [
        f"budget {budget_mb:.0f} MB (BERT_MODEL_MEMORY_GB); server RSS before any model {base:.0f} MB, so budget + "
        f"base = {budget_mb + base:.0f} MB",
        "",
        "| neighbour's one-word /embeddings on its model, beside | requests | not 200 | p50 ms | p90 ms | p50 / idle "
        "| the other key's statuses | loads | peak RSS MB | peak - (budget + base) MB |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|",
        f"| nothing (idle) | {len(idle)} | | {1000 * idle_p50:.1f} | {1000 * pct(idle, 0.9):.1f} | 1.0x | | | "
        f"{rss.peak:.0f} | {rss.peak - budget_mb - base:+.0f} |",
    ]
    cases = [
        ("one key alternating two models, back to back", "thrash", 0.0),
        ("one key alternating two models at 2 requests/s (its rps)", "limited", 0.5),
    ]
    for label, key, pace in cases:
        stop, statuses, failed = asyncio.Event(), Counter(), Counter()
        loads = await model_loads(port, ops)
        rss.reset()
        task = asyncio.create_task(alternate(port, secrets[key], ["enc-0", "enc-1"], stop, statuses, pace))
        beside = await probe_model(port, neighbour, "bench", seconds, failed)
        stop.set()
        await task
        loads = await model_loads(port, ops) - loads
        p50 = statistics.median(beside)
        shown = ", ".join(f"{s} x{n}" for s, n in sorted(statuses.items()))
        lines.append(
            f"| {label} | {len(beside)} | {', '.join(f'{s} x{n}' for s, n in failed.items()) or 0} | {1000 * p50:.1f} | {1000 * pct(beside, 0.9):.1f} | {p50 / idle_p50:.1f}x | "
            f"{shown} | {loads:.0f} | {rss.peak:.0f} | {rss.peak - budget_mb - base:+.0f} |"
        )
    # Six concurrent requests of 32 x 128 tokens, each on its own model: more models than the budget holds.
    text = text_of(tokenizer, 128)
    stop, counted = asyncio.Event(), [0.0]
    rss.reset()
    poller = asyncio.create_task(counted_memory(port, ops, stop, counted))

    async def one(model: str) -> tuple[int, float]:
        client, start = Client(port, secrets["burst"]), time.perf_counter()
        status, _ = await client.request(
            "POST", "/embeddings", json.dumps({"inputs": [text] * 32, "model": model}).encode()
        )
        client.close()
        return status, time.perf_counter() - start

    burst = await asyncio.gather(*(one(m) for m in THRASH_MODELS))
    stop.set()
    await poller
    rss.stop()
    statuses = Counter(status for status, _ in burst)
    lines += [
        "",
        "| six concurrent requests (32 x 128 tokens), each on its own model | statuses | slowest s | most /models "
        "counted, MB | peak RSS MB | peak - (budget + base) MB |",
        "|---|---|---:|---:|---:|---:|",
        f"| `enc-0` ... `enc-5` | {', '.join(f'{s} x{n}' for s, n in sorted(statuses.items()))} | "
        f"{max(t for _, t in burst):.2f} | {counted[0]:.0f} | {rss.peak:.0f} | {rss.peak - budget_mb - base:+.0f} |",
    ]
    return lines


def run_thrash(data_dir: Path, tokenizer, args: argparse.Namespace) -> None:
    """Part 5 against its own server: a small budget, no pinned model, keys, models loaded on first use."""
    save_encoders(data_dir, tokenizer)
    secrets = write_thrash_keys(data_dir)
    budget_gb = thrash_budget_gb(data_dir, args.thrash_models)
    env = {"MODEL_MEMORY_GB": f"{budget_gb:.6f}", "PINNED_MODELS": "[]", "LOAD": "lazy"}
    proc, port = start_server(data_dir, root=args.root.resolve(), ready="/health", **env)
    try:
        print(f"server from {args.root.resolve()}, {env}\n")
        lines = asyncio.run(thrash(port, proc.pid, secrets, tokenizer, args.seconds, budget_gb * 1024))
        print("\n".join(lines) + "\n", flush=True)
    finally:
        stop_server(proc)


# -- 6. batches beside online traffic ------------------------------------------------------------


async def upload_batch(client: Client, name: str, line_body: dict, lines: int) -> str:
    """A /v1/embeddings batch file of `lines` lines through POST /v1/files, then POST /v1/batches: its id."""
    data = "".join(
        json.dumps({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/embeddings", "body": line_body}) + "\n"
        for i in range(lines)
    ).encode()
    status, answer = await client.request(
        "POST",
        "/v1/files",
        multipart(f"{name}.jsonl", data, purpose="batch"),
        f"multipart/form-data; boundary={BOUNDARY}",
    )
    assert status == 200, answer[:300]
    body = {"input_file_id": json.loads(answer)["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    status, answer = await client.request("POST", "/v1/batches", json.dumps(body).encode())
    assert status == 200, answer[:300]
    return json.loads(answer)["id"]


async def batches(port: int, pid: int, tokenizer, seconds: float, lines: int) -> list[str]:
    client = Client(port)
    await probe(port, 1.0)  # warm
    idle = await probe(port, seconds)
    before = rss_mb(pid)
    body = {"model": "bench", "input": text_of(tokenizer, 128)}
    ids = [await upload_batch(client, f"b{i}", body, lines) for i in range(3)]
    rss = PeakRss(pid)
    rss.reset()
    beside: list[float] = []
    failed: Counter = Counter()
    probe_client, probe_body = Client(port), json.dumps({"inputs": "hello"}).encode()
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        start = time.perf_counter()
        status, _ = await probe_client.request("POST", "/embeddings", probe_body)
        beside.append(time.perf_counter() - start)
        if status != 200:
            failed[status] += 1
        await asyncio.sleep(0.1)
    probe_client.close()
    states = []
    for batch_id in ids:
        _, answer = await client.request("GET", f"/v1/batches/{batch_id}")
        record = json.loads(answer)
        states.append(f"{record['status']} {record['request_counts']['completed']:,}")
        await client.request("POST", f"/v1/batches/{batch_id}/cancel")
    rss.stop()
    client.close()
    idle_p50, p50 = statistics.median(idle), statistics.median(beside)
    return [
        f"three batches of {lines:,} /v1/embeddings lines (128 tokens each) on `bench`, beside a one-word /embeddings "
        f"probe; server RSS {before:.0f} MB before the uploads",
        "",
        "| one-word /embeddings, beside | requests | not 200 | p50 ms | p90 ms | p50 / idle | the batches (status, lines "
        "done) | peak RSS MB |",
        "|---|---:|---|---:|---:|---:|---|---:|",
        f"| nothing (idle) | {len(idle)} | | {1000 * idle_p50:.1f} | {1000 * pct(idle, 0.9):.1f} | 1.0x | | {before:.0f} |",
        f"| three batches | {len(beside)} | {', '.join(f'{s} x{n}' for s, n in failed.items()) or 0} | {1000 * p50:.1f} | "
        f"{1000 * pct(beside, 0.9):.1f} | {p50 / idle_p50:.1f}x | {'; '.join(states)} | {rss.peak:.0f} |",
    ]


def run_batches(data_dir: Path, tokenizer, args: argparse.Namespace) -> None:
    """Part 6 against its own server, default settings."""
    proc, port = start_server(data_dir, root=args.root.resolve())
    try:
        print(f"server from {args.root.resolve()}, default settings\n")
        lines = asyncio.run(batches(port, proc.pid, tokenizer, args.seconds, args.batch_lines))
        print("\n".join(lines) + "\n", flush=True)
    finally:
        stop_server(proc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="probing time, idle and loaded (default 30)")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run the server from (default this one)")
    parser.add_argument("--skip-oversize", action="store_true", help="leave out part 1")
    parser.add_argument("--skip-hostile", action="store_true", help="leave out part 3")
    parser.add_argument("--only-hostile", action="store_true", help="run part 3 alone")
    parser.add_argument("--only-rerank", action="store_true", help="run part 4 (reranking) alone")
    parser.add_argument("--rerank-runs", type=int, default=3, help="reranking reproductions sent (default 3)")
    parser.add_argument("--only-thrash", action="store_true", help="run part 5 (model thrash) alone")
    parser.add_argument(
        "--thrash-models",
        type=float,
        default=2.5,
        help="part 5's budget, in models (default 2.5: the neighbour's, one more and half another)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        help="BERT_MAX_BATCH_TOKENS for the server (default: its "
        "default); it sets the length of a pass, so the longest a small request can wait",
    )
    parser.add_argument("--only-batches", action="store_true", help="run part 6 (batches beside online traffic) alone")
    parser.add_argument("--batch-lines", type=int, default=50_000, help="part 6: lines per batch (default 50,000)")
    args = parser.parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="bertserve-bounds-"))
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    tokenizer = save_models(data_dir)
    if args.only_thrash:
        run_thrash(data_dir, tokenizer, args)
        return
    if args.only_batches:
        run_batches(data_dir, tokenizer, args)
        return
    save_reranker(data_dir, tokenizer)
    hostile_too = not args.skip_hostile and not args.only_rerank
    if hostile_too:
        save_many_label_classifier(data_dir, tokenizer, 100_000)
        curve_job = write_long_curve(data_dir, 200_000)
    env = {"MAX_BATCH_TOKENS": str(args.max_batch_tokens)} if args.max_batch_tokens else {}
    proc, port = start_server(data_dir, root=args.root.resolve(), **env)
    try:
        print(
            f"server from {args.root.resolve()}, {env or 'default settings'}, RSS after start "
            f"{rss_mb(proc.pid):.0f} MB\n"
        )
        if not (args.only_hostile or args.only_rerank):
            if not args.skip_oversize:
                print("\n".join(asyncio.run(oversize(port, proc.pid, tokenizer))) + "\n", flush=True)
            print("\n".join(asyncio.run(starvation(port, tokenizer, args.seconds))) + "\n", flush=True)
        if hostile_too:
            print(
                "\n".join(asyncio.run(hostile(port, proc.pid, data_dir, curve_job, min(args.seconds, 10)))) + "\n",
                flush=True,
            )
        if not args.only_hostile:
            print("\n".join(asyncio.run(rerank(port, args.seconds, args.rerank_runs))) + "\n", flush=True)
    finally:
        stop_server(proc)
    if hostile_too:
        print("\n".join(corpus_build_rss(data_dir)))


if __name__ == "__main__":
    main()
