"""A real uvicorn process: HTTP over a socket, graceful SIGTERM; and the public-bind refusal."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.server import is_loopback, serve
from app.settings import Settings

from .test_inference import embed_reference

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_uvicorn_serves_and_drains_on_sigterm(data_dir, reference, tokenizer):
    port = free_port()
    env = {**os.environ, "BERT_DATA_DIR": str(data_dir), "BERT_DEFAULT_MODEL": "tiny-enc", "BERT_DEVICE": "cpu",
           "BERT_LOAD": "startup", "BERT_GRACEFUL_TIMEOUT": "20", "BERT_API_KEY": "",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "app.server", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.1)

        # An in-flight request: its body is half sent when SIGTERM arrives, the rest after.
        body = json.dumps({"inputs": "the cat sat"}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            conn.sendall(body[10:])
            response = b""
            while chunk := conn.recv(65536):
                response += chunk
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), response
        expected = embed_reference(reference["tiny-enc"], tokenizer, "the cat sat")
        assert json.loads(payload) == pytest.approx(expected.tolist(), abs=1e-5)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert "Application shutdown complete" in output, output


def test_refuses_public_bind_without_a_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve(host="0.0.0.0", port=free_port(), allow_public=False, settings=Settings(api_key=None, allow_public=False))
    assert exit_info.value.code == 2
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err


def test_loopback_detection():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "example.com"))
