"""Bounded work per request (issue 12, acceptance 1 and 2), measured against a live `bert serve`.

1. Oversized fill-mask: the issue's `{"inputs": "[MASK] " * 510, "top_k": 100}` and 64 copies of it in
   one request, each sent 3 times: status, seconds, and how far the server's RSS moved (target: 422
   in under a second, RSS within 20 MB). Beside them, the largest fill-mask request the limits allow.
2. Starvation: a one-word /embeddings request, sent again and again, idle and while 4 clients keep
   sending the largest requests the limits allow (2 x /embeddings of BERT_MAX_INPUTS inputs of 512
   tokens = BERT_MAX_REQUEST_TOKENS; 2 x /fill-mask of 64 such inputs, one mask each, top_k 16 =
   BERT_MAX_FILL_MASK_CANDIDATES): its median and p90 latency, and loaded / idle (target: median
   under 1 s).

3. Reranking: `{"query": "a " * 240000, "texts": ["b"] * 64, "truncate": true}` to /rerank (a one-label
   classifier of the same shape), sent `--rerank-runs` times one after another while the one-word
   /embeddings probe runs beside it: status, seconds, and the probe's median and p90 against its idle
   median from the same run (target: a 4xx in about a second, the probe within 5x of idle).
   `--only-rerank` runs this part alone.

The server is bench/live.py's (4 layers, hidden 256, 512 positions, CPU), with default settings.
`--root DIR` runs the server from another checkout (e.g. the commit before, for a before/after);
`--skip-oversize` leaves part 1 out (do so for a checkout without the limits: there the 64-copy
request grows the server by gigabytes).

    .venv/bin/python bench/bounds_bench.py                    # about 2 minutes
    .venv/bin/python bench/bounds_bench.py --seconds 10 --skip-oversize --root /tmp/old-checkout
    .venv/bin/python bench/bounds_bench.py --only-rerank --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import re
import shutil
import statistics
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
    cases = [("`\"[MASK] \" * 510`, top_k 100", {"inputs": "[MASK] " * 510, "top_k": 100}),
             ("64 copies of it in one request", {"inputs": ["[MASK] " * 510] * 64, "top_k": 100}),
             ("largest allowed: 64 x 512 tokens, 1 mask, top_k 16", {"inputs": largest, "top_k": 16})]
    for _ in range(3):  # warm-up: a normal request of each route
        await client.request("POST", "/fill-mask", json.dumps({"inputs": "paris is the [MASK] of france."}).encode())
    lines = ["| request | body | status | seconds (max of 3) | answer bytes | server RSS before -> after, MB |",
             "|---|---:|---:|---:|---:|---|"]
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
        lines.append(f"| {label} | {len(payload) / 1024:.1f} KB | {shown} | {max(seconds):.3f} | {len(answer)} | "
                     f"{before:.0f} -> {after:.0f} ({after - before:+.1f}) |")
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


async def heavy_client(port: int, path: str, body: bytes, stop: asyncio.Event, statuses: Counter,
                       seconds: list[float]) -> None:
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
        (f"| beside 4 clients sending the largest requests | {len(loaded)} | {1000 * med(loaded):.1f} | "
         f"{1000 * pct(loaded, 0.9):.1f} | {1000 * max(loaded):.1f} |"),
        "",
        f"- loaded / idle median: {ratio:.1f}x; loaded median {med(loaded):.3f} s (target < 1 s)",
        f"- the 4 heavy clients: {heavy_counts}; their median {med(heavy_seconds):.1f} s per request",
        ("- forward passes while probing (a probe waits for the one under way and the first pass of any "
         f"request ahead of it): {pass_times}"),
    ]


# -- 3. reranking ------------------------------------------------------------------------------

RERANK_MODEL = "bench-rerank"


def save_reranker(data_dir: Path, tokenizer) -> None:
    """A cross-encoder for /rerank: live.py's shape, one label, random weights."""
    import torch

    from model.config import BertConfig
    from model.modeling import BertForSequenceClassification

    shape = {"vocab_size": 30522, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "intermediate_size": 1024}
    torch.manual_seed(0)
    config = BertConfig(**shape, id2label={0: "LABEL_0"})
    BertForSequenceClassification(config).eval().save_pretrained(data_dir / "models" / RERANK_MODEL,
                                                                  tokenizer=tokenizer)


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
    body = json.dumps({"query": "a " * 240000, "texts": ["b"] * 64, "truncate": True,
                       "model": RERANK_MODEL}).encode()
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
        (f"| `\"a \" * 240000` x 64 texts, truncate | {len(body) / 1024:.0f} KB | "
         f"{', '.join(f'{s} x{n}' for s, n in statuses.items())} | {max(t for _, t, _ in outcomes):.2f} | "
         f"{len(beside)} | {1000 * med(beside):.1f} | {1000 * pct(beside, 0.9):.1f} | "
         f"{med(beside) / med(idle):.1f}x |"),
        "",
        f"- idle probe median {1000 * med(idle):.1f} ms over {len(idle)} requests",
        f"- answer: `{answer.decode()[:200]}`" if status != 200 else "- answer: 200",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="probing time, idle and loaded (default 30)")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run the server from (default this one)")
    parser.add_argument("--skip-oversize", action="store_true", help="leave out part 1")
    parser.add_argument("--only-rerank", action="store_true", help="run part 3 (reranking) alone")
    parser.add_argument("--rerank-runs", type=int, default=3, help="reranking reproductions sent (default 3)")
    parser.add_argument("--max-batch-tokens", type=int, help="BERT_MAX_BATCH_TOKENS for the server (default: its "
                        "default); it sets the length of a pass, so the longest a small request can wait")
    args = parser.parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="bertserve-bounds-"))
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    tokenizer = save_models(data_dir)
    save_reranker(data_dir, tokenizer)
    env = {"MAX_BATCH_TOKENS": str(args.max_batch_tokens)} if args.max_batch_tokens else {}
    proc, port = start_server(data_dir, root=args.root.resolve(), **env)
    try:
        print(f"server from {args.root.resolve()}, {env or 'default settings'}, RSS after start "
              f"{rss_mb(proc.pid):.0f} MB\n")
        if not args.only_rerank:
            if not args.skip_oversize:
                print("\n".join(asyncio.run(oversize(port, proc.pid, tokenizer))) + "\n", flush=True)
            print("\n".join(asyncio.run(starvation(port, tokenizer, args.seconds))) + "\n", flush=True)
        print("\n".join(asyncio.run(rerank(port, args.seconds, args.rerank_runs))))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
