"""A live `bert serve` for the load benchmarks (bench/bounds_bench.py, bench/soak.py, bench/peer_bench.py):
models saved into a temporary DATA_DIR, the server started as its own process (from this checkout or
another, to compare before and after), its resident memory read from /proc, a keep-alive HTTP/1.1
client that reads whole answers and survives closed connections, and a closed-loop load of them.

Models: "bench", BertForPreTraining with 4 layers, hidden 256, 4 heads and 512 positions (as
bench/serve_bench.py), and "bench-clf", a BertForSequenceClassification of the same shape with
labels negative/positive; random weights, the all-MiniLM-L6-v2 WordPiece vocabulary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import MINILM_DIR  # noqa: E402
from model.config import BertConfig  # noqa: E402
from model.modeling import BertForPreTraining, BertForSequenceClassification  # noqa: E402
from model.tokenizer import BertTokenizer  # noqa: E402


def save_models(data_dir: Path) -> BertTokenizer:
    tokenizer = BertTokenizer.from_pretrained(MINILM_DIR)
    shape = {
        "vocab_size": 30522,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
    }
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(**shape)).eval().save_pretrained(data_dir / "models" / "bench", tokenizer=tokenizer)
    config = BertConfig(**shape, id2label={0: "negative", 1: "positive"})
    BertForSequenceClassification(config).eval().save_pretrained(data_dir / "models" / "bench-clf", tokenizer=tokenizer)
    return tokenizer


def text_of(tokenizer: BertTokenizer, tokens: int, words: str = "the quick brown fox jumps over a lazy dog") -> str:
    """A text that tokenises to exactly `tokens` tokens, [CLS] and [SEP] included."""
    ids = tokenizer.encode((words + " ") * tokens, max_length=tokens, truncation=True)["input_ids"][1:-1]
    text = tokenizer.decode(ids)
    assert len(tokenizer.encode(text)["input_ids"]) == tokens
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    data_dir: Path,
    root: Path = ROOT,
    process_env: dict[str, str] | None = None,
    ready: str = "/ready",
    log: Path | None = None,
    **env: str,
) -> tuple[subprocess.Popen, int]:
    """`python -m app.launcher.server` from `root`, BERT_* settings from `env` (names without the prefix) and
    other environment variables (MALLOC_ARENA_MAX, ...) from `process_env`; started once GET `ready` answers
    200 (`/health` for a server that loads nothing before its first request). Its output goes to `log` (appended),
    else nowhere; a server that exits before it is ready names the log."""
    port = free_port()
    settings = {
        "DATA_DIR": str(data_dir),
        "DEFAULT_MODEL": "bench",
        "LOAD": "startup",
        "API_KEY": "",
        "DEVICE": "cpu",
        **env,
    }
    full_env = {
        **os.environ,
        **{f"BERT_{k.upper()}": str(v) for k, v in settings.items()},
        "PYTHONPATH": str(root),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        **(process_env or {}),
    }
    with open(log, "ab") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as output:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.launcher.server", "--port", str(port)],
            cwd=root,
            env=full_env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(proc, port, path=ready)
    except RuntimeError as e:
        raise RuntimeError(f"{e} (its log: {log})" if log is not None else str(e)) from None
    return proc, port


def wait_ready(
    proc: subprocess.Popen,
    port: int,
    method: str = "GET",
    path: str = "/ready",
    body: bytes = b"",
    timeout: float = 180,
) -> None:
    """Until `method path` answers 200 (bertserve's /ready; any server's real request); a server that
    exits or is still not ready after `timeout` seconds is a RuntimeError (and killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if asyncio.run(one_request(port, method, path, body))[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become ready")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Client:
    """One keep-alive HTTP/1.1 connection, requests one at a time, reopened when the server closes it;
    `key`: sent as `Authorization: Bearer <key>`."""

    def __init__(self, port: int, key: str | None = None):
        self.port = port
        self.auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.reader = self.writer = None

    async def request(
        self, method: str, path: str, body: bytes = b"", content_type: str = "application/json"
    ) -> tuple[int, bytes]:
        for attempt in (1, 2):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port, limit=2**24)
            try:
                return await self._exchange(method, path, body, content_type)
            except (ConnectionError, asyncio.IncompleteReadError, ValueError):
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _exchange(self, method: str, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        self.writer.write(
            (
                f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\n{self.auth}"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("closed")
        length, closing = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                closing = True
        payload = await self.reader.readexactly(length)
        if closing:
            self.close()
        return int(status_line.split()[1]), payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one_request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    client = Client(port)
    try:
        return await client.request(method, path, body)
    finally:
        client.close()


async def closed_loop(
    port: int, path: str, bodies: list[bytes], clients: int, seconds: float, warmup: float
) -> list[tuple[float, float, bool]]:
    """Closed-loop load: `clients` keep-alive connections, client i sending POST `path` with bodies[i],
    bodies[i + clients], ... (cycling), each when its last answer is in, from now until `warmup +
    seconds` have passed (the requests then in flight are awaited). Every request as (sent, answered,
    status was 200), in seconds from the end of the warm-up; a failed connection counts as not 200 and
    is reopened by the next request."""
    start = time.perf_counter()
    origin, stop_at = start + warmup, start + warmup + seconds
    spans: list[tuple[float, float, bool]] = []

    async def client(i: int) -> None:
        conn, k = Client(port), i
        try:
            while (sent := time.perf_counter()) < stop_at:
                try:
                    ok = (await conn.request("POST", path, bodies[k % len(bodies)]))[0] == 200
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    ok = False
                    conn.close()
                    await asyncio.sleep(0.01)  # a dead server would otherwise be a busy loop
                spans.append((sent - origin, time.perf_counter() - origin, ok))
                k += clients
        finally:
            conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return spans
