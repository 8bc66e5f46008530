"""A real uvicorn process: HTTP over a socket, graceful SIGTERM; and the public-bind refusal."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from app.keys.keyfile import Key, hash_secret, new_secret, write_keys
from app.launcher.server import MIN_PUBLIC_KEY_LENGTH, exposure_refusal, is_loopback, listen_refusal, serve
from app.settings import Settings
from tests.app.test_inference import embed_reference

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: Path, port: int, **env_overrides: str) -> subprocess.Popen:
    """`python -m app.launcher.server` on `port`, serving tiny-enc, once /ready answers 200."""
    env = {
        **os.environ,
        "BERT_DATA_DIR": str(data_dir),
        "BERT_DEFAULT_MODEL": "tiny-enc",
        "BERT_DEVICE": "cpu",
        "BERT_LOAD": "startup",
        "BERT_API_KEY": "",
        "BERT_DRAIN_SECONDS": "0",  # no balancer in front: SIGTERM stops at once
        # answers are compared with fp32 references, and auto would measure the shared models in the background
        # (writing their cards) and then serve bf16 where it is native, as tests/helpers.child_env says
        "BERT_PRECISION": "fp32",
        "PYTHONUNBUFFERED": "1",
        **env_overrides,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.launcher.server", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not become ready")
        time.sleep(0.1)


@pytest.mark.slow
def test_real_uvicorn_serves_and_drains_on_sigterm(data_dir, reference, tokenizer):
    """SIGTERM: for BERT_DRAIN_SECONDS the replica serves on with /ready at 503 and every answer closing
    its connection (a balancer takes it out of rotation); a request in flight finishes; then it stops
    accepting and exits."""
    port = free_port()
    proc = start_server(data_dir, port, BERT_GRACEFUL_TIMEOUT="20", BERT_DRAIN_SECONDS="3")
    url = f"http://127.0.0.1:{port}"
    expected = embed_reference(reference["tiny-enc"], tokenizer, "the cat sat")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post("/embeddings", json={"inputs": "the cat sat"})
            assert r.status_code == 200 and "connection" not in r.headers  # kept alive while serving
            # An in-flight request: its body is half sent when SIGTERM arrives, the rest after.
            body = json.dumps({"inputs": "the cat sat"}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                conn.sendall(
                    b"POST /embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body[:10]
                )
                time.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                time.sleep(0.5)
                # Draining: not ready, yet it answers, closing each connection after its answer.
                ready = client.get("/ready")
                assert ready.status_code == 503 and ready.json()["error"].startswith("stopping"), ready.text
                r = client.post("/embeddings", json={"inputs": "the cat sat"})
                assert r.status_code == 200 and r.headers["connection"] == "close", r.headers
                assert r.json() == pytest.approx(expected.tolist(), abs=1e-5)
                conn.sendall(body[10:])
                response = b""
                while chunk := conn.recv(65536):
                    response += chunk
            head, _, payload = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), response
            assert b"connection: close" in head.lower()
            assert json.loads(payload) == pytest.approx(expected.tolist(), abs=1e-5)
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled >= 3, "it stopped before its drain was over"
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert "SIGTERM: draining" in output and "Application shutdown complete" in output, output


def test_ctrl_c_stops_without_a_drain(data_dir):
    port = free_port()
    proc = start_server(data_dir, port, BERT_DRAIN_SECONDS="30")
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert "draining" not in output, output


def test_refuses_public_bind_without_a_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve(host="0.0.0.0", port=free_port(), allow_public=False, settings=Settings(api_key=None, allow_public=False))
    assert exit_info.value.code == 2
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err


def test_an_address_it_cannot_listen_on_is_refused_naming_the_setting_to_change(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = f"refusing to start: 127.0.0.1:{port} is already in use; choose another port with --port or BERT_PORT"
        assert listen_refusal("127.0.0.1", port) == in_use
        assert listen_refusal("localhost", port) == in_use.replace("127.0.0.1", "localhost")  # one of its addresses
        with pytest.raises(SystemExit) as exit_info:
            serve(port=port, settings=Settings(host="127.0.0.1"))
        assert (exit_info.value.code, capsys.readouterr().err) == (2, in_use + "\n")
    assert listen_refusal("192.0.2.1", port) == (  # TEST-NET-1: no machine's own address
        f"refusing to start: cannot listen on 192.0.2.1:{port}: Cannot assign requested address; choose an address "
        "of this machine with --host or BERT_HOST"
    )


def test_loopback_detection():
    """All of 127.0.0.0/8 in the forms the resolver takes, ::1 (plain, bracketed, IPv4-mapped), localhost."""
    assert all(
        is_loopback(h)
        for h in (
            "127.0.0.1",
            "localhost",
            "LocalHost",
            "::1",
            "[::1]",
            "127.0.0.2",
            "127.1",
            "127.255.255.254",
            "::ffff:127.0.0.1",
            "[::ffff:127.9.9.9]",
        )
    )
    assert not any(
        is_loopback(h)
        for h in ("0.0.0.0", "::", "192.168.1.5", "example.com", "128.1", "::ffff:10.0.0.1", "localhost.example.com")
    )


def test_a_blank_key_is_no_key(capsys):
    settings = Settings(api_key="   ", admin_key=" \t")
    assert settings.api_key_value() is None and settings.admin_key_value() is None
    assert Settings(api_key=" s3cret ").api_key_value() == "s3cret"  # HTTP drops the spaces from the header
    with pytest.raises(SystemExit) as exit_info:
        serve(host="0.0.0.0", port=free_port(), settings=settings)
    assert exit_info.value.code == 2
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err


def test_short_keys_are_refused_beyond_loopback_only():
    long_key = "k" * MIN_PUBLIC_KEY_LENGTH
    assert exposure_refusal(Settings(api_key="k" * 15), "0.0.0.0", False) == (
        "refusing to listen on 0.0.0.0: it is reachable beyond this machine and BERT_API_KEY is shorter than 16 "
        "characters. Use a long random key, e.g. `openssl rand -hex 32`."
    )
    assert "BERT_ADMIN_KEY is shorter" in exposure_refusal(Settings(api_key=long_key, admin_key="admin"), "::", False)
    assert "BERT_API_KEY is shorter" in exposure_refusal(
        Settings(api_key="short"), "10.0.0.1", True
    )  # allow_public: no key,
    assert exposure_refusal(Settings(api_key=None), "0.0.0.0", True) is None  # not a weak one
    assert exposure_refusal(Settings(api_key=long_key, admin_key=long_key), "0.0.0.0", False) is None
    assert exposure_refusal(Settings(api_key="short"), "127.1", False) is None
    assert exposure_refusal(Settings(api_key=None), "127.1", False) is None


def _closed_after(conn: socket.socket, limit: float) -> bytes:
    """What the server sent before closing `conn`; socket.timeout if it is still open after `limit` s."""
    received = b""
    conn.settimeout(limit)
    while chunk := conn.recv(65536):
        received += chunk
    return received


@pytest.mark.slow
def test_slow_clients_are_cut_off_and_connections_capped(data_dir):
    """Slow headers and stalled bodies are closed after their timeouts (they stayed open for good); a
    connection past BERT_MAX_CONNECTIONS is a 503 with Retry-After; a Host header builds no redirect."""
    port = free_port()
    proc = start_server(data_dir, port, BERT_HEADER_TIMEOUT="1", BERT_BODY_TIMEOUT="1", BERT_MAX_CONNECTIONS="4")
    address = ("127.0.0.1", port)
    try:
        with socket.create_connection(address) as slow_headers, socket.create_connection(address) as stalled_body:
            slow_headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
            stalled_body.sendall(
                b"POST /embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"inputs": '
            )
            for conn in (slow_headers, stalled_body):  # closed (recv times out after 30 s if left open)
                assert _closed_after(conn, 30) == b""

        # Answered before its body was read (413 on the declared length): trickling the rest keeps
        # the connection open no longer (it stayed open as long as the trickle went on).
        with socket.create_connection(address) as trickle:
            trickle.sendall(
                b"POST /embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 5000000\r\n\r\n{"
            )
            answer = b""
            while b'"error_type":"too_large"}' not in answer:
                answer += trickle.recv(65536)
            start = time.monotonic()
            with pytest.raises(OSError):  # reset or broken pipe once the server has closed
                while time.monotonic() - start < 30:  # a hang check: the server closes after its body timeout
                    trickle.sendall(b"x")
                    time.sleep(0.2)

        # A kept-alive connection gets the header deadline again for its next request.
        with socket.create_connection(address) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                answer += kept.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /health HTTP/1.1\r\n")
            assert _closed_after(kept, 30) == b""

        idle = [socket.create_connection(address) for _ in range(4)]
        try:
            with socket.create_connection(address) as one_too_many:
                one_too_many.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = _closed_after(one_too_many, 30)
        finally:
            for conn in idle:
                conn.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 5" in head.lower(), answer
        assert json.loads(body) == {
            "error": "too many open connections (at most 4); retry later",
            "error_type": "unavailable",
        }

        deadline = time.monotonic() + 30  # the idle ones are gone once the server has seen them close
        while httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503:
            assert time.monotonic() < deadline, "the closed connections still count against BERT_MAX_CONNECTIONS"
            time.sleep(0.2)
        r = httpx.get(f"http://127.0.0.1:{port}/info/", headers={"Host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # still serving
    finally:
        proc.kill()
        proc.wait(10)


def _answer(conn: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP answer read off `conn` (its head and its Content-Length of body); b"" for both at EOF."""
    received = b""
    while b"\r\n\r\n" not in received:
        if not (chunk := conn.recv(65536)):
            return b"", b""
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head, body


