"""Soak: minutes of mixed load against a live `bert serve`, with the server's RSS sampled throughout.

32 clients (closed loop: each sends its next request when the last is answered) draw from a fixed
mix: every inference route with small and large inputs, and invalid requests (no mask, too many
masks, a model that does not exist, broken JSON, a wrong type). The server's RSS is read from /proc
every 10 s. The summary (markdown): requests and their statuses, 5xx count, transport errors,
latency per kind, and RSS after the warm-up against RSS at the end (target: 0 5xx, RSS within 10%).

    .venv/bin/python bench/soak.py                  # 10 minutes (docs/benchmarks.md's numbers)
    .venv/bin/python bench/soak.py --minutes 1      # a quick check

Server: bench/live.py's models, default settings.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from live import Client, rss_mb, save_models, start_server, stop_server, text_of


def request_mix(tokenizer) -> list[tuple[str, int, str, bytes]]:
    """(kind, weight, path, body) for each kind of request the clients send."""
    short, long = text_of(tokenizer, 12), text_of(tokenizer, 128)
    masked_long = " ".join(["[MASK]"] + long.split()[1:-1] + ["[MASK]"])

    def j(body) -> bytes:
        return json.dumps(body).encode()

    return [
        ("embeddings small", 20, "/embeddings", j({"inputs": "the quick brown fox"})),
        ("embeddings large", 3, "/embeddings", j({"inputs": [long] * 16})),
        ("openai embeddings", 10, "/v1/embeddings", j({"input": [short, short]})),
        ("fill-mask small", 20, "/fill-mask", j({"inputs": "paris is the [MASK] of france.", "top_k": 5})),
        ("fill-mask large", 3, "/fill-mask", j({"inputs": [masked_long] * 8, "top_k": 20})),
        ("nsp", 10, "/nsp", j({"inputs": [{"text_a": short, "text_b": "penguins cannot fly."}] * 4})),
        ("classify", 10, "/classify", j({"inputs": [short, long], "model": "bench-clf"})),
        ("invalid: no mask", 3, "/fill-mask", j({"inputs": "no mask here"})),
        ("invalid: too many masks", 3, "/fill-mask", j({"inputs": "[MASK] " * 510, "top_k": 100})),
        ("invalid: unknown model", 3, "/embeddings", j({"inputs": "hello", "model": "gpt-9"})),
        ("invalid: broken JSON", 3, "/embeddings", b'{"inputs": "hello"'),
        ("invalid: wrong type", 3, "/nsp", j({"inputs": {"text_a": 1, "text_b": "x"}})),
    ]


async def client(
    port: int,
    mix,
    rng: random.Random,
    stop_at: float,
    statuses: Counter,
    latencies: dict[str, list[float]],
    failures: Counter,
) -> None:
    conn = Client(port)
    weights = [w for _, w, _, _ in mix]
    while time.perf_counter() < stop_at:
        kind, _, path, body = rng.choices(mix, weights)[0]
        start = time.perf_counter()
        try:
            status, _ = await conn.request("POST", path, body)
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            failures[type(e).__name__] += 1
            conn.close()
            continue
        latencies[kind].append(time.perf_counter() - start)
        statuses[kind, status] += 1
    conn.close()


async def sample_rss(pid: int, every: float, stop_at: float, samples: list[tuple[float, float]]) -> None:
    start = time.perf_counter()
    while (now := time.perf_counter()) < stop_at:
        samples.append((now - start, rss_mb(pid)))
        await asyncio.sleep(min(every, max(0.0, stop_at - now)))
    samples.append((time.perf_counter() - start, rss_mb(pid)))


async def soak(port: int, pid: int, mix, seconds: float, clients: int, every: float):
    statuses, latencies, failures, samples = Counter(), defaultdict(list), Counter(), []
    stop_at = time.perf_counter() + seconds
    rngs = [random.Random(i) for i in range(clients)]
    await asyncio.gather(
        sample_rss(pid, every, stop_at, samples),
        *(client(port, mix, rngs[i], stop_at, statuses, latencies, failures) for i in range(clients)),
    )
    return statuses, latencies, failures, samples


def summary(
    mix, statuses: Counter, latencies, failures: Counter, samples, seconds: float, warmup: float, clients: int
) -> str:
    total = sum(statuses.values())
    by_status = Counter()
    for (_, status), n in statuses.items():
        by_status[status] += n
    errors_5xx = sum(n for s, n in by_status.items() if s >= 500)
    warm = next(rss for t, rss in samples if t >= warmup)
    end = samples[-1][1]
    lines = [
        (
            f"**Soak:** {seconds / 60:g} min, {clients} clients, {total} requests ({total / seconds:.1f}/s); "
            f"statuses {dict(sorted(by_status.items()))}; **5xx: {errors_5xx}**; transport errors: "
            f"{dict(failures) or 0}."
        ),
        (
            f"RSS after the {warmup:g} s warm-up **{warm:.0f} MB**, at the end **{end:.0f} MB** "
            f"(**{100 * (end - warm) / warm:+.1f}%**); start {samples[0][1]:.0f} MB, peak "
            f"{max(r for _, r in samples):.0f} MB."
        ),
        "",
        "| kind | requests | statuses | p50 ms | p99 ms |",
        "|---|---:|---|---:|---:|",
    ]
    for kind, *_ in mix:
        lat = sorted(latencies.get(kind, []))
        if not lat:
            continue
        codes = ", ".join(f"{s} x{n}" for (k, s), n in sorted(statuses.items()) if k == kind)
        lines.append(
            f"| {kind} | {len(lat)} | {codes} | {1000 * statistics.median(lat):.0f} | "
            f"{1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f} |"
        )
    lines += ["", "RSS (MB) every sample: " + ", ".join(f"{t:.0f}s {r:.0f}" for t, r in samples)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="load time (default 10)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument(
        "--warmup", type=float, help="seconds before the reference RSS sample (default 60, at most a fifth of the run)"
    )
    parser.add_argument("--every", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the server (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(60.0, seconds / 5)
    data_dir = Path(tempfile.mkdtemp(prefix="bertserve-soak-"))
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    tokenizer = save_models(data_dir)
    mix = request_mix(tokenizer)
    process_env = dict(pair.split("=", 1) for pair in args.server_env)
    proc, port = start_server(data_dir, process_env=process_env)
    try:
        result = asyncio.run(soak(port, proc.pid, mix, seconds, args.clients, args.every))
    finally:
        stop_server(proc)
    print(f"server environment: {process_env or 'as this process'}")
    print(summary(mix, *result, seconds=seconds, warmup=warmup, clients=args.clients))


if __name__ == "__main__":
    main()