@pytest.mark.slow
def test_a_rate_limited_request_keeps_its_connection(data_dir, tmp_path):
    """A 429 is decided from the headers, before the body is read: the rest of the body is read and dropped,
    and the connection serves the next request. Back-to-back posts on one kept-alive httpx connection, half
    of them sending their body after a pause (the refusal goes out before it arrives): every one a 200 or a
    429 with Retry-After, all on that one connection, as many 429s as the server counted. Then, byte by
    byte: the headers, the 429, the body after it, and the next request on the same socket."""
    secrets = {name: new_secret() for name in ("steady", "spent", "boss")}
    write_keys(
        tmp_path / "keys.toml",
        {
            "steady": Key("steady", hash_secret(secrets["steady"]), frozenset({"inference"}), rps=0.05, burst=5),
            "spent": Key("spent", hash_secret(secrets["spent"]), frozenset({"inference"}), rps=0.001, burst=1),
            "boss": Key("boss", hash_secret(secrets["boss"]), frozenset({"admin"})),
        },
    )
    port = free_port()
    proc = start_server(data_dir, port, BERT_KEYS_FILE=str(tmp_path / "keys.toml"))
    body = json.dumps({"inputs": "the cat sat"}).encode()

    def late_body():
        time.sleep(0.05)  # (only makes the refusal likely to go out first; nothing is timed)
        yield body

    def remember_connection(response: httpx.Response) -> None:
        response.extensions["local"] = response.extensions["network_stream"].get_extra_info("client_addr")

    headers = {
        "Authorization": f"Bearer {secrets['steady']}",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),  # (httpx sends a generator's body chunked otherwise)
    }
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            client.event_hooks["response"] = [remember_connection]
            responses = [
                client.post("/embeddings", content=late_body() if i % 2 else body, headers=headers) for i in range(40)
            ]
            statuses = Counter(r.status_code for r in responses)
            assert set(statuses) == {200, 429}, statuses  # (5 at once, then one in 20 s: most are refused)
            for r in responses:
                if r.status_code == 429:
                    assert int(r.headers["retry-after"]) >= 1 and r.json()["error_type"] == "overloaded", r.headers
            assert len({r.extensions["local"] for r in responses}) == 1  # one connection throughout
            usage = client.get("/usage", headers={"Authorization": f"Bearer {secrets['boss']}"}).json()["keys"]
            assert (usage["steady"]["requests"], usage["steady"]["rate_limited"]) == (40, statuses[429])

        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            head = (
                f"POST /embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secrets['spent']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            conn.sendall(head + body)
            assert _answer(conn)[0].startswith(b"HTTP/1.1 200")  # the key's one request; its bucket is empty now
            conn.sendall(head)
            answer, _ = _answer(conn)  # from the headers alone, before the body was sent
            assert answer.startswith(b"HTTP/1.1 429") and b"retry-after: " in answer, answer
            conn.sendall(body)
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, payload = _answer(conn)  # the connection serves on
            assert answer.startswith(b"HTTP/1.1 200") and payload == b'{"status":"ok"}', answer
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def test_a_device_torch_cannot_see_or_int8_on_a_gpu_is_refused_at_start(capsys):
    import torch
    from pydantic import ValidationError

    from app.serving.service import check_precisions

    with pytest.raises(SystemExit) as exit_info:
        serve(host="127.0.0.1", port=free_port(), settings=Settings(device="cuda:7", load="lazy"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("refusing to start: device 'cuda:7' was asked for, but torch sees")

    gpu = torch.device("cuda")  # a device object needs no GPU
    with pytest.raises(ValueError, match="BERT_PRECISION=int8 runs on the CPU only"):
        check_precisions(Settings(precision="int8"), gpu)
    with pytest.raises(ValueError, match="BERT_MODEL_PRECISION asks int8 for a, b"):
        check_precisions(Settings(model_precision={"b": "int8", "a": "int8", "c": "bf16"}), gpu)
    check_precisions(Settings(precision="int8"), torch.device("cpu"))
    assert Settings(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError):
        Settings(device="gpu")
